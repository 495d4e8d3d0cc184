"""The device workloads of the spec's table, one job at a time through Runtime.execute.

Rows and artifacts go to a stub collector (a real local HTTP server); llama.cpp and whisper.cpp
are fake executables on PATH (tests/support/fake_llama.py); vantage and dataset-prep reach
real local web servers; build runs make on a git repository made in tmp_path.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import ssl
import subprocess
import sys
import time
import urllib.request
import zipfile

import pytest

from tests.support.agent import (
    AGENT_FILE,
    JobThread,
    device_runtime,
    free_port,
    python38,
    run_job,
    self_signed_cert,
    wait_for,
    write_tree,
)
from tests.support.fake_llama import (
    GGUF_MODEL,
    hf_zip,
    install_fakes,
    jsonl,
    sha,
    wav_bytes,
)
from tests.support.faults import mount_tmpfs, unmount

SYSTEM_PATH = os.environ["PATH"]


def reference_digest(prompt_tokens: int, gen_tokens: int) -> str:
    """decisions.md's synthetic loop written out again: a fresh 4,096-byte block, 1,000 rounds
    a token, each round's digest over the block's first 32 bytes; the block's SHA-256."""
    block = bytearray((i * 31) & 0xFF for i in range(4096))
    for _ in range((prompt_tokens + gen_tokens) * 1000):
        block[:32] = hashlib.sha256(block).digest()
    return hashlib.sha256(block).hexdigest()


def blob(stub, data: bytes) -> str:
    stub.blobs[sha(data)] = data
    return sha(data)


def rows(stub) -> list[dict]:
    return sorted((p for p in stub.posts if isinstance(p, dict) and p.get("kind") == "result"),
                  key=lambda r: r["iter"])


def model(stub) -> dict:
    return {"name": "tiny", "format": "gguf", "sha256": blob(stub, GGUF_MODEL)}


@pytest.fixture
def llama_runtime(fa, tmp_path):
    install_fakes(tmp_path / "bin")
    return device_runtime(fa, tmp_path)


# --- what is declared ---


def test_capabilities_follow_the_tools_this_machine_has(fa, tmp_path):
    bare = device_runtime(fa, tmp_path / "bare")
    caps = bare.capabilities()
    assert caps[:2] == ["self-check", "benchmark:synthetic"]
    for workload in ("thermal", "batch", "pipeline", "llm-eval", "vision-eval", "speech-eval",
                     "embed-eval", "serve"):
        assert f"{workload}:synthetic" in caps
    assert "vantage" in caps and "dataset-prep" in caps
    assert not [c for c in caps if "llama" in c or "whisper" in c or c.startswith(
        ("build", "model-convert"))]
    install_fakes(tmp_path / "full" / "bin")
    full = device_runtime(fa, tmp_path / "full")
    for cap in ("thermal:llama.cpp", "batch:llama.cpp", "pipeline:llama.cpp", "llm-eval:llama.cpp",
                "vision-eval:llama.cpp", "speech-eval:whisper.cpp", "embed-eval:llama.cpp",
                "serve:llama.cpp", "model-convert"):
        assert cap in full.capabilities(), cap


