"""Everything about a job spec that can be checked without the database, in one place: used by
POST /jobs, POST /api/jobs/preview-targets and schedule templates alike. A spec that passes comes
back as a JobSpec, the shape the queue reads (fleet_min/schemas/job.json, which refuses any other
top-level field)."""

from __future__ import annotations

from typing import Any, Required, TypedDict, cast

from fleet_min import validate
from fleet_min.collector.jobs import compat, executors
from fleet_min.collector.jobs.kinds import Executor
from fleet_min.collector.jobs.match import MatchError, compiled
from fleet_min.errors import BadRequest


class Targets(TypedDict, total=False):
    match: str        # a match expression (fleet_min.collector.jobs.match)
    device_id: str    # the device it runs on (or a host job drives)
    executor: str     # the host executor it runs on
    pool: str
    exclusive: bool   # nothing else runs on the device meanwhile
    url: str
    device_kind: str


class Lease(TypedDict, total=False):
    ttl_s: int
    max_attempts: int


class Distinct(TypedDict):
    distinct: str  # one child per distinct value of this device field


class JobSpec(TypedDict, total=False):
    """A job spec that passed check_spec, in the neutral form (compat)."""

    schema: Required[int]
    job_id: Required[str]
    workload: Required[str]
    executor: Required[str]  # an Executor
    backend: str
    model: dict[str, Any]
    params: dict[str, Any]
    targets: Targets
    constraints: dict[str, Any]  # read by rules.constraint_refusal
    lease: Lease
    depends_on: list[str]
    fanout: bool | Distinct
    preemptible: bool
    app: dict[str, Any]
    suite: dict[str, Any]
    report_to: dict[str, str]
    priority: int


def first_problem(errors: list[str]) -> str:
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return errors[0] + more


def check_spec(spec: Any, context: str = "") -> JobSpec:
    """Refuse (400) a spec that holds a secret, is malformed (an unknown top-level field
    included), has an unsafe match expression or references a job outside its depends_on.
    `context` prefixes the messages ("template: "). Returns the spec in the neutral form (the
    aliases of the clients in the field replaced: see compat)."""
    if not isinstance(spec, dict):
        raise BadRequest(f"{context}a job spec must be a JSON object")
    # Secrets first: a top-level "password" is a secret before it is an unknown field.
    secret_key, templated = validate.scan_keys_and_strings(spec)
    secrets = validate.find_secret_keys(spec) if secret_key else []
    if secrets:
        raise BadRequest(f"{context}{secrets[0]} looks like a secret; a job spec names a "
                         "credential for the agent to read locally and never carries one")
    errors = validate.validate_job(spec)
    if errors:
        raise BadRequest(context + first_problem(errors))
    if spec["executor"] == Executor.HOST and isinstance(spec.get("fanout"), dict):
        raise BadRequest(f"{context}fanout {{distinct}} applies to device jobs: host executors "
                         "do not report the devices attached to them; use \"fanout\": true "
                         "for one child per executor")
    targets = spec.get("targets") or {}
    wanted = targets.get("executor")
    if wanted:  # an empty one means any executor, as leaving it out does
        try:
            executors.check_name(wanted)
        except BadRequest as exc:
            # A name no executor may register under pins a job no executor can take.
            raise BadRequest(f"{context}targets.executor: {exc.message}") from None
    match = targets.get("match")
    if match:
        try:
            compiled(match)
        except MatchError as exc:
            raise BadRequest(f"{context}targets.match: {exc}") from None
    allowed = set(spec.get("depends_on") or [])
    for job_id, _kind, _key in validate.find_template_refs(spec) if templated else ():
        if job_id not in allowed:
            raise BadRequest(f"{context}a template reference names job {job_id}, which is not "
                             "in depends_on; a reference may only name a listed dependency")
    try:
        return cast(JobSpec, compat.neutral_spec(spec))  # the schema's shape, checked above
    except BadRequest as exc:
        raise BadRequest(context + exc.message) from None
