"""The control plane's metrics (GET /metrics), all read at scrape from what the daemon holds in
memory: the last snapshot (runners, the queued runs GitHub listed), the GitHub client's answers
and rate limit, and the federation's agent hosts. A scrape reads no database and asks GitHub
nothing, so it costs the same however often it comes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from fleet_min import metrics
from fleet_min.controlplane.federation.hosts import Hosts
from fleet_min.controlplane.github.client import GitHub
from fleet_min.sse import EventHub
from fleet_min.timeutil import parse_iso

# The states a runner view takes (snapshot.Snapshots._view); an agent host reports its own
# runners' states, and anything else it sends is counted as "unknown" (a bounded label set).
RUNNER_STATES = ("working", "idle", "draining", "drained", "failed", "stopped")
QUEUED_JOB = ("queued", "waiting", "pending")
MAX_LABEL_SETS = 50  # label sets shown one by one; the rest are summed under "(other)"
NO_LABELS = "(none)"
OTHER = "(other)"


def runner_samples(runners: Iterable[Mapping[str, Any]], hosts: Iterable[str]
                   ) -> list[metrics.Sample]:
    """Runners by (host, state): every state of every host, zeros included."""
    counts: dict[tuple[str, str], int] = defaultdict(int)
    every_host = set(hosts)
    for runner in runners:
        host = str(runner.get("host") or "")
        state = runner.get("state")
        every_host.add(host)
        counts[host, state if state in RUNNER_STATES else "unknown"] += 1
    states = [*RUNNER_STATES, *(["unknown"] if any(s == "unknown" for _, s in counts) else [])]
    return [((host, state), counts.get((host, state), 0))
            for host in sorted(every_host) for state in states]


def label_set(labels: Any) -> str:
    """A job's runs-on labels as one label value: lower case (GitHub matches them so), sorted,
    comma-separated; "(none)" when it names none."""
    if not isinstance(labels, list):
        return NO_LABELS
    names = sorted({str(label).lower() for label in labels})
    return ",".join(names) or NO_LABELS


def _queued_since(job: Mapping[str, Any], run: Mapping[str, Any]) -> float | None:
    for when in (job.get("created_at"), run.get("created_at")):
        if isinstance(when, str) and when:
            try:
                return parse_iso(when)
            except ValueError:
                continue
    return None


def queue_by_labels(runs: Iterable[Mapping[str, Any]], now: float
                    ) -> dict[str, tuple[int, float | None]]:
    """Queued jobs of the runs the snapshot holds, by label set: (how many, the oldest one's
    wait in seconds, None when no time was given). Past MAX_LABEL_SETS, the label sets with
    the fewest jobs are summed under "(other)"."""
    found: dict[str, tuple[int, float | None]] = {}
    for run in runs:
        for job in run.get("jobs") or []:
            if job.get("status") not in QUEUED_JOB:
                continue
            key = label_set(job.get("labels"))
            since = _queued_since(job, run)
            wait = max(0.0, now - since) if since is not None else None
            count, oldest = found.get(key, (0, None))
            found[key] = (count + 1, _older(oldest, wait))
    if len(found) <= MAX_LABEL_SETS:
        return found
    ranked = sorted(found.items(), key=lambda item: (-item[1][0], item[0]))
    kept = dict(ranked[:MAX_LABEL_SETS - 1])
    rest = [figures for _, figures in ranked[MAX_LABEL_SETS - 1:]]
    longest: float | None = None
    for _, wait in rest:
        longest = _older(longest, wait)
    kept[OTHER] = (sum(count for count, _ in rest), longest)
    return kept


def _older(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else max(a, b)


def rate_samples(rate: Mapping[str, Any], key: str) -> list[metrics.Sample]:
    value = rate.get(key)
    return [((), value)] if isinstance(value, int) and rate.get("limit") else []


def reset_samples(rate: Mapping[str, Any]) -> list[metrics.Sample]:
    when = rate.get("reset_at")
    if not isinstance(when, str) or not rate.get("limit"):
        return []
    try:
        return [((), parse_iso(when))]
    except ValueError:
        return []


class ControlPlaneMetrics:
    """The control plane's registry, reading the daemon's parts at each scrape."""

    def __init__(self, snapshot: Callable[[], Mapping[str, Any]], github: GitHub, hosts: Hosts,
                 hub: EventHub, stale_after_s: Callable[[], float],
                 clock: Callable[[], float], started_at: float) -> None:
        self.snapshot = snapshot
        self.clock = clock
        self.registry = metrics.Registry()
        self._runners(self.registry)
        self._github(self.registry, github)
        self._federation(self.registry, hosts, stale_after_s)
        self.registry.gauge("fleet_controlplane_stream_clients",
                            "Clients of the live snapshot stream (GET /api/stream).",
                            read=lambda: [((), hub.clients)])
        metrics.add_process(self.registry, started_at)

    def _runners(self, r: metrics.Registry) -> None:
        def runners() -> list[metrics.Sample]:
            snap = self.snapshot()
            here = (snap.get("host") or {}).get("name")
            return runner_samples(snap.get("runners") or [], [here] if here else [])

        def queue() -> dict[str, tuple[int, float | None]]:
            return queue_by_labels(self.snapshot().get("active_runs") or [], self.clock())

        r.gauge("fleet_controlplane_runners", "Runners by host and state (this host's and "
                "those its agent hosts last reported).", ["host", "state"], read=runners)
        r.gauge("fleet_controlplane_queued_jobs", "Jobs of queued runs waiting for a runner, by "
                "the labels they ask for.", ["labels"],
                read=lambda: [((key,), count) for key, (count, _) in sorted(queue().items())])
        r.gauge("fleet_controlplane_queue_wait_seconds", "How long the oldest queued job of "
                "each label set has waited.", ["labels"],
                read=lambda: [((key,), wait) for key, (_, wait) in sorted(queue().items())
                              if wait is not None])

    def _github(self, r: metrics.Registry, github: GitHub) -> None:
        r.counter("fleet_controlplane_github_requests_total",
                  "Requests to GitHub's API by the class of their answer (2xx, 3xx: a 304 "
                  "that cost no rate limit, 4xx, 5xx), or unreachable.", ["status_class"],
                  read=lambda: [((k,), n) for k, n in sorted(github.answers.items())])
        r.gauge("fleet_controlplane_github_rate_limit_remaining",
                "Requests left in GitHub's rate-limit window (its last answer's header).",
                read=lambda: rate_samples(github.rate, "remaining"))
        r.gauge("fleet_controlplane_github_rate_limit",
                "Requests allowed in GitHub's rate-limit window.",
                read=lambda: rate_samples(github.rate, "limit"))
        r.gauge("fleet_controlplane_github_rate_limit_reset_timestamp_seconds",
                "When GitHub's rate-limit window starts again (Unix epoch).",
                read=lambda: reset_samples(github.rate))

    def _federation(self, r: metrics.Registry, hosts: Hosts,
                    stale_after_s: Callable[[], float]) -> None:
        r.gauge("fleet_controlplane_members", "Agent hosts that have called this coordinator in "
                "(in the last 7 days).", read=lambda: [((), len(hosts.received))])
        r.gauge("fleet_controlplane_member_heartbeat_age_seconds",
                "Seconds since each agent host's last heartbeat.", ["host"],
                read=lambda: [((host,), hosts.age(host)) for host in sorted(hosts.received)])
        r.gauge("fleet_controlplane_member_stale_after_seconds",
                "Heartbeat age past which an agent host counts as stale (stale_after_s).",
                read=lambda: [((), stale_after_s())])

    def render(self) -> str:
        return self.registry.render()
