"""The front's merged ``/status``: a shard that cannot record shows on the merged page."""

from __future__ import annotations

from typing import Any

from gateway.shards.merge import merge_status


def _status(**writer: Any) -> dict[str, Any]:
    base = {"recording": True, "refusal": None, "running": True, "db_ok": True,
            "written": 10, "dropped": 0, "lost": {}, "quarantined": 0, "spool_error": None,
            "failure": None, "last_error": None, "quarantine_file": None}
    return {"backends": [], "trace_writer": base | writer}


def test_one_shard_refusing_makes_the_merged_writer_refuse():
    merged = merge_status(
        [_status(), None, _status(recording=False, refusal="the trace buffer is full",
                                  lost={"memory_full": 2}, dropped=2, written=5)],
        ["http://a", "http://b", "http://c"])["trace_writer"]
    assert merged["recording"] is False and merged["running"] is True
    assert merged["refusal"] == "s2: the trace buffer is full"  # shard 2, not part 1
    assert merged["written"] == 15 and merged["dropped"] == 2
    assert merged["lost"] == {"memory_full": 2}


def test_all_shards_recording_merge_to_recording():
    merged = merge_status([_status(), _status()], ["http://a", "http://b"])["trace_writer"]
    assert merged["recording"] is True and merged["refusal"] is None
    assert merged["written"] == 20
