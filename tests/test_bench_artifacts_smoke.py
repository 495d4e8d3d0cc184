"""bench/artifacts.py runs end to end on a tiny artifact and reports what it promises (the
figures themselves are printed by the benchmark, never asserted as timings)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.collector import ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("sha256sum") is None or not Path("/proc/self/status").exists(),
                       reason="the bench needs sha256sum and /proc"),
]


def test_artifacts_bench_smoke(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "artifacts.py"), "--size-mb", "2",
         "--dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    by_figure = {r["figure"]: r for r in records}
    assert set(by_figure) == {"ceiling", "upload", "download"}
    assert all(r["bench"] == "artifacts" and r["size_mb"] == 2 for r in records)
    for key in ("sha256sum_mb_s", "copy_fsync_mb_s", "issue_ceiling_mb_s",
                "strict_ceiling_mb_s"):
        assert by_figure["ceiling"][key] > 0, key
    # The ceiling uses sha256sum; the strict one the faster of it and openssl.
    assert by_figure["ceiling"]["strict_ceiling_mb_s"] >= by_figure["ceiling"][
        "issue_ceiling_mb_s"]
    for figure in ("upload", "download"):
        assert by_figure[figure]["mb_s"] > 0
    upload = by_figure["upload"]
    assert upload["hwm_after_kib"] >= upload["hwm_before_kib"] > 0
    assert upload["vs_issue_ceiling"] > 0 and upload["vs_strict_ceiling"] > 0
    assert "of the issue's ceiling" in result.stdout and "of the strict one" in result.stdout
    assert "peak RSS growth" in result.stdout  # the table follows the JSON lines
    assert list(tmp_path.iterdir()) == []  # its files are cleaned up
