"""CI smoke of ``rollout-gateway bench viewer`` at a small size (real processes, Chromium):
both modes load the page, the default draws only what is near the screen and all of it
once scrolled to the end, the "draw every token" mode all of it at once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.web.test_browser import CHROMIUM, _unavailable

pytestmark = pytest.mark.browser


@pytest.mark.timeout(300)
def test_bench_viewer_draws_blocks_as_they_scroll_in(tmp_path: Path) -> None:
    if not Path(CHROMIUM).is_file():
        _unavailable(f"chromium not found at {CHROMIUM}")
    cmd = [sys.executable, "-m", "gateway", "bench", "viewer", "--calls", "12",
           "--repeats", "1", "--chromium", CHROMIUM, "--out", str(tmp_path / "out")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=280, check=False)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    doc = json.loads((tmp_path / "out" / "viewer.json").read_text())
    tokens = doc["api"]["tokens"]
    assert doc["api"]["calls"] == 12 and tokens > 12 * 500
    assert doc["api"]["pieces_note"] is None and doc["api"]["distinct_ids"] > 0
    blocks, every = doc["summary"]["blocks"], doc["summary"]["all"]
    assert blocks["tokens_drawn_at_first"] < tokens == blocks["tokens_drawn_at_end"]
    assert every["tokens_drawn_at_first"] == tokens == every["tokens_drawn_at_end"]
    assert blocks["elements_at_first"] < every["elements_at_first"]
    assert "| blocks |" in (tmp_path / "out" / "viewer.md").read_text()
