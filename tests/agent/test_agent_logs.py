"""What a person reads in the agent's log: one line when a collector is lost (retries stay at
DEBUG), one when it is back with the rows that waited for it, one when a job starts and one
when it ends with its outcome and duration. A real agent and a real collector that is stopped
and started again."""

from __future__ import annotations

import json
import re

import pytest

from tests.support.agent import wait_for

pytestmark = pytest.mark.slow


def bench(job_id: str, measure: int, prompt: int, gen: int) -> dict:
    return {"schema": 1, "job_id": job_id, "workload": "benchmark", "executor": "device",
            "backend": "synthetic", "lease": {"ttl_s": 120},
            "params": {"prompt_tokens": prompt, "gen_tokens": gen, "warmup_iters": 0,
                       "measure_iters": measure}}


def count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text, re.M))


def test_an_outage_is_told_once_and_the_reconnection_counts_the_rows(procs):
    collector = procs.collector()
    agent = procs.agent([collector], "logs-1")  # --log-level DEBUG, retries every 0.2-1 s
    url = re.escape(collector.url)
    wait_for(lambda: collector.get("/api/devices/logs-1")[0] == 200, 20, what="registration")
    # Many short iterations (about 0.25 s each in a calm hour, 0.6 s on a loaded machine): the
    # job outlives the collector by several rows on a fast machine and ends in time on a slow one.
    collector.enqueue(bench("long", measure=30, prompt=100, gen=40))
    wait_for(lambda: len(collector.results("long")) >= 2, 30, what="first rows")
    collector.stop()
    # The job goes on and its rows wait on disk; the agent retries many times meanwhile.
    wait_for(lambda: "job long ended" in agent.log(), 120, what="the job to end")
    wait_for(lambda: count(rf"DEBUG collector {url}: .*retrying in", agent.log()) >= 5, 30,
             what="several retries")
    log = agent.log()
    assert count(rf"WARNING collector {url} unreachable \(.*\), retrying in \d+ s$", log) == 1
    assert count(r"WARNING .*(unreachable|failed)", log) == 1, log
    spooled = len(agent.spooled())
    assert spooled >= 1

    collector.start()  # same port, same data directory
    line = wait_for(lambda: re.search(rf"INFO reconnected to {url} after \d+ s, delivered "
                                      r"(\d+) queued rows$", agent.log(), re.M), 30,
                    what="the reconnection line")
    assert int(line.group(1)) >= spooled
    assert collector.wait_status("long", ("done", "failed"))["status"] == "done"
    log = agent.log()
    assert count(r"INFO reconnected to", log) == 1
    assert count(rf"INFO job long started: benchmark from {url}$", log) == 1
    assert count(r"INFO job long ended: ok in \d+\.\d s$", log) == 1


def test_a_failed_and_a_handed_back_job_say_so_when_they_end(procs):
    collector = procs.collector()
    agent = procs.agent([collector], "logs-2")
    wait_for(lambda: collector.get("/api/devices/logs-2")[0] == 200, 20, what="registration")
    collector.enqueue(bench("nope", measure=20_000, prompt=1, gen=1))  # the agent refuses it
    collector.wait_status("nope", ("done", "failed"))
    wait_for(lambda: "job nope ended" in agent.log(), 20, what="the end line")
    assert re.search(r"INFO job nope ended: failed in \d+\.\d s: params.measure_iters must be",
                     agent.log())
    collector.enqueue(bench("stopped", measure=40, prompt=300, gen=100))
    wait_for(lambda: len(collector.results("stopped")) >= 1, 30, what="progress")
    assert agent.stop() == 0
    assert re.search(r"INFO job stopped ended: handed back in \d+\.\d s: the agent is shutting "
                     r"down", agent.log()), agent.log()[-2000:]
    rows = [json.loads(p.read_text()) for p in agent.spooled()]
    assert not rows  # the hand-back row was delivered before the agent exited
