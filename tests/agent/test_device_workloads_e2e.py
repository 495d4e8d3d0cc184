"""End-to-end: each device workload enqueued over HTTP on a real collector process, run by real
agent processes, its rows read back from the collector.

llama.cpp and whisper.cpp are fake executables on the agents' PATH (tests/support/fake_llama.py);
vantage and dataset-prep reach a local web site; build runs make on a git repository made here.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request

import pytest

from tests.support.agent import device_job, free_port, http_bytes, http_json, python38, wait_for
from tests.support.fake_llama import GGUF_MODEL, install_fakes, jsonl, wav_bytes

pytestmark = pytest.mark.slow

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def registered(collector, device_id: str) -> bool:
    return collector.get(f"/api/devices/{device_id}")[0] == 200


def final_row(collector, job_id: str) -> dict:
    return next(r for r in collector.results(job_id) if r["final"])


def item_rows(collector, job_id: str) -> list[dict]:
    return sorted((r for r in collector.results(job_id) if not r["final"]),
                  key=lambda r: r["iter"])


def payload(row: dict) -> dict:
    """The row as the agent posted it (fields beyond the stored columns live there)."""
    return row.get("payload") or row


def tool_path(tmp_path) -> dict:
    return {"PATH": f"{install_fakes(tmp_path / 'bin')}{os.pathsep}{os.environ['PATH']}"}


def make_repo(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "Makefile").write_text("all:\n\tmkdir -p dist\n\techo shelf app > dist/app.bin\n")
    for args in (("init", "-q", "-b", "main"), ("config", "user.email", "t@example.com"),
                 ("config", "user.name", "t"), ("add", "-A"), ("commit", "-qm", "one")):
        subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)
    return repo


def test_every_device_workload_runs_on_a_real_agent(procs, tmp_path, website):
    collector = procs.collector()
    repo = make_repo(tmp_path)
    allowed = tmp_path / "build-repos"
    allowed.write_text(f"{repo}\n")
    site = website({"/": (200, b"hello from the web", {})})
    procs.agent([collector], "shelf-1", "--allow-private-urls", "--build-repos", str(allowed),
                env=tool_path(tmp_path))
    wait_for(lambda: registered(collector, "shelf-1"), 20, what="registration")
    up = collector.upload
    gguf = up(GGUF_MODEL, "tiny.gguf")
    llama = {"model": {"name": "tiny", "format": "gguf", "sha256": gguf}}
    prompts = up(jsonl([{"prompt": "say hi"}, {"prompt": "say bye"}]), "prompts.jsonl")
    evalset = up(jsonl([{"prompt": "Say YES", "expected": "yes"},
                        {"prompt": "Say NO", "expected": "maybe"}]), "eval.jsonl")
    images = up(jsonl([{"image_sha256": up(b"FAKEIMG:cat", "cat"), "label": "cat"}]), "img")
    audio = up(jsonl([{"audio_sha256": up(wav_bytes(1.0), "a.wav"), "text": "hello world"}]),
               "audio")
    pairs = up(jsonl([{"query": "red fox", "candidates": ["blue sea", "red fox den"],
                       "expected": 1}]), "pairs")
    dataset = up(jsonl([{"n": n} for n in range(20)]), "dataset.jsonl")
    specs = [
        device_job("thermal", "thermal", "synthetic",
            params={"prompt_tokens": 4, "gen_tokens": 2, "duration_s": 1}),
        device_job("thermal-llama", "thermal", "llama.cpp", **llama,
            params={"prompt_tokens": 8, "gen_tokens": 4, "duration_s": 0}),
        device_job("batch", "batch", "synthetic",
                   params={"input_sha256": prompts, "max_tokens": 2}),
        device_job("batch-llama", "batch", "llama.cpp", **llama, params={"input_sha256": prompts}),
        device_job("llm-eval", "llm-eval", "llama.cpp", **llama, params={"input_sha256": evalset}),
        device_job("vision", "vision-eval", "llama.cpp", **llama,
            params={"input_sha256": images, "mmproj_sha256": up(b"GGUF proj", "proj")}),
        device_job("speech", "speech-eval", "whisper.cpp", **llama, params={"input_sha256": audio}),
        device_job("embed", "embed-eval", "llama.cpp", **llama, params={"input_sha256": pairs}),
        device_job("vantage", "vantage", params={"urls": [site.url + "/"], "repeats": 2}),
        device_job("prep", "dataset-prep", params={"source": dataset, "split": "train:3,test:1"}),
        device_job("convert", "model-convert", model={"name": "tiny"},
            params={"input_sha256": gguf, "formats": ["gguf"], "quant": "Q4_K_M"}),
        device_job("build", "build", "make", app={"name": "shelf-app", "platform": "linux"},
            params={"repo": str(repo), "ref": "main", "kind": "make", "task": "all",
                    "app": "dist/app.bin"}),
    ]
    for spec in specs:
        collector.enqueue(spec)
    for spec in specs:
        done = collector.wait_status(spec["job_id"], ("done", "failed"), timeout=90)
        assert done["status"] == "done", (spec["job_id"], done["last_error"])
        assert item_rows(collector, spec["job_id"]), spec["job_id"]
    check_figures(collector)


def check_figures(collector) -> None:
    thermal = item_rows(collector, "thermal")
    assert len(thermal) >= 2 and all("thermal_state" in r["metrics"] or "elapsed_s" in
                                     r["metrics"] for r in thermal)
    assert final_row(collector, "thermal")["metrics"]["iterations"] == len(thermal)
    assert final_row(collector, "thermal-llama")["metrics"]["decode_tok_s"] == 25.0
    assert [payload(r)["output"] for r in item_rows(collector, "batch-llama")] == ["HI", "BYE"]
    outputs = http_bytes(collector.url + "/artifacts/" + final_row(
        collector, "batch")["artifacts"][0]).decode().splitlines()
    assert len(outputs) == 2
    assert final_row(collector, "llm-eval")["metrics"]["score_pct"] == 50.0
    assert final_row(collector, "vision")["metrics"]["top1_pct"] == 100.0
    assert final_row(collector, "speech")["metrics"]["wer_pct"] == 0.0
    assert final_row(collector, "embed")["metrics"]["top1_pct"] == 100.0
    vantage = item_rows(collector, "vantage")[0]["metrics"]
    assert vantage["status"] == 200 and vantage["bytes"] == 18 and vantage["total_ms"] > 0
    prep = payload(final_row(collector, "prep"))
    assert [prep["splits"][n]["items"] for n in ("train", "test")] == [15, 5]
    quant = item_rows(collector, "convert")[0]
    assert http_bytes(collector.url + "/artifacts/" + quant["artifacts"][0]).startswith(
        b"GGUF Q4_K_M")
    build = final_row(collector, "build")
    assert http_bytes(collector.url + "/artifacts/" + build["artifacts"][0]) == b"shelf app\n"
    status, listed = collector.get("/api/artifacts?app=shelf-app")
    assert status == 200 and [a["sha256"] for a in listed["artifacts"]] == \
        [build["artifacts"][0]]
    assert listed["artifacts"][0]["platform"] == "linux"
    assert listed["artifacts"][0]["build"] == payload(build)["commit"][:12]


def publish(collector, topic: str, body) -> int:
    status, reply = collector.post(f"/api/events/{topic}", body)
    assert status == 201, reply
    return reply["seq"]


def test_pipeline_follows_a_topic_through_preemption_until_cancelled(procs):
    collector = procs.collector()
    agent = procs.agent([collector], "pipe-1")
    wait_for(lambda: registered(collector, "pipe-1"), 20, what="registration")
    first = publish(collector, "prompts", {"prompt": "abcd"})
    collector.enqueue(device_job("pipe", "pipeline", "synthetic", preemptible=True,
                          targets={"device_id": "pipe-1"},
                          params={"topic": "prompts", "output_topic": "answers",
                                  "max_tokens": 2, "after": first - 1}))
    publish(collector, "prompts", "a plain string prompt")
    wait_for(lambda: len(item_rows(collector, "pipe")) >= 2, 30, what="two events")
    # A higher-priority job for this device preempts the pipeline; it resumes after it.
    collector.enqueue(device_job("urgent", "self-check", priority=10,
                                 targets={"device_id": "pipe-1"}))
    assert collector.wait_status("urgent", ("done", "failed"), 40)["status"] == "done"
    wait_for(lambda: collector.job("pipe")["status"] == "claimed" and collector.job(
        "pipe")["spec"]["params"].get("resume_from"), 40, what="the pipeline to resume")
    publish(collector, "prompts", {"n": 3})
    wait_for(lambda: len([r for r in item_rows(collector, "pipe") if not r["preempted"]]) >= 3,
             30, what="the third event")
    status, reply = collector.post("/api/jobs/pipe/cancel")
    assert status == 200, reply
    wait_for(lambda: any(r["final"] and not r["preempted"] for r in collector.results("pipe")),
             30, what="the closing row")
    rows = [r for r in collector.results("pipe") if not r["preempted"]]
    events = sorted(payload(r)["seq"] for r in rows if not r["final"])
    assert len(events) == len(set(events)) == 3  # each event once, none lost in the hand-back
    closing = payload(next(r for r in rows if r["final"]))
    assert closing["ok"] is True and closing["metrics"]["events"] == 3
    assert "no longer renews" in closing["ended"]
    assert collector.job("pipe")["status"] == "cancelled"
    _, answers = collector.get("/api/events/answers?limit=10")
    assert sorted(e["payload"]["seq"] for e in answers["events"]) == events
    assert "job pipe ended: ok" in agent.log()


def test_serve_answers_on_its_port_until_cancelled(procs):
    collector = procs.collector()
    procs.agent([collector], "serve-1")
    wait_for(lambda: registered(collector, "serve-1"), 20, what="registration")
    port = free_port()
    collector.enqueue(device_job("srv", "serve", "synthetic", params={"port": port, "report_s": 1}))
    wait_for(lambda: item_rows(collector, "srv"), 30, what="the ready row")
    for _ in range(2):
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/completion", method="POST",
            data=json.dumps({"prompt": "abcd", "n_predict": 1}).encode())
        with _OPENER.open(request, timeout=10) as response:
            assert len(json.loads(response.read())["content"]) == 64
    wait_for(lambda: any(r["metrics"].get("requests_served") == 2
                         for r in item_rows(collector, "srv")), 30, what="a report row")
    assert collector.post("/api/jobs/srv/cancel")[0] == 200
    wait_for(lambda: any(r["final"] for r in collector.results("srv")), 30, what="the end")
    closing = final_row(collector, "srv")
    assert closing["ok"] is True and closing["metrics"]["requests_served"] == 2
    with pytest.raises(OSError):
        _OPENER.open(f"http://127.0.0.1:{port}/health", timeout=5)


def test_a_job_waits_for_an_agent_that_declares_its_backend(procs, tmp_path):
    collector = procs.collector()
    oldest = python38()  # the plain agent on the oldest Python the agent supports, when present
    procs.agent([collector], "plain-1", **({"python": oldest} if oldest else {}))
    wait_for(lambda: registered(collector, "plain-1"), 20, what="registration")
    status, reply = http_json("POST", collector.url + "/jobs", device_job(
        "early", "batch", "llama.cpp", params={"input_sha256": "a" * 64}))
    assert status == 422 and "batch:llama.cpp" in reply["error"]  # nobody declares it yet
    procs.agent([collector], "llama-1", env=tool_path(tmp_path))
    wait_for(lambda: registered(collector, "llama-1"), 20, what="registration")
    # llama-1 is kept busy serving; the llama.cpp batch must wait for it, not go to plain-1.
    port = free_port()
    collector.enqueue(device_job("busy", "serve", "synthetic", targets={"device_id": "llama-1"},
                          params={"port": port}))
    wait_for(lambda: collector.job("busy")["status"] == "claimed", 30, what="the server")
    prompts = collector.upload(jsonl([{"prompt": "say ok"}]), "p")
    gguf = collector.upload(GGUF_MODEL, "m")
    collector.enqueue(device_job("needs-llama", "batch", "llama.cpp",
                          model={"name": "m", "sha256": gguf}, params={"input_sha256": prompts}))
    collector.enqueue(device_job("plain", "batch", "synthetic", params={"input_sha256": prompts}))
    plain = collector.wait_status("plain", ("done", "failed"), 30)
    assert plain["status"] == "done" and plain["claimed_by"] == "plain-1"
    time.sleep(2)  # plain-1 polls again meanwhile; it must not be offered the llama.cpp job
    assert collector.job("needs-llama")["status"] == "queued"
    assert collector.post("/api/jobs/busy/cancel")[0] == 200
    done = collector.wait_status("needs-llama", ("done", "failed"), 40)
    assert done["status"] == "done" and done["claimed_by"] == "llama-1"
    assert payload(item_rows(collector, "needs-llama")[0])["output"] == "OK"
