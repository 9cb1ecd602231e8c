"""A trajectory's calls as the store holds them, built in memory branch by branch: for
tests of what samples and trees are made of them (no database needed)."""

from __future__ import annotations

from datetime import UTC, datetime
from itertools import count

from gateway.store.codec import pack_floats, pack_ids
from gateway.store.models import Call

_ids = count(1000)


class Calls:
    """A trajectory's calls as the gateway stores them, branch by branch."""

    def __init__(self) -> None:
        self.rows: list[Call] = []
        self.seqs: dict[int, list[int]] = {}  # each branch's sequence so far

    def call(self, branch: int, new_prompt: list[int], completion: int, *,
             fork: tuple[int, int] | None = None) -> list[int]:
        """A call on ``branch`` adding ``new_prompt`` and ``completion`` fresh tokens;
        ``fork=(parent, position)`` on a branch's first call. Its completion ids."""
        if fork is not None:
            parent, position = fork
            self.seqs[branch] = self.seqs[parent][:position]
        seq = self.seqs.setdefault(branch, [])
        out = [next(_ids) for _ in range(completion)]
        self.rows.append(Call(
            id=f"c{len(self.rows)}", trajectory_id="t", seq=len(self.rows), attempt=0,
            endpoint="chat", model="m", status="ok", weight_version="0",
            started_at=datetime.now(UTC), queued_ms=0.0, total_ms=1.0,
            prompt_offset=len(seq), prompt_len=len(seq) + len(new_prompt),
            prompt_delta=pack_ids(new_prompt), completion_ids=pack_ids(out),
            completion_logprobs=pack_floats([-0.5] * completion), branch=branch,
            parent_branch=fork[0] if fork else None, backend_id="b", tp=1))
        seq += new_prompt + out
        return out
