"""The spool under faults: one owner per file, and a replay that always ends.

What these guard against (issue 41): two shards sharing one spool file deleted each
other's records (54% of an outage's calls lost); a corrupt line, a record with a field
this version does not know, or a torn last line (a kill or a full disk mid-append) made
the replay loop or die, and every new trajectory's first call got 503 for good. Real
files throughout; the full disk is a real 64 KiB tmpfs and ``/dev/full``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import orjson
import pytest

from gateway.store.quarantine import Quarantine
from gateway.store.records import CallRecord
from gateway.store.spool import Spool, SpoolBusy, default_spool_path, open_spools


def _rec(i: int, tid: str = "t") -> CallRecord:
    return CallRecord(id=f"c{i:06d}", trajectory_id=tid, group_id=None, seq=i,
                      endpoint="chat", model="m", weight_version="0", started_at=time.time(),
                      prompt_delta=[1, 2, 3], completion_ids=[4, 5])


def _replay(spool: Spool) -> list[str]:
    """Every record id a replay reads, in order; fails if a read makes no progress."""
    ids: list[str] = []
    while spool.pending_bytes:
        before = spool.offset
        records, pos = spool.read(3)
        assert pos > before, "a read that moves nothing would loop forever"
        ids += [r.id for r in records]
        spool.commit(pos)
    return ids


def _quarantined(spool: Spool) -> list[dict[str, object]]:
    path = spool.quarantine.path
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


def test_a_second_owner_is_refused_and_the_first_keeps_its_file(tmp_path: Path):
    path = tmp_path / "spool.jsonl"
    with Spool(path, 10**6) as first:
        first.append([_rec(0)])
        with pytest.raises(SpoolBusy, match="in use by another process"):
            Spool(path, 10**6)
        # another process too (flock is per open file, so this holds across processes)
        probe = ("import sys; from pathlib import Path; from gateway.store.spool import "
                 "Spool, SpoolBusy\ntry:\n Spool(Path(sys.argv[1]), 10)\nexcept SpoolBusy:"
                 "\n sys.exit(3)")
        assert subprocess.run([sys.executable, "-c", probe, str(path)]).returncode == 3
        assert first.pending_bytes > 0
    with Spool(path, 10**6) as second:  # given up: the next owner takes it, records intact
        assert _replay(second) == ["c000000"]


def test_each_process_gets_its_own_slot_and_adopts_orphans(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    url = f"postgresql+asyncpg://x/{uuid.uuid4().hex}"
    a, orphans_a = open_spools(url, None, 10**6)
    b, orphans_b = open_spools(url, None, 10**6)
    try:
        assert a.path == default_spool_path(url, 0) and b.path == default_spool_path(url, 1)
        assert orphans_a == orphans_b == []
        a.append([_rec(1)])
        b.append([_rec(2)])
        b.close()  # b's process stops for good, leaving a record in its file
        c, orphans_c = open_spools(url, None, 10**6)  # the next process to start
        try:
            assert c.path == default_spool_path(url, 1)  # the first free slot
            assert orphans_c == []  # its own file now: its records are replayed as its own
            assert _replay(c) == ["c000002"]
        finally:
            c.close()
        a.close()
        d, orphans_d = open_spools(url, None, 10**6)
        e, orphans_e = open_spools(url, None, 10**6)
        try:  # d took slot 0 (a's records: its own); e adopts nothing that is held
            assert _replay(d) == ["c000001"] and orphans_e == []
        finally:
            d.close()
            e.close()
    finally:
        a.close()
        b.close()


def test_an_orphan_beside_a_held_slot_is_adopted(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    url = f"sqlite:///{uuid.uuid4().hex}"
    with Spool(default_spool_path(url, 3), 10**6) as left:  # a shard that is gone
        left.append([_rec(7)])
    own, orphans = open_spools(url, None, 10**6)
    try:
        assert own.path == default_spool_path(url, 0)
        assert [o.path for o in orphans] == [default_spool_path(url, 3)]
        assert _replay(orphans[0]) == ["c000007"]
    finally:
        for s in [own, *orphans]:
            s.close()


def test_undecodable_lines_are_quarantined_and_the_replay_goes_on(tmp_path: Path):
    path = tmp_path / "spool.jsonl"
    newer = orjson.loads(orjson.dumps(_rec(2)))
    newer["routed_experts"] = [[1, 2]]  # a field this version does not know
    path.write_bytes(orjson.dumps(_rec(0)) + b"\n" + b"{not json\n" + orjson.dumps(newer)
                     + b"\n" + b"[1, 2]\n" + orjson.dumps(_rec(4)) + b"\n")
    with Spool(path, 10**6) as spool:
        assert _replay(spool) == ["c000000", "c000004"]
        kinds = [q["kind"] for q in _quarantined(spool)]
        assert kinds == ["corrupt_line", "unknown_field", "corrupt_line"]
        assert spool.quarantine.counts == {"corrupt_line": 2, "unknown_field": 1}
        kept = _quarantined(spool)[1]["line"]
        assert isinstance(kept, str) and "routed_experts" in kept  # kept whole, to feed back


def test_a_torn_tail_left_by_a_kill_is_cut_and_appends_start_clean(tmp_path: Path):
    path = tmp_path / "spool.jsonl"
    whole = orjson.dumps(_rec(0)) + b"\n"
    path.write_bytes(whole + orjson.dumps(_rec(1))[:40])  # killed mid-append
    with Spool(path, 10**6) as spool:
        assert spool.pending_bytes == len(whole)
        assert [q["kind"] for q in _quarantined(spool)] == ["torn_line"]
        spool.append([_rec(2)])
        assert _replay(spool) == ["c000000", "c000002"]


def test_a_fragment_no_append_completed_ends_the_replay(tmp_path: Path):
    """The tail cannot be cut (say the disk went read-only): the reader must still end."""
    path = tmp_path / "spool.jsonl"
    with Spool(path, 10**6) as spool:
        spool.append([_rec(0)])
        with path.open("ab") as fh:  # what a failed append whose undo failed leaves
            fh.write(b'{"id": "c0000')
        spool.size = path.stat().st_size
        assert _replay(spool) == ["c000000"]
        assert spool.quarantine.counts == {"torn_line": 1}


def test_an_append_to_a_full_disk_fails_whole_and_leaves_no_fragment(tmp_path: Path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], check=True)
    try:
        with Spool(mnt / "spool.jsonl", 10**9,
                   quarantine=Quarantine(tmp_path / "q.jsonl")) as spool:
            kept = 0
            for i in range(0, 400, 20):  # ~640 bytes a record: the disk fills mid-way
                out = spool.append([_rec(j) for j in range(i, i + 20)])
                kept += out.kept
                if out.error:
                    assert "No space left" in out.error and out.kept == 0
                    assert [r.id for r in out.refused] == [f"c{j:06d}" for j in range(i, i + 20)]
                    break
            else:
                pytest.fail("a 64 KiB disk took 400 records")
            assert spool.size == (mnt / "spool.jsonl").stat().st_size  # cut back
            assert len(_replay(spool)) == kept
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_unencodable_records_are_quarantined_not_raised(tmp_path: Path):
    deep: object = "leaf"
    for _ in range(300):  # past orjson's 255 levels
        deep = {"x": deep}
    bad = _rec(1)
    bad.request_messages = [deep]
    with Spool(tmp_path / "spool.jsonl", 10**6) as spool:
        out = spool.append([_rec(0), bad, _rec(2)])
        assert out.kept == 2 and out.quarantined == [bad] and out.refused == []
        assert _replay(spool) == ["c000000", "c000002"]
        [entry] = _quarantined(spool)
        assert entry["kind"] == "unencodable"
        assert entry["record"]["id"] == "c000001"  # type: ignore[index]
