"""Pipeline topics through HTTP against a real collector: publish, list, recent, long poll."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import pytest

from tests.support.collector import CollectorProcess
from tests.support.stream import StreamReader


async def publish(client, topic, payload, path="/api/events", **params):
    resp = await client.post(f"{path}/{topic}", data=json.dumps(payload), params=params,
                             headers={"Content-Type": "application/json"})
    assert resp.status == 201, await resp.text()
    return await resp.json()


async def test_publish_then_read_recent_newest_first(client):
    first = await publish(client, "frames", {"n": 1})
    second = await publish(client, "frames", {"n": 2}, path="/events", source="pi-5")
    assert first["ok"] is True and first["topic"] == "frames" and first["at"].endswith("Z")
    assert second["seq"] > first["seq"]
    body = await (await client.get("/api/events/frames")).json()
    assert body["topic"] == "frames" and body["count"] == 2
    assert body["last_seq"] == second["seq"]
    assert [e["payload"] for e in body["events"]] == [{"n": 2}, {"n": 1}]
    assert body["events"][0]["source"] == "pi-5" and body["events"][1]["source"] is None


async def test_recent_limit_and_before_page_back(client):
    seqs = [(await publish(client, "t", i))["seq"] for i in range(7)]
    page = await (await client.get("/api/events/t?limit=3")).json()
    assert [e["payload"] for e in page["events"]] == [6, 5, 4]
    older = await (await client.get(f"/api/events/t?limit=3&before={seqs[4]}")).json()
    assert [e["payload"] for e in older["events"]] == [3, 2, 1]
    for bad in ("0", "501", "x"):
        resp = await client.get(f"/api/events/t?limit={bad}")
        assert resp.status == 400 and "limit" in (await resp.json())["error"]


async def test_unknown_topic_reads_empty(client):
    body = await (await client.get("/api/events/nothing-yet")).json()
    assert body == {"topic": "nothing-yet", "count": 0, "last_seq": None, "last_at": None,
                    "events": []}


async def test_list_topics_with_counts_and_three_recent_payloads(client):
    for i in range(5):
        await publish(client, "a.b:c-d_e", {"i": i})
    await publish(client, "other", [1, 2])
    body = await (await client.get("/api/events")).json()
    assert [t["topic"] for t in body["topics"]] == ["other", "a.b:c-d_e"]  # newest activity first
    listed = body["topics"][1]
    assert listed["count"] == 5 and listed["last_at"].endswith("Z")
    assert [e["payload"] for e in listed["recent"]] == [{"i": 4}, {"i": 3}, {"i": 2}]
    assert body["topics"][0]["recent"][0]["payload"] == [1, 2]


async def test_large_payloads_are_bounded_in_listings_and_reads(client):
    """Payloads up to 64 KiB each were served whole everywhere: 1,500 of them made one
    GET /api/events 93 MiB, and a read of one topic 31 MiB. The listing carries a payload the
    stream would (4 KiB), and a read stops at 1 MiB of payloads, the cursor going on from
    its last event."""
    big = "x" * 60_000
    seqs = [(await publish(client, "frames", {"n": n, "pad": big}))["seq"] for n in range(40)]
    await publish(client, "frames", {"n": 40})
    listed = (await (await client.get("/api/events")).json())["topics"][0]
    assert [e.get("payload") for e in listed["recent"]] == [{"n": 40}, None, None]
    omitted = listed["recent"][1]
    assert omitted["payload_omitted"] is True and omitted["seq"] == seqs[-1]
    assert omitted["payload_bytes"] == len(json.dumps({"n": 39, "pad": big},
                                                      separators=(",", ":")))
    page = (await (await client.get("/api/events/frames?limit=500")).json())["events"]
    # Events while the payloads before each add up to under 1 MiB: n=40 and 18 of ~60 KB.
    assert [e["payload"]["n"] for e in page] == list(range(40, 21, -1))
    older = await (await client.get(f"/api/events/frames?before={page[-1]['seq']}")).json()
    assert older["events"][0]["payload"]["n"] == 21
    read = []
    after = 0
    while True:  # the cursor reads every event, a bounded page at a time
        resp = await client.get(f"/api/events/frames/next?after={after}&limit=500&wait_s=0")
        if resp.status == 204:
            break
        events = (await resp.json())["events"]
        assert 1 <= len(events) <= 19
        read += [e["payload"]["n"] for e in events]
        after = events[-1]["seq"]
    assert read == list(range(41))


async def test_any_json_value_is_a_payload(client):
    for value in (None, 3.5, "text", [1, {"x": True}], {"deep": {"er": []}}):
        await publish(client, "values", value)
    events = (await (await client.get("/api/events/values")).json())["events"]
    assert [e["payload"] for e in reversed(events)] == [
        None, 3.5, "text", [1, {"x": True}], {"deep": {"er": []}}]


async def test_bad_names_and_bodies_are_refused_and_store_nothing(client):
    for name in ("has space", "a" * 101, "sl%2Fash", "emoji\u00e9"):
        resp = await client.post(f"/api/events/{name}", json={})
        assert resp.status in (400, 404), name
        assert "error" in await resp.json()
    resp = await client.post("/api/events/x", data=b"{not json",
                             headers={"Content-Type": "application/json"})
    assert resp.status == 400 and "JSON" in (await resp.json())["error"]
    resp = await client.post("/api/events/x", data=b"")
    assert resp.status == 400
    big = json.dumps({"blob": "x" * (64 * 1024)})
    resp = await client.post("/api/events/x", data=big,
                             headers={"Content-Type": "application/json"})
    assert resp.status == 413
    resp = await client.post("/api/events/x?source=" + "s" * 201, json={})
    assert resp.status == 400
    resp = await client.post("/api/events/x", data=b"[" * 100_000 + b"]" * 100_000)
    assert resp.status in (400, 413)
    assert (await (await client.get("/api/events")).json()) == {"topics": []}


async def test_payload_just_under_the_limit_is_kept(client):
    payload = {"blob": "y" * (64 * 1024 - 20)}
    await publish(client, "big", payload)
    events = (await (await client.get("/api/events/big")).json())["events"]
    assert events[0]["payload"] == payload


# -- the long poll -----------------------------------------------------------------------------


async def test_next_returns_events_after_the_cursor_at_once(client):
    seqs = [(await publish(client, "q", i))["seq"] for i in range(4)]
    await publish(client, "elsewhere", "not this topic")
    resp = await client.get(f"/api/events/q/next?after={seqs[1]}&wait_s=0")
    body = await resp.json()
    assert resp.status == 200 and body["topic"] == "q"
    assert [e["payload"] for e in body["events"]] == [2, 3]
    assert body["cursor"] == seqs[3]
    resp = await client.get(f"/api/events/q/next?after={seqs[0]}&limit=2&wait_s=0")
    assert [e["payload"] for e in (await resp.json())["events"]] == [1, 2]


async def test_next_with_nothing_new_answers_204_after_the_wait(client):
    seq = (await publish(client, "quiet", 1))["seq"]
    resp = await client.get(f"/api/events/quiet/next?after={seq}&wait_s=0.2")
    assert resp.status == 204
    resp = await client.get("/api/events/never/next?wait_s=0")
    assert resp.status == 204


async def test_a_waiting_poll_wakes_on_publish(collector_factory):
    # The hold is long (20 s): only the publish can answer the poll before the test's timeout.
    client = await collector_factory(long_poll_s=20.0)
    seq = (await publish(client, "wake", "old"))["seq"]
    poll = asyncio.create_task(client.get(f"/api/events/wake/next?after={seq}"))
    await _until(client, lambda health: health["topic_polls"] == 1)
    await publish(client, "other-topic", "does not wake it")
    await publish(client, "wake", {"fresh": True})
    resp = await asyncio.wait_for(poll, 10)
    body = await resp.json()
    assert resp.status == 200 and [e["payload"] for e in body["events"]] == [{"fresh": True}]
    health = await (await client.get("/api/health")).json()
    assert health["topic_polls"] == 0


async def test_many_waiting_polls_all_wake(collector_factory):
    client = await collector_factory(long_poll_s=20.0)
    polls = [asyncio.create_task(client.get("/api/events/fan/next?after=0")) for _ in range(20)]
    await _until(client, lambda health: health["topic_polls"] == 20)
    await publish(client, "fan", "go")
    answers = await asyncio.wait_for(asyncio.gather(*polls), 10)
    assert [r.status for r in answers] == [200] * 20


async def test_next_refuses_bad_cursor_and_wait(client):
    for query in ("after=-1", "after=x", "wait_s=26", "wait_s=nan", "wait_s=-1", "limit=0"):
        resp = await client.get(f"/api/events/t/next?{query}")
        assert resp.status == 400, query
        assert "error" in await resp.json()
    resp = await client.get("/api/events/bad name/next")
    assert resp.status in (400, 404)


async def test_topic_events_reach_the_live_stream(client):
    async with StreamReader(client) as stream:
        done = await publish(client, "live", {"sent": 1.5})
        big = await publish(client, "live", {"blob": "z" * 5000})
        small = await stream.next_of("topic")
        assert small == {"type": "topic", "at": small["at"], "topic": "live",
                         "seq": done["seq"], "source": None, "payload": {"sent": 1.5}}
        large = await stream.next_of("topic")
        assert large["seq"] == big["seq"] and large["payload_omitted"] is True
        assert "payload" not in large


async def _until(client, condition, timeout=10.0):
    """Wait until /api/health satisfies condition (a readiness wait, not a timing claim)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        health = await (await client.get("/api/health")).json()
        if condition(health):
            return health
        assert asyncio.get_running_loop().time() < deadline, health
        await asyncio.sleep(0.02)


@pytest.mark.slow
def test_sigterm_answers_waiting_topic_polls(tmp_path):
    proc = CollectorProcess(tmp_path / "data").start()
    answers: list[int] = []
    poll = threading.Thread(target=lambda: answers.append(
        proc.client.get("/api/events/x/next?wait_s=25", timeout=60)[0]))
    poll.start()
    for _ in range(500):  # until the poll is parked (a readiness wait)
        if proc.client.get("/api/health")[1]["topic_polls"] == 1:
            break
        time.sleep(0.02)
    assert proc.stop(signal.SIGTERM) == 0, proc.log()
    poll.join(20)  # well inside the 25 s hold: shutdown answered it
    assert not poll.is_alive() and answers == [204]