def test_build_is_declared_per_toolchain_only_with_git_and_an_allowed_repository(fa, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("git", "make"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    runtime = device_runtime(fa, tmp_path)
    assert not [c for c in runtime.capabilities() if c.startswith("build")]
    (tmp_path / "state" / "build-repos").write_text("# mine\n/srv/repos/\n")
    assert [c for c in runtime.capabilities() if c.startswith("build")] == ["build:make"]
    (bin_dir / "git").unlink()
    assert not [c for c in device_runtime(fa, tmp_path).capabilities() if c.startswith("build")]


def test_tools_come_from_flags_and_environment_too(fa, tmp_path, monkeypatch):
    fakes = install_fakes(tmp_path / "elsewhere")
    runtime = device_runtime(fa, tmp_path, "--llama-cli", str(fakes / "llama-completion"))
    assert runtime.tools["llama-cli"] == str(fakes / "llama-completion")
    monkeypatch.setenv("FLEET_WHISPER_CLI", str(fakes / "whisper-cli"))
    script = tmp_path / "convert.py"  # a plain script, not executable: run with Python
    script.write_text("print('hi')\n")
    runtime = device_runtime(fa, tmp_path, "--llama-convert", str(script))
    assert runtime.tools["whisper-cli"] == str(fakes / "whisper-cli")
    assert runtime.tools["llama-convert"] == str(script)
    assert "speech-eval:whisper.cpp" in runtime.capabilities()
    assert "model-convert" in runtime.capabilities()


@pytest.mark.parametrize("python", [sys.executable, "py38"])
def test_describe_prints_the_capabilities_with_their_reasons(tmp_path, python):
    if python == "py38":
        python = python38()
        if python is None:
            pytest.skip("no Python 3.8 here")
    install_fakes(tmp_path / "bin", ("llama-completion",))
    out = subprocess.run([python, str(AGENT_FILE), "--describe", "--state-dir",
                          str(tmp_path / "state"), "--device-id", "d-1"], capture_output=True,
                         text=True, timeout=60, env={"PATH": str(tmp_path / "bin"),
                                                     "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "id d-1" in text and "descriptor:" in text
    declared, missing = text.split("not declared on this machine:")
    assert "batch:llama.cpp" in declared and str(tmp_path / "bin" / "llama-completion") in declared
    assert "vantage                      standard library" in declared
    assert "speech-eval:whisper.cpp      needs whisper-cli (--whisper-cli)" in missing
    assert "build:make" in missing


def test_describe_lists_exactly_what_registration_declares(fa, tmp_path):
    install_fakes(tmp_path / "bin", ("llama-embedding", "llama-quantize"))
    runtime = device_runtime(fa, tmp_path)
    listed = [line.split()[0] for line in fa.describe(runtime).split("capabilities it declares:")
              [1].split("not declared")[0].strip().splitlines()]
    assert listed == runtime.capabilities()


# --- parameters are checked before any work ---

BAD_PARAMS = [
    ("thermal", {"duration_s": -1}, "params.duration_s must be a number from 0"),
    ("thermal", {"prompt_tokens": "many"}, "params.prompt_tokens must be a whole number"),
    ("batch", {"input_sha256": "abc"}, "params.input_sha256 must be the SHA-256"),
    ("batch", {"input_sha256": "a" * 64, "max_tokens": 0}, "params.max_tokens must be"),
    ("pipeline", {"topic": "no spaces please"}, "params.topic must be a topic name"),
    ("llm-eval", {"input_sha256": "a" * 64, "scoring": "fuzzy"}, "params.scoring must be exact"),
    ("vision-eval", {"max_items": 3}, "params.input_sha256 must be the SHA-256"),
    ("vantage", {"urls": "https://example.com"}, "params.urls must be a list of 1 to 50 URLs"),
    ("vantage", {"urls": ["ftp://example.com/x"]}, "params.urls must be http:// or https://"),
    ("vantage", {"urls": ["https://user:pw@example.com/"]}, "carry no user or password"),
    ("dataset-prep", {"source": "a" * 64, "split": "train:80,../x:20"}, "params.split must"),
    ("dataset-prep", {"source": "/etc/passwd"}, "params.source must be an artifact's SHA-256"),
    ("serve", {"port": 70000}, "params.port must be a whole number from 1 to 65535"),
    ("serve", {"bind": "evil.example"}, "params.bind must be an IP address"),
    ("model-convert", {"input_sha256": "a" * 64, "formats": ["onnx"]}, "converts to gguf only"),
    ("model-convert", {"input_sha256": "a" * 64, "quant": "Q4;rm"}, "params.quant must be"),
]


def test_model_convert_refuses_another_backend(fa, tmp_path, http_stub, llama_runtime):
    _, result = run_job(fa, llama_runtime, http_stub.url, {
        "job_id": "mlx", "workload": "model-convert", "backend": "mlx",
        "params": {"input_sha256": blob(http_stub, GGUF_MODEL)}})
    assert result["error"] == ("refused: this agent converts models with llama.cpp's tools, "
                               "not with the backend 'mlx'")
    assert rows(http_stub) == []


@pytest.mark.parametrize(("workload", "params", "sentence"), BAD_PARAMS)
def test_a_bad_parameter_fails_the_job_with_a_sentence_and_no_work(fa, tmp_path, http_stub,
                                                                   workload, params, sentence):
    install_fakes(tmp_path / "bin", ("llama-quantize",))
    runtime = device_runtime(fa, tmp_path)
    _, result = run_job(fa, runtime, http_stub.url, {"job_id": "bad", "workload": workload,
                                                     "params": params})
    assert result["ok"] is False
    assert sentence in result["error"], result["error"]
    assert rows(http_stub) == [] and http_stub.blobs == {}


def test_a_backend_the_agent_lacks_is_refused_not_substituted(fa, tmp_path, http_stub):
    runtime = device_runtime(fa, tmp_path)
    for workload in ("batch", "speech-eval", "serve", "thermal"):
        _, result = run_job(fa, runtime, http_stub.url, {
            "job_id": "b", "workload": workload, "backend": "llama.cpp",
            "params": {"input_sha256": "a" * 64}})
        assert result["ok"] is False
        assert f"does not implement the {workload} backend 'llama.cpp'" in result["error"]
        assert "it implements: synthetic" in result["error"]
    assert rows(http_stub) == []


# --- batch and llm-eval ---


def test_batch_synthetic_runs_the_reference_loop_per_item(fa, tmp_path, http_stub):
    prompts = [{"id": "a", "prompt": "abcd" * 3}, "a quoted prompt", {"prompt": "x"}]
    data = jsonl(prompts)
    runtime = device_runtime(fa, tmp_path)
    _, result = run_job(fa, runtime, http_stub.url, {
        "job_id": "bs", "workload": "batch", "backend": "synthetic",
        "params": {"input_sha256": blob(http_stub, data), "max_tokens": 2}})
    assert result["ok"] is True, result
    got = rows(http_stub)
    assert [r["iter"] for r in got] == [1, 2, 3]
    assert [r["item"] for r in got] == ["a", 2, 3]
    # 12 bytes: 3 tokens; "a quoted prompt" (15 bytes): 4 tokens; "x": 1 token
    assert [r["metrics"]["prompt_tokens"] for r in got] == [3, 4, 1]
    assert got[0]["metrics"]["synthetic_digest"] == reference_digest(3, 2)
    assert got[0]["output"] == reference_digest(3, 2)
    outputs = [json.loads(line) for line in
               http_stub.blobs[result["outputs_sha256"]].decode().splitlines()]
    assert [o["output"] for o in outputs] == [reference_digest(n, 2) for n in (3, 4, 1)]
    assert result["artifacts"] == [result["outputs_sha256"]]
    metrics = result["metrics"]
    assert metrics["items"] == metrics["items_ok"] == 3 and metrics["gen_tokens"] == 6
    assert metrics["p50_ms"] > 0 and metrics["decode_tok_s"] > 0


def test_batch_with_llama_cpp_reports_its_timings_and_a_failed_item(fa, tmp_path, http_stub,
                                                                     llama_runtime):
    data = jsonl([{"prompt": "say hello"}, {"prompt": "please FAIL now"},
                  {"prompt": "name a colour: blue"}])
    _, result = run_job(fa, llama_runtime, http_stub.url, {
        "job_id": "bl", "workload": "batch", "backend": "llama.cpp", "model": model(http_stub),
        "params": {"input_sha256": blob(http_stub, data), "max_tokens": 16, "max_items": 3}})
    got = rows(http_stub)
    assert [r["ok"] for r in got] == [True, False, True]
    assert got[0]["output"] == "HELLO" and got[2]["output"] == "BLUE"
    assert got[0]["metrics"]["decode_tok_s"] == 100.0
    assert got[0]["metrics"]["prefill_tok_s"] == 500.0 and got[0]["metrics"]["load_ms"] == 12.5
    assert "told to fail" in got[1]["error"]
    assert result["ok"] is False
    assert result["error"].startswith("1 of 3 items failed; item 2: llama-completion exited")


def test_a_bad_input_line_refuses_the_job_before_any_item(fa, tmp_path, http_stub):
    data = b'{"prompt": "fine"}\n{"prompt": \n'
    _, result = run_job(fa, device_runtime(fa, tmp_path), http_stub.url, {
        "job_id": "bad-line", "workload": "batch", "params": {"input_sha256": blob(http_stub,
                                                                                    data)}})
    assert result["error"] == "the batch input line 2 is not valid JSON"
    assert rows(http_stub) == []
    _, result = run_job(fa, device_runtime(fa, tmp_path), http_stub.url, {
        "job_id": "no-prompt", "workload": "batch",
        "params": {"input_sha256": blob(http_stub, b'{"text": "x"}\n')}})
    assert result["error"] == ("the batch input line 1 must be a JSON object with prompt; it "
                               "lacks prompt")


def test_a_tampered_input_is_refused(fa, tmp_path, http_stub):
    data = jsonl([{"prompt": "x"}])
    digest = blob(http_stub, data)
    http_stub.blobs[digest] = data.replace(b"x", b"y")
    _, result = run_job(fa, device_runtime(fa, tmp_path), http_stub.url, {
        "job_id": "t", "workload": "batch", "params": {"input_sha256": digest}})
    assert "altered or corrupted" in result["error"]
    assert rows(http_stub) == []


def test_llm_eval_scores_the_answers(fa, tmp_path, http_stub, llama_runtime):
    data = jsonl([{"prompt": "Say PARIS", "expected": "paris"},
                  {"prompt": "What is 2+2? Answer 4", "expected": "4"},
                  {"prompt": "Say LONDON", "expected": "rome"},
                  {"prompt": "Say cat", "expected": "CAT"}])
    spec = {"job_id": "e", "workload": "llm-eval", "backend": "llama.cpp",
            "model": model(http_stub), "params": {"input_sha256": blob(http_stub, data)}}
    _, result = run_job(fa, llama_runtime, http_stub.url, spec)
    assert result["ok"] is True, result
    assert result["metrics"]["score_pct"] == 75.0 and result["metrics"]["correct"] == 3
    assert [r["correct"] for r in rows(http_stub)] == [True, True, False, True]
    spec["params"]["min_score_pct"] = 80
    _, result = run_job(fa, llama_runtime, http_stub.url, spec)
    assert result["ok"] is False
    assert result["error"] == "the score_pct of 75 is below the job's floor of 80"


def test_llm_eval_synthetic_checks_the_reference_digest(fa, tmp_path, http_stub):
    data = jsonl([{"prompt": "abcd", "expected": reference_digest(1, 3)},
                  {"prompt": "abcd", "expected": "not the digest"}])
    _, result = run_job(fa, device_runtime(fa, tmp_path), http_stub.url, {
        "job_id": "es", "workload": "llm-eval", "backend": "synthetic",
        "params": {"input_sha256": blob(http_stub, data), "max_tokens": 3, "scoring": "exact"}})
    assert result["metrics"]["score_pct"] == 50.0


# --- preemption and cancel ---


def test_a_preempted_batch_hands_back_and_resumes_after_the_finished_items(fa, tmp_path,
                                                                          http_stub):
    data = jsonl([{"prompt": "p" * 400} for _ in range(12)])
    runtime = device_runtime(fa, tmp_path)
    spec = {"job_id": "pre", "workload": "batch", "preemptible": True,
            "params": {"input_sha256": blob(http_stub, data), "max_tokens": 200}}
    job = JobThread(fa, runtime, http_stub.url, spec)
    job.start()
    wait_for(lambda: len(rows(http_stub)) >= 2, 60, what="two items")
    job.ctx.request_stop("preempted: a higher-priority job is waiting", handback=True)
    handed = job.finish()
    assert handed["preempted"] is True and "handed back" in handed["error"]
    done = len(rows(http_stub))
    assert 2 <= done < 12
    progress = json.loads(http_stub.blobs[handed["artifacts"][0]])
    assert len(progress["completed"]) == done
    http_stub.posts.clear()
    spec["params"]["resume_from"] = handed["artifacts"][0]
    _, result = run_job(fa, runtime, http_stub.url, spec)
    assert result["ok"] is True, result
    assert [r["iter"] for r in rows(http_stub)] == list(range(done + 1, 13))
    assert result["metrics"]["items"] == 12
    outputs = http_stub.blobs[result["outputs_sha256"]].decode().splitlines()
    assert len(outputs) == 12


def test_cancel_stops_a_running_tool_at_once(fa, tmp_path, http_stub, llama_runtime,
                                             monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_DELAY", "30")
    data = jsonl([{"prompt": "slow"}])
    job = JobThread(fa, llama_runtime, http_stub.url, {
        "job_id": "c", "workload": "batch", "backend": "llama.cpp", "model": model(http_stub),
        "params": {"input_sha256": blob(http_stub, data)}})
    job.start()
    wait_for(lambda: list((tmp_path / "state" / "work").rglob("gen-1.err")), 20,
             what="the tool to start")
    started = time.monotonic()
    job.ctx.request_stop("stopped: the collector no longer renews this job's lease")
    result = job.finish()
    assert time.monotonic() - started < 10
    assert result == {"ok": False, "metrics": {}, "artifacts": [],
                      "error": "stopped: the collector no longer renews this job's lease"}


# --- thermal ---

PHONE_ROOT = {
    "/sys/class/thermal/thermal_zone0/type": "battery\n",
    "/sys/class/thermal/thermal_zone0/temp": "36000\n",
    "/sys/class/thermal/thermal_zone1/type": "cpu-1-0-usr\n",
    "/sys/class/thermal/thermal_zone1/temp": "71500\n",
    "/sys/class/power_supply/battery/type": "Battery\n",
    "/sys/class/power_supply/battery/capacity": "81\n",
    "/sys/class/power_supply/battery/status": "Discharging\n",
}


def test_thermal_rows_carry_rate_and_temperatures(fa, tmp_path, http_stub):
    root = write_tree(tmp_path / "root", PHONE_ROOT)
    runtime = device_runtime(fa, tmp_path, root=root)
    _, result = run_job(fa, runtime, http_stub.url, {
        "job_id": "th", "workload": "thermal", "backend": "synthetic",
        "params": {"prompt_tokens": 2, "gen_tokens": 2, "duration_s": 0.5}})
    assert result["ok"] is True, result
    got = rows(http_stub)
    assert len(got) >= 2
    first = got[0]["metrics"]
    assert first["cpu_temp_c"] == 71.5 and first["thermal_state"] == "fair"
    assert first["battery_pct"] == 81 and first["decode_tok_s"] > 0
    assert [r["metrics"]["elapsed_s"] for r in got] == sorted(r["metrics"]["elapsed_s"]
                                                              for r in got)
    metrics = result["metrics"]
    assert metrics["iterations"] == len(got) and metrics["max_cpu_temp_c"] == 71.5
    assert metrics["thermal"] == ["fair"] * len(got)
    assert metrics["battery_start_pct"] == metrics["battery_end_pct"] == 81
    assert metrics["synthetic_digest"] == fa.SYNTHETIC_ATTESTATION
    assert metrics["synthetic_rounds"] == 1000
    assert "throttle_pct" in metrics


def test_thermal_with_llama_bench_shows_throttling(fa, tmp_path, http_stub, llama_runtime,
                                                   monkeypatch):
    # The fake takes the next rate at each start. (Setting the rate in the environment once
    # each row had arrived raced the agent's next start on a loaded machine.)
    rates = tmp_path / "rates"
    rates.write_text("30 30 30 20 15 15 15")
    monkeypatch.setenv("FAKE_BENCH_TG_FILE", str(rates))
    job = JobThread(fa, llama_runtime, http_stub.url, {
        "job_id": "tl", "workload": "thermal", "backend": "llama.cpp", "model": model(http_stub),
        "params": {"prompt_tokens": 8, "gen_tokens": 4, "duration_s": 600, "max_iters": 7}})
    job.start()
    result = job.finish(60)
    assert result["ok"] is True, result
    assert result["metrics"]["iterations"] == 7
    assert result["metrics"]["decode_first_tok_s"] == 30.0
    assert result["metrics"]["decode_last_tok_s"] == 15.0
    assert result["metrics"]["throttle_pct"] == 50.0


def test_pmset_therm_on_a_mac(fa, tmp_path):
    from tests.support.agent import make_tool

    make_tool(tmp_path / "bin", "pmset", """
print("Note: No thermal warning level has been recorded")
print("2024-05-01 10:00:00 +0000 CPU Power notify")
print("\\tCPU_Scheduler_Limit \\t= 100")
print("\\tCPU_Available_CPUs \\t= 8")
print("\\tCPU_Speed_Limit \\t= 72")
""")
    mac = fa.Probe(root=str(tmp_path / "none"), env={"PATH": str(tmp_path / "bin")},
                   system="Darwin", machine="arm64")
    reading = fa.thermal_reading(mac)
    assert reading["cpu_speed_limit_pct"] == 72 and reading["thermal_state"] == "serious"


# --- the evals ---



def vision_job(http_stub, data: bytes) -> dict:
    """A llama.cpp vision-eval job over the JSON Lines `data`, its model and projector served."""
    return {"job_id": "v", "workload": "vision-eval", "backend": "llama.cpp",
            "model": model(http_stub),
            "params": {"input_sha256": blob(http_stub, data),
                       "mmproj_sha256": blob(http_stub, b"GGUF projector")}}

def test_vision_eval_with_a_multimodal_model(fa, tmp_path, http_stub, llama_runtime):
    images = [b"FAKEIMG:cat", b"FAKEIMG:dog", b"FAKEIMG:cat"]
    data = jsonl([{"image_sha256": blob(http_stub, images[0]), "label": "cat"},
                  {"image_sha256": blob(http_stub, images[1]), "label": "dog",
                   "choices": ["cat", "dog"]},
                  {"image_sha256": blob(http_stub, images[2]), "label": "dog"}])
    _, result = run_job(fa, llama_runtime, http_stub.url, vision_job(http_stub, data))
    assert result["ok"] is True, result
    assert result["metrics"]["top1_pct"] == 66.67
    assert result["metrics"]["images_per_s"] > 0 and result["metrics"]["p95_ms"] > 0
    assert [r["output"] for r in rows(http_stub)] == [
        "This image shows a cat.", "This image shows a dog.", "This image shows a cat."]
    assert [r["correct"] for r in rows(http_stub)] == [True, True, False]


def test_vision_eval_llama_cpp_needs_the_projector(fa, tmp_path, http_stub, llama_runtime):
    _, result = run_job(fa, llama_runtime, http_stub.url, {
        "job_id": "v", "workload": "vision-eval", "backend": "llama.cpp",
        "model": model(http_stub), "params": {"input_sha256": "b" * 64}})
    assert "params.mmproj_sha256 must be the SHA-256" in result["error"]


def test_vision_eval_synthetic_is_the_same_on_every_run(fa, tmp_path, http_stub):
    data = jsonl([{"image_sha256": blob(http_stub, bytes([n]) * 5000), "label": "cat",
                   "choices": ["cat", "dog", "bird"]} for n in range(6)])
    runtime = device_runtime(fa, tmp_path)
    spec = {"job_id": "vs", "workload": "vision-eval",
            "params": {"input_sha256": blob(http_stub, data)}}
    first = run_job(fa, runtime, http_stub.url, spec)[1]
    second = run_job(fa, runtime, http_stub.url, spec)[1]
    assert first["metrics"]["top1_pct"] == second["metrics"]["top1_pct"]
    expected = sum(1 for n in range(6) if int(sha(bytes([n]) * 5000), 16) % 3 == 0) / 6 * 100
    assert first["metrics"]["top1_pct"] == round(expected, 2)


def test_speech_eval_word_error_rate_and_real_time_factor(fa, tmp_path, http_stub,
                                                          llama_runtime):
    data = jsonl([{"audio_sha256": blob(http_stub, wav_bytes(1.0)), "text": "Hello, world!"},
                  {"audio_sha256": blob(http_stub, wav_bytes(2.0)),
                   "text": "good evening world"}])
    _, result = run_job(fa, llama_runtime, http_stub.url, {
        "job_id": "s", "workload": "speech-eval", "backend": "whisper.cpp",
        "model": model(http_stub), "params": {"input_sha256": blob(http_stub, data),
                                              "language": "en"}})
    assert result["ok"] is True, result
    got = rows(http_stub)
    assert [r["metrics"]["wer_pct"] for r in got] == [0.0, 33.33]
    assert got[1]["output"] == "good morning world" and got[1]["metrics"]["audio_s"] == 2.0
    assert result["metrics"]["wer_pct"] == 20.0  # 1 error in 5 words
    assert result["metrics"]["rtf"] > 0


def test_word_errors(fa):
    assert fa.word_errors(["a", "b", "c"], ["a", "b", "c"]) == 0
    assert fa.word_errors(["a", "b", "c"], ["a", "x", "c", "d"]) == 2
    assert fa.word_errors([], ["a"]) == 1
    assert fa.word_errors(["a", "b"], []) == 2


def test_embed_eval_ranks_candidates(fa, tmp_path, http_stub, llama_runtime):
    records = [{"query": "aaaa", "candidates": ["zzzz", "aaab", "bbbb"], "expected": 1},
               {"query": "cccc", "candidates": ["dddd", "cccd"], "expected": 0}]
    data = jsonl(records)
    _, result = run_job(fa, llama_runtime, http_stub.url, {
        "job_id": "em", "workload": "embed-eval", "backend": "llama.cpp",
        "model": model(http_stub), "params": {"input_sha256": blob(http_stub, data)}})
    assert [r["metrics"]["rank"] for r in rows(http_stub)] == [1, 2]
    assert result["metrics"]["top1_pct"] == 50.0 and result["metrics"]["top5_pct"] == 100.0
    assert result["metrics"]["mrr"] == 0.75


def test_embed_eval_synthetic_is_a_lexical_model(fa, tmp_path, http_stub):
    records = [{"query": "the red fox jumps", "candidates": [
        "a blue whale sings", "red fox jumps high", "green tea"], "expected": 1},
        {"query": "green tea please", "candidates": ["green tea", "black coffee"]}]
    _, result = run_job(fa, device_runtime(fa, tmp_path), http_stub.url, {
        "job_id": "es", "workload": "embed-eval",
        "params": {"input_sha256": blob(http_stub, jsonl(records))}})
    assert result["ok"] is True and result["metrics"]["top1_pct"] == 100.0


def test_embed_eval_checks_its_records(fa, tmp_path, http_stub):
    records = [{"query": "q", "candidates": ["a"], "expected": 3}]
    _, result = run_job(fa, device_runtime(fa, tmp_path), http_stub.url, {
        "job_id": "eb", "workload": "embed-eval",
        "params": {"input_sha256": blob(http_stub, jsonl(records))}})
    assert result["error"] == ("the embedding dataset record 1: expected must be the index of "
                               "the matching candidate")


def test_llama_perf_lines(fa):
    text = ("llama_perf_context_print:        load time =     100.00 ms\n"
            "llama_perf_context_print: prompt eval time =      50.00 ms /    10 tokens\n"
            "llama_perf_context_print:        eval time =     400.00 ms /    20 runs   \n"
            "llama_print_timings: nothing else\n")
    assert fa.llama_perf(text) == {"load_ms": 100.0, "prompt_tokens": 10,
                                   "prefill_tok_s": 200.0, "gen_tokens": 20,
                                   "decode_tok_s": 50.0, "ttft_ms": 70.0}
    assert fa.llama_perf("no timings") == {}


# --- vantage ---


def vantage_runtime(fa, tmp_path, *flags):
    return device_runtime(fa, tmp_path, *flags, path=SYSTEM_PATH)


def test_vantage_measures_each_url_from_here(fa, tmp_path, http_stub, website):
    site = website({"/": (200, b"x" * 5000, {}), "/gone": (404, b"no", {})})
    closed = f"http://127.0.0.1:{free_port()}/"
    runtime = vantage_runtime(fa, tmp_path, "--allow-private-urls")
    _, result = run_job(fa, runtime, http_stub.url, {
        "job_id": "va", "workload": "vantage",
        "params": {"urls": [site.url + "/", site.url + "/gone", closed], "repeats": 3}})
    got = rows(http_stub)
    assert [r["url"] for r in got] == [site.url + "/", site.url + "/gone", closed]
    ok = got[0]["metrics"]
    assert ok["status"] == 200 and ok["bytes"] == 5000 and ok["failures"] == 0
    assert 0 <= ok["dns_ms"] <= ok["connect_ms"] <= ok["ttfb_ms"] <= ok["total_ms"]
    assert len(got[0]["samples"]) == 3 and "tls_ms" not in ok
    assert got[1]["ok"] is True and got[1]["metrics"]["status"] == 404
    assert got[2]["ok"] is False and "ConnectionRefusedError" in got[2]["error"]
    assert site.hits.count("/") == 3
    assert result["ok"] is False and result["metrics"]["urls_ok"] == 2
    assert result["error"].startswith("1 of 3 URLs failed")


def test_vantage_refuses_private_addresses_unless_allowed(fa, tmp_path, http_stub, website):
    site = website({"/": (200, b"hi", {})})
    _, result = run_job(fa, vantage_runtime(fa, tmp_path), http_stub.url, {
        "job_id": "vp", "workload": "vantage", "params": {"urls": [site.url + "/"],
                                                          "repeats": 1}})
    assert result["ok"] is False
    assert "resolves to 127.0.0.1, a private or local address" in result["error"]
    assert "--allow-private-urls" in result["error"]
    assert site.hits == []


def test_vantage_times_the_tls_handshake(fa, tmp_path, http_stub, website, monkeypatch):
    made = self_signed_cert(tmp_path)
    if made is None:
        pytest.skip("no openssl tool to make a certificate")
    cert, key = made
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    site = website({"/": (200, b"secure", {})}, tls_context=context)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # this device trusts the test's CA
    sample = fa.measure_url(site.url + "/", 10, True, 1 << 20)
    assert sample["status"] == 200 and sample["bytes"] == 6
    assert sample["connect_ms"] <= sample["tls_ms"] <= sample["ttfb_ms"]
    monkeypatch.delenv("SSL_CERT_FILE")
    monkeypatch.setenv("SSL_CERT_DIR", str(tmp_path / "nothing"))
    untrusted = fa.measure_url(site.url + "/", 10, True, 1 << 20)
    assert untrusted["error"].startswith("TLS failed")


# --- dataset-prep ---


def test_dataset_prep_splits_an_artifact(fa, tmp_path, http_stub):
    records = [{"n": n} for n in range(103)]
    data = jsonl(records) + b"\n"  # a blank line at the end is not a record
    spec = {"job_id": "dp", "workload": "dataset-prep",
            "params": {"source": blob(http_stub, data), "max_items": 100,
                       "split": "train:80,val:10,test:10", "seed": 7}}
    runtime = device_runtime(fa, tmp_path)
    _, result = run_job(fa, runtime, http_stub.url, spec)
    assert result["ok"] is True, result
    splits = result["splits"]
    assert [splits[n]["items"] for n in ("train", "val", "test")] == [80, 10, 10]
    seen = []
    for name in ("train", "val", "test"):
        lines = http_stub.blobs[splits[name]["sha256"]].decode().splitlines()
        seen += [json.loads(line)["n"] for line in lines]
        assert [json.loads(x)["n"] for x in lines] == sorted(json.loads(x)["n"] for x in lines)
    assert sorted(seen) == list(range(100))
    assert [r["split"] for r in rows(http_stub)] == ["train", "val", "test"]
    again = run_job(fa, runtime, http_stub.url, spec)[1]
    assert again["splits"] == splits  # the same seed gives the same split


def test_dataset_prep_fetches_a_url_through_a_redirect(fa, tmp_path, http_stub, website):
    lines = b"".join(b"line %d\n" % n for n in range(10))
    site = website({"/old": (302, b"", {"location": "/data.txt"}), "/data.txt": (200, lines, {})})
    runtime = device_runtime(fa, tmp_path, "--allow-private-urls")
    _, result = run_job(fa, runtime, http_stub.url, {
        "job_id": "du", "workload": "dataset-prep",
        "params": {"source": site.url + "/old", "split": "a:1,b:1", "format": "lines"}})
    assert result["ok"] is True, result
    assert result["source_sha256"] == sha(lines)
    assert [result["splits"][n]["items"] for n in ("a", "b")] == [5, 5]
    assert site.hits == ["/old", "/data.txt"]
    _, result = run_job(fa, device_runtime(fa, tmp_path / "strict"), http_stub.url, {
        "job_id": "dx", "workload": "dataset-prep", "params": {"source": site.url + "/old"}})
    assert "a private or local address" in result["error"]


def test_dataset_prep_keeps_the_disks_reserve_for_its_splits(fa, tmp_path, http_stub):
    """A split is a second copy of the source, written without the check a download makes: a
    source that just fit wrote its splits into the disk's last bytes (ENOSPC, and the final
    row then found no room in the spool). On a disk of 256 MiB (the reserve) and 30, a 20 MiB
    source downloads, and its 99 % split is refused before it is written."""
    disk = tmp_path / "disk"
    mount_tmpfs(disk, "286m")
    try:
        line = b'{"text": "' + b"x" * 1000 + b'"}\n'
        data = line * (20 * 1024)  # 20 MiB
        spec = {"job_id": "dp-full", "workload": "dataset-prep",
                "params": {"source": blob(http_stub, data), "split": "train:99,test:1",
                           "max_items": 1_000_000}}
        runtime = device_runtime(fa, disk)
        _, result = run_job(fa, runtime, http_stub.url, spec)
        assert result["ok"] is False, result
        assert result["error"].startswith("split train (")
        assert "bytes) was not written: it does not fit: " in result["error"]
    finally:
        unmount(disk)


def test_split_counts_and_names(fa):
    assert fa.split_counts(10, [1, 1, 1]) == [4, 3, 3]
    assert fa.split_counts(3, [90, 10]) == [3, 0]
    assert fa.parse_split("train:80,test:20") == [("train", 80.0), ("test", 20.0)]
    for bad in ("train", "train:0", "Train:1", "a:1,a:2", "../x:1", 5):
        with pytest.raises(fa.Refusal):
            fa.parse_split(bad)


# --- model-convert ---


def test_model_convert_quantizes_a_gguf_into_each_type(fa, tmp_path, http_stub, llama_runtime):
    _, result = run_job(fa, llama_runtime, http_stub.url, {
        "job_id": "mc", "workload": "model-convert", "model": {"name": "tiny llama/v2"},
        "params": {"input_sha256": blob(http_stub, GGUF_MODEL), "formats": ["gguf"],
                   "quant": "Q4_K_M, Q8_0,BAD"}})
    got = rows(http_stub)
    assert [r.get("quant") for r in got] == ["Q4_K_M", "Q8_0", "BAD"]
    assert [r["ok"] for r in got] == [True, True, False]
    assert "invalid ftype" in got[2]["error"]
    q4 = http_stub.blobs[got[0]["sha256"]]
    assert q4.startswith(b"GGUF Q4_K_M of " + sha(GGUF_MODEL)[:16].encode())
    assert got[0]["artifacts"] == [got[0]["sha256"]] and got[0]["metrics"]["bytes"] == len(q4)
    assert result["ok"] is False and result["error"].startswith("1 of 3 outputs failed")
    assert set(result["outputs"]) == {"Q4_K_M", "Q8_0"}


def test_model_convert_converts_a_hugging_face_folder_first(fa, tmp_path, http_stub,
                                                          llama_runtime):
    _, result = run_job(fa, llama_runtime, http_stub.url, {
        "job_id": "hf", "workload": "model-convert",
        "params": {"input_sha256": blob(http_stub, hf_zip("qwen2")), "quant": "f16,Q4_0"}})
    assert result["ok"] is True, result
    f16 = http_stub.blobs[result["outputs"]["f16"]]
    assert f16 == b"GGUF converted qwen2 f16"
    assert http_stub.blobs[result["outputs"]["Q4_0"]].startswith(b"GGUF Q4_0 of " +
                                                                 sha(f16)[:16].encode())
    assert result["metrics"]["convert_ms"] > 0


def test_model_convert_refuses_an_archive_that_escapes(fa, tmp_path, http_stub, llama_runtime):
    import io

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as bundle:
        bundle.writestr("../../evil/config.json", "{}")
    _, result = run_job(fa, llama_runtime, http_stub.url, {
        "job_id": "zz", "workload": "model-convert",
        "params": {"input_sha256": blob(http_stub, buffer.getvalue())}})
    assert "unsafe path" in result["error"]
    assert not (tmp_path / "state" / "evil").exists()


# --- serve ---


def post_json(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=10) as response:
        return json.loads(response.read())


def test_serve_synthetic_answers_until_cancelled(fa, tmp_path, http_stub):
    port = free_port()
    job = JobThread(fa, device_runtime(fa, tmp_path), http_stub.url, {
        "job_id": "sv", "workload": "serve", "params": {"port": port, "report_s": 1}})
    job.start()
    wait_for(lambda: rows(http_stub), 20, what="the ready row")
    assert rows(http_stub)[0]["phase"] == "ready"
    base = f"http://127.0.0.1:{port}"
    answer = post_json(base + "/completion", {"prompt": "abcdefgh", "n_predict": 2})
    assert answer["content"] == reference_digest(2, 2)
    answer = post_json(base + "/v1/completions", {"prompt": "abcd", "max_tokens": 1})
    assert answer["choices"][0]["text"] == reference_digest(1, 1)
    with pytest.raises(urllib.error.HTTPError) as refused:
        post_json(base + "/completion", {"prompt": "x", "n_predict": 100_000})
    assert refused.value.code == 400
    wait_for(lambda: any(r["metrics"].get("requests_served") == 2 for r in rows(http_stub)),
             20, what="a report row")
    job.ctx.request_stop("stopped: the collector no longer renews this job's lease")
    result = job.finish()
    assert result["ok"] is True, result
    assert result["metrics"]["requests_served"] == 2
    assert result["metrics"]["request_errors"] == 1
    assert result["metrics"]["tokens_generated"] == 3
    assert result["ended"].startswith("stopped: the collector no longer renews")
    with pytest.raises(OSError):
        post_json(base + "/completion", {"prompt": "x"})


def test_serve_refuses_a_port_in_use(fa, tmp_path, http_stub, website):
    site = website({})
    port = int(site.url.rsplit(":", 1)[1])
    _, result = run_job(fa, device_runtime(fa, tmp_path), http_stub.url, {
        "job_id": "busy", "workload": "serve", "params": {"port": port}})
    assert result["ok"] is False
    assert result["error"].startswith(f"could not listen on 127.0.0.1:{port}")


def test_serve_llama_server_counts_requests_and_stops_it(fa, tmp_path, http_stub,
                                                         llama_runtime):
    port = free_port()
    job = JobThread(fa, llama_runtime, http_stub.url, {
        "job_id": "ls", "workload": "serve", "backend": "llama.cpp", "model": model(http_stub),
        "params": {"port": port, "bind": "127.0.0.1", "duration_s": 3, "report_s": 1}})
    job.start()
    wait_for(lambda: rows(http_stub), 20, what="the ready row")
    for _ in range(3):
        assert post_json(f"http://127.0.0.1:{port}/completion",
                         {"prompt": "say hi"})["content"] == "HI"
    result = job.finish(30)
    assert result["ok"] is True and result["ended"] == "duration_s reached"
    assert result["metrics"]["requests_served"] == 3  # health probes are not counted
    assert result["metrics"]["uptime_s"] >= 3
    with pytest.raises(OSError):
        post_json(f"http://127.0.0.1:{port}/completion", {"prompt": "x"})


def test_serve_fails_with_the_servers_own_words(fa, tmp_path, http_stub, llama_runtime,
                                                monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_FAIL", "1")
    _, result = run_job(fa, llama_runtime, http_stub.url, {
        "job_id": "lf", "workload": "serve", "backend": "llama.cpp", "model": model(http_stub),
        "params": {"port": free_port()}})
    assert result["ok"] is False
    assert "the server exited with status 1 before it was ready" in result["error"]
    assert "told to fail" in result["error"]


# --- build ---


def git(*args: str, cwd) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture
def app_repo(tmp_path):
    """A git repository whose Makefile builds out/app.bin (and fails on the target broken)."""
    repo = tmp_path / "app-repo"
    repo.mkdir()
    (repo / "Makefile").write_text(
        "all:\n\tmkdir -p out\n\techo built $$(cat version) > out/app.bin\n"
        "broken:\n\techo about to fail\n\texit 2\n")
    (repo / "version").write_text("1\n")
    for args in (("init", "-q", "-b", "main"), ("config", "user.email", "t@example.com"),
                 ("config", "user.name", "t"), ("add", "-A"), ("commit", "-qm", "one"),
                 ("tag", "v1")):
        git(*args, cwd=repo)
    (repo / "version").write_text("2\n")
    git("commit", "-qam", "two", cwd=repo)
    return repo


def build_runtime(fa, tmp_path, *repos: str):
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    (state / "build-repos").write_text("".join(r + "\n" for r in repos))
    return device_runtime(fa, tmp_path, path=SYSTEM_PATH)


def test_build_clones_the_ref_runs_make_and_uploads_the_app(fa, tmp_path, http_stub, app_repo):
    runtime = build_runtime(fa, tmp_path, str(app_repo))
    assert "build:make" in runtime.capabilities()
    _, result = run_job(fa, runtime, http_stub.url, {
        "job_id": "bm", "workload": "build", "backend": "make",
        "app": {"name": "shelf-app", "platform": "linux"},
        "params": {"repo": str(app_repo), "ref": "v1", "kind": "make", "task": "all",
                   "app": "out/*.bin"}})
    assert result["ok"] is True, result
    assert result["commit"] == git("rev-parse", "v1^{commit}", cwd=app_repo)
    app_sha, log_sha = result["artifacts"]
    assert http_stub.blobs[app_sha] == b"built 1\n"
    assert result["app"] == {"sha256": app_sha, "app": "shelf-app", "build": result["commit"][:12],
                             "platform": "linux"}
    assert b"$ " in http_stub.blobs[log_sha]
    assert [r["phase"] for r in rows(http_stub)] == ["clone", "build", "artifact"]
    _, result = run_job(fa, runtime, http_stub.url, {
        "job_id": "bm2", "workload": "build",
        "params": {"repo": "file://" + str(app_repo), "ref": "main", "kind": "make",
                   "app": "out/app.bin"}})
    assert result["ok"] is False and "is not in this machine's --build-repos list" in \
        result["error"]


def test_a_failing_build_reports_its_log_tail(fa, tmp_path, http_stub, app_repo):
    runtime = build_runtime(fa, tmp_path, str(app_repo))
    _, result = run_job(fa, runtime, http_stub.url, {
        "job_id": "bf", "workload": "build", "backend": "make",
        "params": {"repo": str(app_repo), "ref": "main", "task": "broken", "app": "out/x"}})
    assert result["ok"] is False
    assert result["error"] == "the make build exited with status 2"
    assert "about to fail" in result["log_tail"]
    build_row = rows(http_stub)[1]
    assert build_row["phase"] == "build" and build_row["ok"] is False
    assert "about to fail" in build_row["log_tail"]


BAD_BUILDS = [
    ({"repo": "--upload-pack=touch /tmp/pwned"}, "params.repo must be a repository URL"),
    ({"repo": "ext::sh -c touch% /tmp/pwned"}, "params.repo must be a repository URL"),
    ({"repo": "ext::sh"}, "may not use a transport helper"),
    ({"repo": "http://plain.example/x.git"}, "must be an https://, ssh://, git@host:path"),
    ({"ref": "--output=/tmp/x"}, "params.ref must be a branch, tag or commit name"),
    ({"task": "all --eval=$(shell id)"}, "params.task may hold targets"),
    ({"task": "-f /etc/passwd"}, "params.task may hold targets"),
    ({"task": "CC=/bin/sh"}, "params.task may hold targets"),
    ({"app": "../../.ssh/id_rsa"}, "params.app must be the path"),
    ({"app": "/etc/passwd"}, "params.app must be the path"),
    ({"kind": "gradle"}, "does not declare build:gradle"),
    ({"kind": "rake"}, "params.kind must be one of make"),
]


@pytest.mark.parametrize(("change", "sentence"), BAD_BUILDS)
def test_build_refuses_injection_and_paths_outside(fa, tmp_path, http_stub, app_repo, change,
                                                   sentence):
    runtime = build_runtime(fa, tmp_path, str(app_repo))
    params = {"repo": str(app_repo), "ref": "main", "kind": "make", "app": "out/app.bin",
              **change}
    _, result = run_job(fa, runtime, http_stub.url, {"job_id": "bx", "workload": "build",
                                                     "params": params})
    assert result["ok"] is False and sentence in result["error"], result["error"]
    assert rows(http_stub) == []
    assert not (tmp_path / "pwned").exists()


def test_build_does_not_follow_links_out_of_the_checkout(fa, tmp_path, http_stub):
    repo = tmp_path / "linky"
    repo.mkdir()
    secret = tmp_path / "secret.txt"
    secret.write_text("private")
    (repo / "Makefile").write_text(f"all:\n\tmkdir -p out/App.app\n"
                                   f"\tln -sf {secret} out/App.app/stolen\n"
                                   f"\tln -sf {secret} out/link.bin\n"
                                   f"\techo code > out/App.app/main\n")
    for args in (("init", "-q"), ("config", "user.email", "t@e"), ("config", "user.name", "t"),
                 ("add", "-A"), ("commit", "-qm", "x")):
        git(*args, cwd=repo)
    runtime = build_runtime(fa, tmp_path, str(repo))
    spec = {"job_id": "ln", "workload": "build", "backend": "make",
            "params": {"repo": str(repo), "app": "out/link.bin"}}
    _, result = run_job(fa, runtime, http_stub.url, spec)
    assert result["ok"] is False and "the build produced nothing at" in result["error"]
    spec["params"]["app"] = "out/App.app"
    _, result = run_job(fa, runtime, http_stub.url, spec)
    assert result["ok"] is True, result
    import io

    with zipfile.ZipFile(io.BytesIO(http_stub.blobs[result["artifacts"][0]])) as bundle:
        assert bundle.namelist() == ["App.app/main"]


def test_check_repo_accepts_the_usual_forms(fa):
    for good in ("https://github.com/o/r.git", "ssh://git@host/o/r", "git@github.com:o/r.git",
                 "file:///srv/r", "/srv/repos/r"):
        assert fa.check_repo(good) == good
    assert fa.repo_allowed("https://github.com/me/app", ["https://github.com/me/"])
    assert not fa.repo_allowed("https://github.com/meme/app", ["https://github.com/me"])
    assert fa.build_task("cargo", "build --release --bin app") == ["build", "--release",
                                                                   "--bin", "app"]
    assert fa.build_task("xcodebuild", "-scheme 'My App' build") == ["-scheme", "My App",
                                                                    "build"]


def test_vantage_falls_back_to_the_next_address(fa, website):
    import socket

    site = website({"/": (200, b"ok", {})})
    closed = ("127.0.0.1", free_port())
    open_ = ("127.0.0.1", int(site.url.rsplit(":", 1)[1]))
    infos = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", closed),
             (socket.AF_INET, socket.SOCK_STREAM, 6, "", open_)]
    sock = fa.connect_first(infos, 5)
    try:
        assert sock.getpeername() == open_
    finally:
        sock.close()
    with pytest.raises(ConnectionRefusedError):
        fa.connect_first(infos[:1], 5)


# --- pages that never finish, and inputs too large to keep ---


def trickled_job(fa, runtime, stub, spec: dict) -> JobThread:
    job = JobThread(fa, runtime, stub.url, spec)
    job.start()
    return job


def test_vantage_gives_up_a_trickling_page_at_its_timeout(fa, tmp_path, http_stub, trickle):
    page = trickle(0.2)  # a byte every 0.2 s: no read waits long enough for a socket timeout
    runtime = vantage_runtime(fa, tmp_path, "--allow-private-urls")
    started = time.monotonic()
    job = trickled_job(fa, runtime, http_stub, {
        "job_id": "vt", "workload": "vantage",
        "params": {"urls": [page.url + "/"], "repeats": 1, "timeout_s": 1}})
    result = job.finish(10)
    assert time.monotonic() - started < 5
    row = rows(http_stub)[0]
    assert row["ok"] is False and row["error"] == f"{page.url}/: timed out: took longer than 1 s"
    assert result["ok"] is False and result["metrics"]["urls_ok"] == 0


def test_a_cancel_stops_vantage_waiting_on_a_silent_page(fa, tmp_path, http_stub, trickle):
    page = trickle(None)  # headers, then nothing: each read waits the whole socket timeout
    runtime = vantage_runtime(fa, tmp_path, "--allow-private-urls")
    job = trickled_job(fa, runtime, http_stub, {
        "job_id": "vc", "workload": "vantage",
        "params": {"urls": [page.url + "/"], "repeats": 1, "timeout_s": 60}})
    wait_for(lambda: page.requests >= 1, 10, what="the measurement to start")
    started = time.monotonic()
    job.ctx.request_stop("stopped: the collector no longer renews this job's lease")
    result = job.finish(10)
    assert time.monotonic() - started < 3
    assert result == {"ok": False, "metrics": {}, "artifacts": [],
                      "error": "stopped: the collector no longer renews this job's lease"}
    assert rows(http_stub) == []


@pytest.fixture
def unanswered_name(monkeypatch):
    """`slow.test`, a name whose lookup the resolver never answers. This machine runs no DNS
    server of ours, so the system's resolver call (socket.getaddrinfo) is replaced for that one
    name: it waits, as getaddrinfo does on a network whose resolver is gone, until the test
    ends. The `asked` event is set when a lookup of it starts."""
    import socket
    import threading

    asked, release = threading.Event(), threading.Event()
    system = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        if host == "slow.test":
            asked.set()
            release.wait(60)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return system(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield asked
    release.set()


def test_vantage_gives_up_a_name_the_resolver_never_answers_at_its_timeout(
        fa, tmp_path, http_stub, unanswered_name):
    runtime = vantage_runtime(fa, tmp_path)
    started = time.monotonic()
    job = trickled_job(fa, runtime, http_stub, {
        "job_id": "vn", "workload": "vantage",
        "params": {"urls": ["http://slow.test/"], "repeats": 1, "timeout_s": 1}})
    result = job.finish(10)
    assert time.monotonic() - started < 5
    row = rows(http_stub)[0]
    assert row["ok"] is False and row["error"] == "http://slow.test/: timed out: took longer " \
                                                  "than 1 s", row
    assert result["ok"] is False and result["metrics"]["urls_ok"] == 0


def test_vantage_says_a_name_does_not_resolve_through_the_lookup_thread(
        fa, tmp_path, http_stub, monkeypatch):
    """The resolver's own refusal, raised in the lookup's thread, is the measurement's error
    (`gone.test`: the system call replaced for that one name, as in unanswered_name)."""
    import socket

    system = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        if host == "gone.test":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return system(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    _, result = run_job(fa, vantage_runtime(fa, tmp_path), http_stub.url, {
        "job_id": "vg", "workload": "vantage",
        "params": {"urls": ["http://gone.test/"], "repeats": 1, "timeout_s": 5}})
    [row] = rows(http_stub)
    assert row["ok"] is False and row["error"] == (
        "http://gone.test/: the name does not resolve (Name or service not known)"), row
    assert result["ok"] is False and result["metrics"]["urls_ok"] == 0


def test_a_cancel_stops_vantage_waiting_on_the_resolver(fa, tmp_path, http_stub,
                                                       unanswered_name):
    runtime = vantage_runtime(fa, tmp_path)
    job = trickled_job(fa, runtime, http_stub, {
        "job_id": "vr", "workload": "vantage",
        "params": {"urls": ["http://slow.test/"], "repeats": 1, "timeout_s": 60}})
    assert unanswered_name.wait(10), "the lookup never started"
    started = time.monotonic()
    job.ctx.request_stop("the agent is shutting down")
    result = job.finish(10)
    assert time.monotonic() - started < 3
    assert result == {"ok": False, "metrics": {}, "artifacts": [],
                      "error": "the agent is shutting down"}


def test_a_cancel_stops_dataset_prep_fetching_a_trickling_source(fa, tmp_path, http_stub,
                                                                 trickle):
    page = trickle(0.2)
    runtime = device_runtime(fa, tmp_path, "--allow-private-urls")
    job = trickled_job(fa, runtime, http_stub, {
        "job_id": "dc", "workload": "dataset-prep",
        "params": {"source": page.url + "/data.jsonl", "format": "lines", "max_bytes": 1000}})
    wait_for(lambda: page.requests >= 1, 10, what="the download to start")
    started = time.monotonic()
    job.ctx.request_stop("the agent is shutting down")
    result = job.finish(10)
    assert time.monotonic() - started < 3
    assert result["ok"] is False and result["error"] == "the agent is shutting down"


def test_dataset_prep_gives_up_a_trickling_source_at_its_timeout(fa, tmp_path, http_stub,
                                                                trickle):
    page = trickle(0.2)
    runtime = device_runtime(fa, tmp_path, "--allow-private-urls")
    job = trickled_job(fa, runtime, http_stub, {
        "job_id": "dt", "workload": "dataset-prep",
        "params": {"source": page.url + "/data.jsonl", "format": "lines", "timeout_s": 1}})
    result = job.finish(10)
    assert result["ok"] is False
    assert result["error"] == (f"params.source {page.url}/data.jsonl could not be fetched: "
                               "timed out: took longer than 1 s")


def test_a_json_lines_input_past_its_byte_cap_is_refused_before_any_item(fa, tmp_path,
                                                                         http_stub):
    # Each record is quick to embed but large to keep: about 170 of them pass the cap.
    record = {"query": "red fox", "candidates": ["red fox den"], "pad": "x" * 100_000}
    size = len(jsonl([record]))
    data = jsonl([record] * (fa.MAX_JSONL_BYTES // size + 2))
    _, result = run_job(fa, device_runtime(fa, tmp_path), http_stub.url, {
        "job_id": "big", "workload": "embed-eval", "params": {"input_sha256": blob(http_stub,
                                                                                   data)}})
    assert result["ok"] is False
    # Refused by its size as it is downloaded: no more of it than a JSON Lines input may have
    # is written to the disk.
    assert result["error"] == (f"artifact {sha(data)[:12]} could not be downloaded: it is "
                               f"larger than the {fa.MAX_JSONL_BYTES} bytes the agent takes")
    assert rows(http_stub) == []
    assert list((tmp_path / "state" / "cache").iterdir()) == []


def test_a_progress_artifact_past_its_cap_is_refused_before_it_is_downloaded(fa, tmp_path,
                                                                            http_stub):
    big = json.dumps({"kind": "fleet-agent-progress", "completed": [],
                      "pad": "x" * fa.MAX_PROGRESS_BYTES}).encode()
    runtime = device_runtime(fa, tmp_path)
    _, result = run_job(fa, runtime, http_stub.url, {
        "job_id": "res", "workload": "benchmark", "backend": "synthetic",
        "params": {"resume_from": blob(http_stub, big), "measure_iters": 1, "prompt_tokens": 1,
                   "gen_tokens": 1, "warmup_iters": 0}})
    assert result["ok"] is False
    assert result["error"] == (f"params.resume_from: artifact {sha(big)[:12]} could not be "
                               f"downloaded: it is larger than the {fa.MAX_PROGRESS_BYTES} "
                               "bytes the agent takes")
    assert list((tmp_path / "state" / "cache").iterdir()) == []


def test_a_pipeline_polls_a_topic_answered_at_once_about_once_a_second(fa, tmp_path,
                                                                      http_stub):
    # A collector (or a proxy) that does not hold the event long poll answers it at once.
    http_stub.answers = {"/api/events/t": {"last_seq": 0},
                         "/api/events/t/next": {"events": []}}
    _, result = run_job(fa, device_runtime(fa, tmp_path), http_stub.url, {
        "job_id": "pipe", "workload": "pipeline", "backend": "synthetic",
        "params": {"topic": "t", "duration_s": 2}})
    assert result["ok"] is True and result["ended"] == "duration_s reached", result
    polls = [call for call in http_stub.calls if call[1].startswith("/api/events/t/next")]
    assert 1 <= len(polls) <= 4, len(polls)


# --- the artifact cache's bound ---


def test_a_job_keeps_every_artifact_it_fetched_however_small_the_cache(fa, tmp_path, http_stub,
                                                                        llama_runtime):
    """A cache that may keep a single byte: the vision job's model and projector, fetched
    before its images, are read again for every image; none is removed while the job runs.
    The next job's download then removes them, the least recently used, and keeps its own."""
    llama_runtime.cache = fa.ArtifactCache(str(tmp_path / "state" / "cache"), max_bytes=1)
    cache = tmp_path / "state" / "cache"
    images = [b"FAKEIMG:cat", b"FAKEIMG:dog", b"FAKEIMG:cat"]
    data = jsonl([{"image_sha256": blob(http_stub, image), "label": "cat"} for image in images])
    _, result = run_job(fa, llama_runtime, http_stub.url, vision_job(http_stub, data))
    assert result["ok"] is True, result
    assert [r["ok"] for r in rows(http_stub)] == [True, True, True]
    assert {p.name for p in cache.iterdir()} == {
        sha(GGUF_MODEL) + ".gguf", sha(b"GGUF projector") + ".gguf", sha(data) + ".jsonl",
        sha(b"FAKEIMG:cat"), sha(b"FAKEIMG:dog")}
    prompts = jsonl(["one prompt"])
    _, result = run_job(fa, llama_runtime, http_stub.url, {
        "job_id": "next", "workload": "batch", "backend": "synthetic",
        "params": {"input_sha256": blob(http_stub, prompts), "max_tokens": 1}})
    assert result["ok"] is True, result
    assert [p.name for p in cache.iterdir()] == [sha(prompts) + ".jsonl"]
