"""bench/controlplane_simulate.py runs end to end at its tiny size and prints valid JSON lines,
then its table. Its figures are never asserted: a benchmark is not a timed test."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.controlplane import REPO_ROOT


def test_simulation_benchmark_smoke() -> None:
    result = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "controlplane_simulate.py"),
                             "--quick"], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert {r["figure"] for r in records} == {"build", "replay", "result"}
    assert all(r["bench"] == "controlplane_simulate" for r in records)
    replay = next(r for r in records if r["figure"] == "replay")
    assert replay["counts"] == 5 and isinstance(replay["seconds"], float)
    assert not lines[-1].startswith("{")
