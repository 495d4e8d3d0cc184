"""The collector's SQLite schema as an append-only list of migrations (PRAGMA user_version).

Never edit a migration that has shipped; append a new one. Times are float epoch seconds (UTC);
the API turns them into ISO-8601 with Z.
"""

from __future__ import annotations

MIGRATIONS: list[str] = [
    # 1: the queue, the registry, results, beacons
    """
    CREATE TABLE meta (
        key TEXT PRIMARY KEY,
        value TEXT NOT NULL
    );

    CREATE TABLE devices (
        device_id TEXT PRIMARY KEY,
        descriptor TEXT NOT NULL DEFAULT '{}',
        platform TEXT,
        kind TEXT,
        pools TEXT NOT NULL DEFAULT '[]',
        pools_override TEXT,
        capabilities TEXT,                 -- JSON array; NULL = no opinion (offered everything)
        ttl_s INTEGER,                     -- NULL = shelf device; else temporary
        name TEXT,
        notes TEXT,
        first_seen REAL NOT NULL,
        last_seen REAL NOT NULL,
        registered_at REAL NOT NULL,
        last_beacon TEXT,                  -- JSON of the last beacon's fields
        last_beacon_at REAL,
        busy_job_id TEXT,                  -- a claim held with another collector
        busy_collector TEXT,
        busy_at REAL,
        address TEXT
    );
    CREATE INDEX devices_last_seen ON devices(last_seen DESC);

    CREATE TABLE jobs (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,   -- creation order, finer than any clock
        job_id TEXT NOT NULL UNIQUE,
        workload TEXT NOT NULL,
        executor TEXT NOT NULL,
        backend TEXT,
        status TEXT NOT NULL,
        priority INTEGER NOT NULL DEFAULT 0,
        pin TEXT NOT NULL DEFAULT '',            -- targets.device_id / targets.executor
        target_device TEXT,                      -- targets.device_id, for either executor
        pool TEXT,
        match TEXT,
        exclusive INTEGER NOT NULL DEFAULT 0,
        preemptible INTEGER NOT NULL DEFAULT 0,
        is_group INTEGER NOT NULL DEFAULT 0,     -- a fan-out parent: never claimed itself
        claimed_by TEXT,
        attempts INTEGER NOT NULL DEFAULT 0,
        max_attempts INTEGER NOT NULL,
        ttl_s INTEGER NOT NULL,
        lease_deadline REAL,
        last_error TEXT,
        parent_job_id TEXT,
        template_id TEXT,
        spec TEXT NOT NULL,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        claimed_at REAL,
        finished_at REAL
    );
    CREATE INDEX jobs_claim_any ON jobs(executor, pin, priority DESC, seq)
        WHERE status = 'queued' AND is_group = 0;
    CREATE INDEX jobs_claim_workload ON jobs(executor, pin, workload, priority DESC, seq)
        WHERE status = 'queued' AND is_group = 0;
    CREATE INDEX jobs_claimed ON jobs(claimed_by) WHERE status = 'claimed';
    CREATE INDEX jobs_lease ON jobs(lease_deadline) WHERE status = 'claimed';
    CREATE INDEX jobs_claimed_target ON jobs(target_device) WHERE status = 'claimed';
    CREATE INDEX jobs_status_seq ON jobs(status, seq);
    CREATE INDEX jobs_parent ON jobs(parent_job_id) WHERE parent_job_id IS NOT NULL;
    CREATE INDEX jobs_template ON jobs(template_id) WHERE template_id IS NOT NULL;
    CREATE INDEX jobs_created ON jobs(created_at);
    CREATE INDEX jobs_finished ON jobs(status, finished_at) WHERE finished_at IS NOT NULL;

    CREATE TABLE job_deps (
        job_id TEXT NOT NULL,
        depends_on TEXT NOT NULL,
        PRIMARY KEY (job_id, depends_on)
    ) WITHOUT ROWID;
    CREATE INDEX job_deps_reverse ON job_deps(depends_on, job_id);

    CREATE TABLE job_attempts (
        id INTEGER PRIMARY KEY,
        job_id TEXT NOT NULL,
        attempt INTEGER NOT NULL,
        claimed_by TEXT NOT NULL,
        claimed_at REAL NOT NULL,
        ended_at REAL,
        outcome TEXT,                      -- done, failed, released, preempted, expired, cancelled
        error TEXT
    );
    CREATE INDEX job_attempts_job ON job_attempts(job_id, attempt);

    CREATE TABLE device_locks (
        device_id TEXT PRIMARY KEY,
        job_id TEXT NOT NULL,
        locked_at REAL NOT NULL
    );

    CREATE TABLE results (
        id INTEGER PRIMARY KEY,
        job_id TEXT NOT NULL,
        device_id TEXT NOT NULL,
        iter INTEGER NOT NULL,
        workload TEXT,
        ok INTEGER,
        final INTEGER NOT NULL DEFAULT 0,
        preempted INTEGER NOT NULL DEFAULT 0,
        error TEXT,
        metrics TEXT NOT NULL DEFAULT '{}',
        artifacts TEXT NOT NULL DEFAULT '[]',
        device TEXT,
        extra TEXT,                        -- other top-level fields the agent sent, kept as JSON
        created_at REAL NOT NULL,
        UNIQUE (job_id, device_id, iter)
    );
    CREATE INDEX results_device ON results(device_id, created_at);
    CREATE INDEX results_workload ON results(workload, created_at);
    CREATE INDEX results_created ON results(created_at);

    CREATE TABLE beacons (
        id INTEGER PRIMARY KEY,
        device_id TEXT NOT NULL,
        job_id TEXT,
        at REAL NOT NULL,
        body TEXT NOT NULL
    );
    CREATE INDEX beacons_device_at ON beacons(device_id, at);
    CREATE INDEX beacons_at ON beacons(at);

    CREATE TABLE artifacts (
        sha256 TEXT PRIMARY KEY,
        size INTEGER NOT NULL,
        created_at REAL NOT NULL,
        name TEXT,
        app TEXT,
        build TEXT,
        platform TEXT,
        pinned_reason TEXT,
        baseline INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX artifacts_app ON artifacts(app, created_at) WHERE app IS NOT NULL;

    CREATE TABLE schedules (
        id TEXT PRIMARY KEY,
        cron TEXT NOT NULL,
        enabled INTEGER NOT NULL DEFAULT 0,      -- new schedules arrive disabled
        template TEXT NOT NULL,                  -- JSON job spec without job_id
        last_run REAL,
        last_slot TEXT,                          -- YYYYMMDDHHMM of the last due minute handled
        next_run REAL,
        last_skip TEXT,                          -- why the last due run did not enqueue
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );

    CREATE TABLE schedule_runs (
        id INTEGER PRIMARY KEY,
        schedule_id TEXT NOT NULL,
        slot TEXT NOT NULL,                      -- the due minute, or 'manual-<time>'
        at REAL NOT NULL,
        job_id TEXT,
        outcome TEXT NOT NULL,                   -- enqueued, skipped, failed
        detail TEXT,
        UNIQUE (schedule_id, slot)
    );
    CREATE INDEX schedule_runs_history ON schedule_runs(schedule_id, id);

    CREATE TABLE alerts (
        id INTEGER PRIMARY KEY,
        rule TEXT NOT NULL,
        subject TEXT NOT NULL,
        state TEXT NOT NULL,                     -- open, resolved
        seen_count INTEGER NOT NULL DEFAULT 1,
        first_seen REAL NOT NULL,
        last_seen REAL NOT NULL,
        resolved_at REAL,
        acked_at REAL,
        snoozed_until REAL,
        detail TEXT,
        webhook_state TEXT,                      -- NULL (none), pending, delivered, failed
        webhook_attempts INTEGER NOT NULL DEFAULT 0
    );
    CREATE UNIQUE INDEX alerts_open ON alerts(rule, subject) WHERE state = 'open';
    CREATE INDEX alerts_last_seen ON alerts(last_seen);
    CREATE INDEX alerts_rule_subject ON alerts(rule, subject, id);

    CREATE TABLE topic_events (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        topic TEXT NOT NULL,
        payload TEXT NOT NULL,
        source TEXT,
        at REAL NOT NULL
    );
    CREATE INDEX topic_events_topic ON topic_events(topic, seq);
    CREATE INDEX topic_events_at ON topic_events(at);

    CREATE TABLE ci_statuses (
        id INTEGER PRIMARY KEY,
        job_id TEXT NOT NULL,
        target TEXT NOT NULL,                    -- owner/repo@sha
        state TEXT NOT NULL,                     -- pending, success, failure, error
        description TEXT,
        at REAL NOT NULL,
        dry_run INTEGER NOT NULL,
        http_status INTEGER,
        error TEXT
    );
    CREATE INDEX ci_statuses_job ON ci_statuses(job_id, id);
    """,
    # 2: a job knows whether another waits on it, so closing one nobody waits on (nearly every
    # job) skips the look through job_deps for waiters to promote or fail
    """
    ALTER TABLE jobs ADD COLUMN has_dependents INTEGER NOT NULL DEFAULT 0;
    UPDATE jobs SET has_dependents = 1 WHERE job_id IN (SELECT depends_on FROM job_deps);
    """,
    # 3: a job's attempts are found by the job's seq, not its id. Job ids are the clients' own
    # strings, so each new attempt's entry in an index on them lands on a page of its own (one
    # more page to write a job); seq only grows, so entries keyed on it land beside the last.
    """
    ALTER TABLE job_attempts ADD COLUMN job_seq INTEGER;
    UPDATE job_attempts
       SET job_seq = (SELECT seq FROM jobs WHERE jobs.job_id = job_attempts.job_id);
    CREATE INDEX job_attempts_seq ON job_attempts(job_seq, attempt);
    DROP INDEX job_attempts_job;
    """,
    # 4: who may speak for a device or an executor name from the mesh network (FLEET_MESH_ALLOW
    # on). A device remembers the mesh node that registered it; an executor name is bound to the
    # mesh node that first used it, until that node has been silent for a while (see
    # fleet_min/collector/jobs/authority.py). NULL / no row: not bound, any listed node may speak.
    """
    ALTER TABLE devices ADD COLUMN mesh_node TEXT;
    CREATE TABLE executor_nodes (
        name TEXT PRIMARY KEY,
        mesh_node TEXT NOT NULL,
        bound_at REAL NOT NULL,
        seen_at REAL NOT NULL
    );
    """,
    # 5: GET /metrics counts jobs by status and workload at every scrape. Without this index
    # that read walked jobs_status_seq and looked each row up in the table, then sorted in a
    # temporary B-tree: 215 ms for 200,000 jobs, measured; through this one, which covers it in
    # the GROUP BY's own order, 13 ms. It costs a job's three status changes about 2 us.
    """
    CREATE INDEX jobs_status_workload ON jobs(status, workload) WHERE is_group = 0;
    """,
    # 6: result rows belong to an attempt of their job (the attempt number the claim handed
    # out), and are idempotent by (job_id, device_id, iter, attempt): a late row of a lapsed
    # attempt no longer takes the key the next attempt reports under. SQLite cannot change a
    # UNIQUE constraint, so the table is rebuilt (create, copy, drop, rename, indexes). Rows
    # stored before get the attempt of their poster claimed last before the row was stored,
    # else any attempt claimed before it, else the job's attempt count (else 1). Self-contained:
    # it reads job_attempts and jobs as migrations 1 and 3 left them.
    """
    CREATE TABLE results_by_attempt (
        id INTEGER PRIMARY KEY,
        job_id TEXT NOT NULL,
        device_id TEXT NOT NULL,
        iter INTEGER NOT NULL,
        attempt INTEGER NOT NULL,          -- the job's attempt the row reports for
        workload TEXT,
        ok INTEGER,
        final INTEGER NOT NULL DEFAULT 0,
        preempted INTEGER NOT NULL DEFAULT 0,
        error TEXT,
        metrics TEXT NOT NULL DEFAULT '{}',
        artifacts TEXT NOT NULL DEFAULT '[]',
        device TEXT,
        extra TEXT,                        -- other top-level fields the agent sent, kept as JSON
        created_at REAL NOT NULL,
        UNIQUE (job_id, device_id, iter, attempt)
    );
    INSERT INTO results_by_attempt (id, job_id, device_id, iter, attempt, workload, ok, final,
                                    preempted, error, metrics, artifacts, device, extra,
                                    created_at)
    SELECT r.id, r.job_id, r.device_id, r.iter,
           COALESCE(
               (SELECT a.attempt FROM jobs j JOIN job_attempts a ON a.job_seq = j.seq
                WHERE j.job_id = r.job_id AND a.claimed_at <= r.created_at
                  AND a.claimed_by IN (r.device_id,
                                       CASE WHEN json_valid(r.extra)
                                            THEN json_extract(r.extra, '$.executor') END)
                ORDER BY a.claimed_at DESC, a.id DESC LIMIT 1),
               (SELECT a.attempt FROM jobs j JOIN job_attempts a ON a.job_seq = j.seq
                WHERE j.job_id = r.job_id AND a.claimed_at <= r.created_at
                ORDER BY a.claimed_at DESC, a.id DESC LIMIT 1),
               (SELECT MAX(j.attempts, 1) FROM jobs j WHERE j.job_id = r.job_id),
               1),
           r.workload, r.ok, r.final, r.preempted, r.error, r.metrics, r.artifacts, r.device,
           r.extra, r.created_at
    FROM results r;
    DROP TABLE results;
    ALTER TABLE results_by_attempt RENAME TO results;
    CREATE INDEX results_device ON results(device_id, created_at);
    CREATE INDEX results_workload ON results(workload, created_at);
    CREATE INDEX results_created ON results(created_at);
    """,
    # 7: one claimed job per claimant, build toolchains, host fan-out and param warnings.
    # - jobs.variant: what a capability pairing names, the backend (benchmark:jssha) or a build
    #   job's toolchain (build:gradle, params.kind), with a claim index of its own, so a claimant
    #   that declared only pairings reads only the jobs of its pairings;
    # - jobs.warnings: params the spec's table does not name for the workload (JSON list);
    # - executors: each host executor's name and last poll, for fan-out over executors.
    """
    ALTER TABLE jobs ADD COLUMN variant TEXT;
    ALTER TABLE jobs ADD COLUMN warnings TEXT;
    UPDATE jobs SET variant = CASE
        WHEN workload = 'build' AND json_type(spec, '$.params.kind') = 'text'
        THEN json_extract(spec, '$.params.kind') ELSE backend END;
    CREATE INDEX jobs_claim_variant ON jobs(executor, pin, workload, variant, priority DESC, seq)
        WHERE status = 'queued' AND is_group = 0;
    CREATE TABLE executors (
        name TEXT PRIMARY KEY,
        first_seen REAL NOT NULL,
        last_poll REAL NOT NULL,
        slots INTEGER NOT NULL DEFAULT 1        -- jobs it may hold at once (?slots= on its poll)
    );
    """,
    # 8: job templates, the enqueue form's saved specs (automation/job_templates.py).
    """
    CREATE TABLE job_templates (
        id TEXT PRIMARY KEY,
        name TEXT,
        spec TEXT NOT NULL,                     -- a job spec without job_id, neutral form
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    """,
    # 9: visual review. A baseline is a pointer from a (suite, page, profile) slot to an
    # artifact (which keeps artifacts.baseline = 1 while a slot points at it, so GC spares it);
    # visual_diffs caches the comparison of a capture with a baseline, computed on first view.
    """
    CREATE TABLE visual_baselines (
        suite TEXT NOT NULL,
        page TEXT NOT NULL,
        profile TEXT NOT NULL,
        sha256 TEXT NOT NULL,
        accepted_at REAL NOT NULL,
        accepted_from_job TEXT,
        PRIMARY KEY (suite, page, profile)
    );
    CREATE INDEX visual_baselines_sha ON visual_baselines(sha256);
    CREATE TABLE visual_diffs (
        baseline TEXT NOT NULL,
        capture TEXT NOT NULL,
        diff_pct REAL,                          -- null when they could not be compared
        width INTEGER,
        height INTEGER,
        error TEXT,                             -- why not, a sentence
        computed_at REAL NOT NULL,
        PRIMARY KEY (baseline, capture)
    );
    """,
    # 10: host executors declare what they run, and their attached devices can be locked.
    # - executors is rebuilt (SQLite cannot drop NOT NULL) so an executor that registered
    #   (POST /executors/register) before it ever polled has a row: last_poll NULL until it
    #   does; capabilities (JSON, NULL = no opinion: offered every host job), agent (what it
    #   runs) and registered_at (its last registration);
    # - device_locks by job: a job's locks are released when it closes, goes back or lapses;
    # - a ui-test job's variant is its suite kind (ui-test:flow_runner), as executors declare it.
    """
    CREATE TABLE executors_v10 (
        name TEXT PRIMARY KEY,
        first_seen REAL NOT NULL,
        last_poll REAL,                         -- NULL: registered, never polled
        slots INTEGER NOT NULL DEFAULT 1,       -- the last ?slots= or registration's slots
        capabilities TEXT,                      -- JSON array; NULL = no opinion
        agent TEXT,                             -- e.g. "fleet_agent 0.1.0"
        registered_at REAL                      -- NULL: never registered
    );
    INSERT INTO executors_v10 (name, first_seen, last_poll, slots)
        SELECT name, first_seen, last_poll, slots FROM executors;
    DROP TABLE executors;
    ALTER TABLE executors_v10 RENAME TO executors;
    CREATE INDEX device_locks_job ON device_locks(job_id);
    UPDATE jobs SET variant = json_extract(spec, '$.suite.kind')
        WHERE workload = 'ui-test' AND variant IS NULL
          AND json_type(spec, '$.suite.kind') = 'text';
    """,
    # 11: a burst of new alerts is posted to the webhook as one summary past a few a minute
    # (automation/alerts.py): the summary's counts ride on the pending row that carries it
    # (JSON), and the rows it stands for are webhook_state 'folded'.
    """
    ALTER TABLE alerts ADD COLUMN webhook_summary TEXT;
    """,
    # 12: a fan-out parent's open children, found without walking its closed ones. Closing a
    # child asks whether any other is still open (queue._settle_group); through jobs_parent that
    # read every child closed before it, so cancelling a parent of 6,000 children held the
    # event loop 3 s (the cost grew with the square of the children). Jobs of no fan-out, nearly
    # all of them, have no entry.
    """
    CREATE INDEX jobs_parent_open ON jobs(parent_job_id)
        WHERE parent_job_id IS NOT NULL AND status IN ('queued', 'waiting', 'claimed');
    """,
    # 13: the reads of every device's times answered from an index, not the rows. A row's
    # times come after its descriptor, pools and capabilities (57 KB at the registration's
    # limits), so reading them for every device read 1.4 GB of a full registry's pages: each
    # metrics scrape (0.12 s warm, seconds cold, on the shared reader), each overview and
    # listing's count of expired devices, and, with no index for it, each registration refused
    # at the registry's bound (40 to 55 ms of the writer's time each, asked by anyone). The
    # index by last_seen carries the other times and the id (it moves at every beacon already);
    # the temporary devices are kept in the order they leave the shelf.
    """
    DROP INDEX devices_last_seen;
    CREATE INDEX devices_seen ON devices(last_seen DESC, ttl_s, last_beacon_at, device_id);
    CREATE INDEX devices_leaving ON devices(last_seen + ttl_s) WHERE ttl_s IS NOT NULL;
    """,
]
