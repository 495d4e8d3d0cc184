"""Jobs that try to exhaust the machine a real agent runs on, sent to a real collector the way
anyone who can reach it may send them: zips that unpack to far more than they weigh, a benchmark
sized for months of CPU, a job that never ends, and a server opened to the LAN. The agent is a
real process; the only fake is the model converter (an executable on PATH, as llama.cpp is
absent here), which records what the agent unpacked for it."""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import threading
import zipfile
import zlib
from pathlib import Path

import pytest

from tests.support.agent import device_job, free_port, http_bytes, make_tool, wait_for

pytestmark = pytest.mark.slow

# convert_hf_to_gguf.py FOLDER --outfile OUT --outtype f16: notes the folder's files and bytes.
FAKE_CONVERT = r"""
folder, out = sys.argv[1], sys.argv[sys.argv.index("--outfile") + 1]
sizes = [os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(folder) for f in names]
with open(os.environ["FAKE_CONVERT_LOG"], "a") as log:
    log.write(json.dumps({"files": len(sizes), "bytes": sum(sizes)}) + "\n")
open(out, "wb").write(b"GGUF converted")
"""

BLOCK = b"\0" * (16 << 20)


def registered(collector, device_id: str) -> bool:
    return collector.get(f"/api/devices/{device_id}")[0] == 200


def final_row(collector, job_id: str) -> dict:
    return next(r for r in collector.results(job_id) if r["final"])


def ended(collector, job_id: str, timeout: float = 40) -> tuple[str, dict]:
    """(status, final row) of a job once it has ended."""
    status = collector.wait_status(job_id, ("done", "failed", "cancelled"), timeout)["status"]
    return status, wait_for(lambda: next(
        (r for r in collector.results(job_id) if r["final"]), None), 10, what="the final row")


