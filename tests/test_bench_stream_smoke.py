"""bench/stream.py runs end to end on a small scale and reports what it promises (the figures
themselves are printed by the benchmark, never asserted as timings)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.collector import ROOT

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("client", ["lean", "aiohttp"])
def test_stream_bench_smoke(client):
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "stream.py"), "--clients", "6", "--procs", "2",
         "--events", "4", "--rate", "50", "--client", client],
        cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    (delivery,) = [r for r in records if r.get("figure") == "delivery"]
    assert delivery["bench"] == "stream" and delivery["clients"] == 6
    assert delivery["connected"] == 6 and delivery["stream_clients_seen"] == 6
    assert delivery["expected"] == delivery["delivered"] == 24
    assert delivery["clients_complete"] == 6 and delivery["dropped_clients"] == 0
    assert delivery["client"] == client
    for key in ("p50_ms", "p99_ms", "max_ms", "fanout_p50_ms", "fanout_p99_ms", "post_p50_ms",
                "post_p99_ms", "server_kib_per_client", "server_cpu_s_publishing",
                "client_cpu_s"):
        assert isinstance(delivery[key], int | float), key
    assert "latency p99 ms" in result.stdout  # the table follows the JSON lines
