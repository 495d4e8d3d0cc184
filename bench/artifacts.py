"""Artifact store throughput and memory: one large artifact uploaded to and downloaded from a
real collector process, next to the ceiling this machine sets for the same work.

    python bench/artifacts.py [--size-mb 1024] [--dir /path/on/the/disk/to/test]

Two ceilings, both measured in the same run on the same disk, since an upload has to hash the
bytes and write them durably:

- the issue's: `sha256sum` of the source file plus a file copy that is fsynced (`cp` then
  `sync`), `size / (sha256sum time + copy time)`;
- a stricter one: the same with the faster of `sha256sum` and `openssl dgst -sha256` (OpenSSL is
  the library behind hashlib; where it uses the CPU's SHA instructions and coreutils does not,
  it hashes several times faster).

Both add the two steps one after the other. The collector overlaps them with each other and
with receiving (the next MiB arrives while the last one is hashed on one thread and written on
another), so it can pass either; the hash alone (`hash_mb_s`) and the copy alone are the hard
bounds. The source file is read from the page cache in every case (it was just written), as the
upload's is.

Memory: the collector's VmHWM (peak resident set) and VmRSS from /proc/<pid>/status before and
after the upload and the download. Uploads stream through a bounded buffer, so the peak should
grow by a few MiB whatever the artifact's size.

Prints one JSON object per line (figures: ceiling, upload, download), then a short table.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import cpu_seconds, free_port, memory_kib, stop_process

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def emit(record: dict[str, Any]) -> None:
    print(json.dumps({"bench": "artifacts", **record}), flush=True)


def make_source(path: Path, size: int) -> str:
    """Write `size` bytes (a random MiB with a running counter) and return their SHA-256."""
    block, digest = os.urandom(MiB - 8), hashlib.sha256()
    with open(path, "wb") as out:
        written = 0
        while written < size:
            piece = (written.to_bytes(8, "big") + block)[:size - written]
            digest.update(piece)
            out.write(piece)
            written += len(piece)
    return digest.hexdigest()


def timed(argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def ceiling(source: Path, size: int) -> dict[str, Any]:
    copy = source.with_name("copy.bin")
    sha256sum_s = timed(["sha256sum", str(source)])
    # OpenSSL is what Python's hashlib uses; where it has SHA instructions coreutils lacks, it
    # is the faster hash and so the honest ceiling.
    openssl_s = (timed(["openssl", "dgst", "-sha256", str(source)])
                 if shutil.which("openssl") else None)
    hash_s = min(sha256sum_s, openssl_s or sha256sum_s)
    copy_s = timed(["sh", "-c", 'cp "$1" "$2" && sync "$2"', "cp", str(source), str(copy)])
    copy.unlink()
    mb = size / MiB
    return {"figure": "ceiling", "size_mb": mb, "sha256sum_s": round(sha256sum_s, 3),
            "sha256sum_mb_s": round(mb / sha256sum_s, 1),
            "openssl_mb_s": round(mb / openssl_s, 1) if openssl_s else None,
            "copy_fsync_s": round(copy_s, 3), "copy_fsync_mb_s": round(mb / copy_s, 1),
            "hash_mb_s": round(mb / hash_s, 1),
            # The definition: sha256sum, then the durable copy.
            "issue_ceiling_mb_s": round(mb / (sha256sum_s + copy_s), 1),
            # The stricter one: the faster hash, then the durable copy.
            "strict_ceiling_mb_s": round(mb / (hash_s + copy_s), 1)}


@contextlib.contextmanager
def collector(data_dir: Path) -> Iterator[tuple[int, int]]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleet_min", "collector", "--port", str(port), "--data",
         str(data_dir), "--bind", "127.0.0.1"],
        env={**os.environ, "PYTHONPATH": str(ROOT), "FLEET_LOG_LEVEL": "WARNING",
             "FLEET_MAX_ARTIFACT_BYTES": str(64 << 30)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                health = f"http://127.0.0.1:{port}/api/health"
                with urllib.request.urlopen(health, timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the collector did not start") from None
                time.sleep(0.05)
        yield port, proc.pid
    finally:
        stop_process(proc)


def upload(port: int, source: Path, size: int) -> tuple[dict[str, Any], float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    started = time.perf_counter()
    conn.putrequest("POST", "/artifacts")
    conn.putheader("Content-Length", str(size))
    conn.putheader("Content-Type", "application/octet-stream")
    conn.putheader("x-artifact-name", source.name)
    conn.endheaders()
    with open(source, "rb") as handle:
        while chunk := handle.read(MiB):
            conn.send(chunk)
    response = conn.getresponse()
    body = json.loads(response.read())
    elapsed = time.perf_counter() - started
    conn.close()
    if response.status != 201:
        raise RuntimeError(f"upload answered {response.status}: {body}")
    return body, elapsed


def download(port: int, sha256: str) -> tuple[int, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    started = time.perf_counter()
    conn.request("GET", f"/artifacts/{sha256}")
    response = conn.getresponse()
    buffer, received = bytearray(MiB), 0
    view = memoryview(buffer)
    while count := response.readinto(view):
        received += count
    elapsed = time.perf_counter() - started
    conn.close()
    if response.status != 200:
        raise RuntimeError(f"download answered {response.status}")
    return received, elapsed


def measure(port: int, pid: int, source: Path, size: int, expected: str) -> list[dict[str, Any]]:
    warm = source.with_name("warm.bin")
    warm.write_bytes(os.urandom(4 * MiB))  # load the code paths before taking the baseline
    download(port, upload(port, warm, 4 * MiB)[0]["sha256"])
    base, cpu0 = memory_kib(pid), cpu_seconds(pid)
    load = Path("/proc/loadavg").read_text().split()[0]  # the machine may be shared
    reply, up_s = upload(port, source, size)
    after_up, cpu1 = memory_kib(pid), cpu_seconds(pid)
    if reply["sha256"] != expected:
        raise RuntimeError(f"stored as {reply['sha256']}, expected {expected}")
    received, down_s = download(port, expected)
    after_down, cpu2 = memory_kib(pid), cpu_seconds(pid)
    if received != size:
        raise RuntimeError(f"downloaded {received} bytes of {size}")
    return [
        {"figure": "upload", "size_mb": size / MiB, "seconds": round(up_s, 3),
         "mb_s": round(size / MiB / up_s, 1), "server_cpu_s": round(cpu1 - cpu0, 2),
         "loadavg_before": load,
         "hwm_before_kib": base["VmHWM"], "hwm_after_kib": after_up["VmHWM"],
         "hwm_growth_kib": after_up["VmHWM"] - base["VmHWM"],
         "rss_before_kib": base["VmRSS"], "rss_after_kib": after_up["VmRSS"]},
        {"figure": "download", "size_mb": size / MiB, "seconds": round(down_s, 3),
         "mb_s": round(size / MiB / down_s, 1), "server_cpu_s": round(cpu2 - cpu1, 2),
         "hwm_growth_kib": after_down["VmHWM"] - after_up["VmHWM"],
         "rss_after_kib": after_down["VmRSS"]},
    ]


def print_table(records: list[dict[str, Any]]) -> None:
    by = {r["figure"]: r for r in records}
    ceil, up, down = by["ceiling"], by["upload"], by["download"]
    rows = [
        ("sha256sum", f"{ceil['sha256sum_mb_s']} MB/s", "hash only (coreutils)"),
        ("openssl dgst", f"{ceil['openssl_mb_s']} MB/s", "hash only (the library hashlib uses)"),
        ("cp + sync", f"{ceil['copy_fsync_mb_s']} MB/s", "durable copy only"),
        ("issue's ceiling", f"{ceil['issue_ceiling_mb_s']} MB/s",
         "sha256sum, then durable copy (the issue's definition)"),
        ("strict ceiling", f"{ceil['strict_ceiling_mb_s']} MB/s",
         "faster hash, then durable copy"),
        ("upload", f"{up['mb_s']} MB/s",
         f"{up['vs_issue_ceiling']:.0%} of the issue's ceiling, "
         f"{up['vs_strict_ceiling']:.0%} of the strict one (load avg {up['loadavg_before']})"),
        ("download", f"{down['mb_s']} MB/s", "served from the page cache"),
        ("peak RSS growth", f"{up['hwm_growth_kib'] / 1024:.1f} MiB",
         f"during the {up['size_mb']:g} MiB upload (VmHWM)"),
        ("RSS after", f"{down['rss_after_kib'] / 1024:.1f} MiB", "after upload and download"),
    ]
    width = max(len(r[0]) for r in rows)
    print()
    for name, value, note in rows:
        print(f"  {name:<{width}}  {value:>14}  {note}")
    print()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=1024,
                        help="artifact size in MiB (default 1024)")
    parser.add_argument("--dir", default=None, help="where the files go (default: a temp dir)")
    args = parser.parse_args()
    size = int(args.size_mb * MiB)
    if shutil.which("sha256sum") is None:
        print("sha256sum is needed for the ceiling", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="fleet-bench-artifacts-") as work:
        source = Path(work) / "source.bin"
        expected = make_source(source, size)
        records = [ceiling(source, size)]
        with collector(Path(work) / "data") as (port, pid):
            records += measure(port, pid, source, size, expected)
    ceil, up = records[0], records[1]
    up["vs_issue_ceiling"] = round(up["mb_s"] / ceil["issue_ceiling_mb_s"], 3)
    up["vs_strict_ceiling"] = round(up["mb_s"] / ceil["strict_ceiling_mb_s"], 3)
    for record in records:
        emit(record)
    print_table(records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