def forged_zip(members: dict[str, bytes], declared: dict[str, int],
               crc_of_declared: bool = False) -> bytes:
    """A zip whose central directory says the `declared` sizes instead of the real ones (what
    an unzip trusts); with crc_of_declared, each checksum is that of the declared prefix."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as bundle:
        for name, data in members.items():
            bundle.writestr(name, data)
        for info in bundle.filelist:
            if info.filename in declared:
                size = declared[info.filename]
                if crc_of_declared:
                    info.CRC = zlib.crc32(members[info.filename][:size])
                info.file_size = size
    return buffer.getvalue()


def many_members(count: int) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as bundle:
        bundle.writestr("m/config.json", "{}")
        for number in range(count):
            bundle.writestr(f"m/{number}", b"")
    return buffer.getvalue()


class DiskWatch(threading.Thread):
    """The most bytes seen at once under a directory while a job runs (its files come and go)."""

    def __init__(self, root: Path) -> None:
        super().__init__(daemon=True)
        self.root = root
        self.peak = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.01):
            total = 0
            for folder, _, names in os.walk(self.root):
                for name in names:
                    with contextlib.suppress(OSError):
                        total += os.lstat(os.path.join(folder, name)).st_size
            self.peak = max(self.peak, total)

    def stop(self) -> int:
        self.done.set()
        self.join(5)
        return self.peak


@pytest.fixture
def converter_agent(procs, tmp_path):
    bin_dir = tmp_path / "bin"
    make_tool(bin_dir, "convert_hf_to_gguf.py", FAKE_CONVERT)
    log = tmp_path / "converted.jsonl"
    collector = procs.collector()
    agent = procs.agent([collector], "unzip-1", env={
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_CONVERT_LOG": str(log)})
    wait_for(lambda: registered(collector, "unzip-1"), 20, what="registration")
    return collector, agent, log


def converted(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def convert(collector, job_id: str, archive: bytes) -> dict:
    sha = collector.upload(archive, job_id + ".zip")
    collector.enqueue(device_job(job_id, "model-convert", model={"name": job_id},
                          params={"input_sha256": sha, "quant": "f16"}))
    return collector.job(job_id)


def test_zips_that_expand_past_the_bounds_are_refused_before_anything_is_written(
        converter_agent):
    collector, agent, log = converter_agent
    # 64 KB of zip whose members declare 4 x 40 GiB (past the 128 GiB an artifact may be, and
    # past this disk); each really inflates to 16 MiB of zeros, which an unzip writes until it
    # notices anything.
    bomb = forged_zip({"m/config.json": b"{}", **{f"m/{n}.bin": BLOCK for n in range(4)}},
                      {f"m/{n}.bin": 40 << 30 for n in range(4)})
    watch = DiskWatch(agent.state / "work")
    watch.start()
    convert(collector, "bomb", bomb)
    status, row = ended(collector, "bomb")
    peak = watch.stop()
    assert status == "failed", row
    assert "unpacks to 171798691842 bytes in 5 files, so it was not unpacked" in row["error"]
    assert peak < 1 << 20, peak
    # 100,001 empty files: refused by their number, in 9 MB of zip.
    convert(collector, "crowd", many_members(100_001))
    status, row = ended(collector, "crowd", 60)
    assert status == "failed", row
    assert "the archive has 100002 members; the agent unpacks at most 100000" in row["error"]
    assert converted(log) == []  # nothing was unpacked for the converter


def test_a_zip_that_lies_about_its_sizes_is_written_only_up_to_them(converter_agent):
    collector, agent, log = converter_agent
    # Declares 1 MiB for 16 MiB of zeros, with the checksum of the first 1 MiB: the member is
    # cut at what it declared, so what the checks were made on is all that reaches the disk.
    liar = forged_zip({"m/config.json": b"{}", "m/w.bin": BLOCK}, {"m/w.bin": 1 << 20},
                      crc_of_declared=True)
    convert(collector, "liar", liar)
    status, row = ended(collector, "liar")
    assert status == "done", row
    assert converted(log) == [{"files": 2, "bytes": (1 << 20) + 2}]
    # The same lie with the checksum of all 16 MiB: the cut member does not match it.
    bad = forged_zip({"m/config.json": b"{}", "m/w.bin": BLOCK}, {"m/w.bin": 1 << 20})
    watch = DiskWatch(agent.state / "work")
    watch.start()
    convert(collector, "bad-crc", bad)
    status, row = ended(collector, "bad-crc")
    assert watch.stop() <= (1 << 20) + 2
    assert status == "failed" and "m/w.bin" in row["error"], row
    assert len(converted(log)) == 1


def test_a_job_past_max_job_seconds_is_stopped_and_the_next_job_runs(procs):
    collector = procs.collector()
    agent = procs.agent([collector], "ceiling-1", "--max-job-seconds", "1.5")
    wait_for(lambda: registered(collector, "ceiling-1"), 20, what="registration")
    # About 80 s of synthetic work (24,576 tokens at ~3 ms), within the benchmark's own bound.
    collector.enqueue(device_job("long", "benchmark", "synthetic", params={
        "prompt_tokens": 4096, "gen_tokens": 4096, "warmup_iters": 0, "measure_iters": 3}))
    collector.enqueue(device_job("next", "self-check"))
    status, row = ended(collector, "long", 30)
    assert status == "failed", row
    assert row["error"] == ("stopped: the job ran for the 1.5 s this agent allows a job (its "
                            "owner's --max-job-seconds)")
    assert collector.wait_status("next", ("done", "failed"), 30)["status"] == "done"
    assert "job long ended: failed" in agent.log()


def test_a_benchmark_sized_for_months_is_refused(procs):
    collector = procs.collector()
    procs.agent([collector], "bench-1")
    wait_for(lambda: registered(collector, "bench-1"), 20, what="registration")
    collector.enqueue(device_job("months", "benchmark", "synthetic", params={
        "prompt_tokens": 1_000_000, "gen_tokens": 1_000_000, "warmup_iters": 1000,
        "measure_iters": 10_000}))
    status, row = ended(collector, "months", 20)
    assert status == "failed", row
    assert row["error"] == (
        "refused: a synthetic benchmark runs at most 250000 tokens in all, (warmup_iters + "
        "measure_iters) x (prompt_tokens + gen_tokens); this job asks for 22000000000")


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return False
    return True


def serve_until_cancelled(collector, job_id: str, port: int) -> dict:
    wait_for(lambda: [r for r in collector.results(job_id) if not r["final"]], 30,
             what=f"{job_id}'s ready row")
    assert json.loads(http_bytes(f"http://127.0.0.1:{port}/health")) == {"status": "ok"}
    assert collector.post(f"/api/jobs/{job_id}/cancel")[0] == 200
    return ended(collector, job_id, 30)[1]


def test_serve_listens_beyond_loopback_only_where_the_owner_allows(procs):
    collector = procs.collector()
    procs.agent([collector], "plain-1")
    wait_for(lambda: registered(collector, "plain-1"), 20, what="registration")
    port = free_port()
    for job_id, bind in (("every", "0.0.0.0"), ("lan", "10.20.30.40")):
        collector.enqueue(device_job(job_id, "serve", "synthetic", targets={"device_id": "plain-1"},
                              params={"bind": bind, "port": port, "duration_s": 3}))
        status, row = ended(collector, job_id)
        assert status == "failed", row
        assert row["error"] == (
            f"refused: params.bind {bind} would let other machines reach this one; this agent "
            "serves on loopback (127.0.0.1, ::1) only unless its owner lists the address with "
            "--allow-serve-bind")
        assert not listening(port)
    collector.enqueue(device_job("loop", "serve", "synthetic", targets={"device_id": "plain-1"},
                          params={"bind": "127.0.0.1", "port": port}))
    assert serve_until_cancelled(collector, "loop", port)["ok"] is True
    # An owner who lists 0.0.0.0 lets jobs serve the LAN from that machine.
    procs.agent([collector], "open-1", "--allow-serve-bind", "0.0.0.0")
    wait_for(lambda: registered(collector, "open-1"), 20, what="registration")
    other = free_port()
    collector.enqueue(device_job("allowed", "serve", "synthetic", targets={"device_id": "open-1"},
                          params={"bind": "0.0.0.0", "port": other}))
    assert serve_until_cancelled(collector, "allowed", other)["ok"] is True


def test_a_zips_member_list_is_measured_before_it_is_read(fa, tmp_path):
    """zipfile reads a zip's whole member list into memory before anything can count it (235 MB
    listing one empty member 5 million times took 1.8 GB and 49 s of CPU); the end record that
    declares the list is read first, and a list past the bounds is refused unread."""
    crowd = tmp_path / "crowd.zip"
    crowd.write_bytes(many_members(70_000))  # past 65,535 members: a zip64 end record
    assert fa.zip_directory_size(str(crowd))[0] == 70_001
    with fa.open_zip(str(crowd)) as bundle:
        assert len(bundle.infolist()) == 70_001
    small = io.BytesIO()
    with zipfile.ZipFile(small, "w") as bundle:
        bundle.writestr("a", b"")
    declared = bytearray(small.getvalue())
    end = declared.rfind(b"PK\x05\x06")
    for members, directory, says in (
            (100_001 & 0xFFFF, 50, None),  # a two-byte count cannot say more than 65,535
            (7, fa.MAX_ZIP_DIRECTORY_BYTES + 1, "the archive's member list is 67108865 bytes; "
                                                 "the agent reads at most 67108864")):
        forged = bytearray(declared)
        forged[end + 8:end + 16] = members.to_bytes(2, "little") * 2 + \
            directory.to_bytes(4, "little")
        path = tmp_path / "forged.zip"
        path.write_bytes(bytes(forged))
        if says is None:
            with pytest.raises(zipfile.BadZipFile):
                fa.open_zip(str(path))  # the list it declares is not there: zipfile says so
        else:
            with pytest.raises(fa.Refusal, match=says):
                fa.open_zip(str(path))


def test_a_zip64_end_record_declaring_too_many_members_is_refused_unread(fa, tmp_path):
    """The count a zip64 end record declares is the one zipfile believes."""
    path = tmp_path / "many.zip"
    path.write_bytes(many_members(70_000))
    raw = bytearray(path.read_bytes())
    record = raw.rfind(b"PK\x06\x06")
    raw[record + 24:record + 40] = (5_000_000).to_bytes(8, "little") * 2
    path.write_bytes(bytes(raw))
    with pytest.raises(fa.Refusal, match="the archive has 5000000 members; the agent unpacks "
                                         "at most 100000"):
        fa.open_zip(str(path))


def model_zip(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as bundle:
        for name, data in members.items():
            bundle.writestr(name, data)
    return buffer.getvalue()


def test_a_model_folder_that_carries_or_names_code_is_never_handed_to_the_converter(
        converter_agent):
    """transformers imports a folder's own Python when a configuration's auto_map names it
    and the loader is asked with trust_remote_code, as llama.cpp's converter asks for some
    architectures: a job's zip ran its code on the device. A folder with code, or a
    configuration naming code (here or on a hub), is refused before the converter runs."""
    collector, _, log = converter_agent
    config = json.dumps({"architectures": ["QWenLMHeadModel"]}).encode()
    mapped = json.dumps({"auto_map": {"AutoTokenizer": ["tokenization_qwen.QWenTokenizer",
                                                        None]}}).encode()
    cases = {
        "with-python": ({"m/config.json": config, "m/tokenizer_config.json": mapped,
                         "m/tokenization_qwen.py": b"open('/tmp/pwned', 'w')"},
                        "the model archive holds code ('m/tokenization_qwen.py')"),
        "names-a-hub": ({"m/config.json": json.dumps({"auto_map": {
            "AutoModel": "someone/else--modeling.Model"}}).encode()},
                        "'m/config.json' in the model archive names code to load (auto_map)"),
        "with-a-library": ({"m/config.json": config, "m/sub/kernel.SO": b"\x7fELF"},
                           "the model archive holds code ('m/sub/kernel.SO')"),
    }
    for job_id, (members, _) in cases.items():
        convert(collector, job_id, model_zip(members))
    for job_id, (_, says) in cases.items():
        status, row = ended(collector, job_id)
        assert status == "failed" and says in row["error"], (job_id, row)
    assert converted(log) == []
    # A folder of weights and configuration alone is converted as before.
    convert(collector, "plain", model_zip({"m/config.json": config,
                                           "m/tokenizer.json": b'{"auto_mapping": 1}',
                                           "m/model.safetensors": b"\0" * 64}))
    assert ended(collector, "plain")[0] == "done"
    assert converted(log) == [{"files": 3, "bytes": len(config) + 19 + 64}]
