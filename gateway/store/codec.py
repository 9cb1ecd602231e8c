"""Packing of token ids and logprobs into compact bytes (little-endian int32 / float32)."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence

_LITTLE = sys.byteorder == "little"


def pack_ids(ids: Iterable[int]) -> bytes:
    arr = array("i", ids)
    if not _LITTLE:  # pragma: no cover - big-endian hosts
        arr.byteswap()
    return arr.tobytes()


def unpack_ids(blob: bytes | None) -> list[int]:
    if not blob:
        return []
    arr = array("i")
    arr.frombytes(blob)
    if not _LITTLE:  # pragma: no cover
        arr.byteswap()
    return arr.tolist()


def pack_floats(values: Sequence[float] | None) -> bytes | None:
    if values is None:
        return None
    arr = array("f", values)
    if not _LITTLE:  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


def unpack_floats(blob: bytes | None) -> list[float] | None:
    if blob is None:
        return None
    arr = array("f")
    arr.frombytes(blob)
    if not _LITTLE:  # pragma: no cover
        arr.byteswap()
    return arr.tolist()
