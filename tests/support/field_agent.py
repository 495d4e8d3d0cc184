"""A client that speaks only the wire of the agents and clients already in the field (the
original tools'): beacons with on_ac / idle_s / load_1m / disk_free_gb and null for what a probe
cannot tell, result rows without iter, host rows with test.artifacts, suite kinds maestro and
xcuitest, report_to.github_status, and payload read back from the job detail. It never sends our
own names (ac, load, iter, flow_runner, native_bundle, ci_status)."""

from __future__ import annotations

import hashlib
import json
import urllib.request
from typing import Any

from tests.support.collector import HttpClient

# The synthetic attestation as the native agents compute it (decisions.md).
BLOCK_BYTES = 4096


def attestation(rounds: int = 1000) -> str:
    block = bytearray((i * 31) & 0xFF for i in range(BLOCK_BYTES))
    for _ in range(rounds):
        block[:32] = hashlib.sha256(block).digest()
    return hashlib.sha256(block).hexdigest()


class FieldAgent:
    """One device (or, with executor set, one host executor) of the original wire."""

    def __init__(self, base: str, device_id: str, executor: str | None = None) -> None:
        self.http = HttpClient(base)
        self.device_id = device_id
        self.executor = executor

    def _ok(self, reply: tuple[int, Any], *statuses: int) -> Any:
        status, body = reply
        assert status in (statuses or (200,)), (status, body)
        return body

    def register(self, capabilities: list[str], **descriptor: Any) -> dict[str, Any]:
        return dict(self._ok(self.http.post("/devices/register", {
            "device_id": self.device_id, "capabilities": capabilities,
            "descriptor": {"platform": "ios", "kind": "phone", "model": "iPhone 15",
                           **descriptor}})))

    def beacon(self, job_id: str | None = None, **fields: Any) -> dict[str, Any]:
        """on_ac, idle_s, load_1m, disk_free_gb: a value, or None for a probe that cannot tell
        (sent as null, never left out)."""
        vitals = {"on_ac": None, "idle_s": None, "load_1m": None, "disk_free_gb": None,
                  "battery_pct": 64, "charging": False, "thermal": "nominal", **fields}
        body: dict[str, Any] = {"schema": 1, "kind": "beacon", "device_id": self.device_id,
                                "beacon": vitals}
        if job_id:
            body["job_id"] = job_id
        return dict(self._ok(self.http.post("/results", body)))

    def poll(self) -> dict[str, Any] | None:
        path = (f"/executor/next-job?name={self.executor}" if self.executor
                else f"/devices/{self.device_id}/next-job")
        status, spec = self.http.get(path, timeout=30)
        assert status in (200, 204), (status, spec)
        return dict(spec) if status == 200 else None

    def post_row(self, job_id: str, **fields: Any) -> dict[str, Any]:
        """A single result for a job, as the field agents post it: no iter."""
        row = {"schema": 1, "kind": "result", "job_id": job_id, "device_id": self.device_id,
               "final": True, "ok": True, **fields}
        assert "iter" not in row
        return dict(self._ok(self.http.post("/results", row)))

    def enqueue(self, spec: dict[str, Any]) -> dict[str, Any]:
        return dict(self._ok(self.http.post("/jobs", spec), 201))

    def upload(self, data: bytes) -> str:
        """POST /artifacts, checked for 201 as the original's clients do."""
        request = urllib.request.Request(self.http.base + "/artifacts", data=data, method="POST",
                                         headers={"Content-Type": "application/octet-stream"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 201, response.status
            return str(json.loads(response.read())["sha256"])

    def payloads(self, job_id: str) -> list[dict[str, Any]]:
        detail = self._ok(self.http.get(f"/api/jobs/{job_id}"))
        return [row["payload"] for row in detail["results"]]
