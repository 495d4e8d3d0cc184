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
    """,
]
