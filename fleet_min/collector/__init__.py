"""The device job collector: queue, registry, results, artifacts, scheduler, alerts, stream.

Where things are (docs/architecture.md walks through them, with the path of a job):

- service.py     the running collector: database, dispatcher, event hub, transact
- http/          create_app and the route table, one module per feature (the only room that
                 imports aiohttp.web)
- jobs/          the job's path: kinds, specs, rules, queue, claims, dispatch, devices,
                 authority, results, views
- automation/    schedules, alerts, webhook
- access/        guard, mesh, peers, mdns, ci_status
- insight/       topics, result views, system and retention, telemetry
- artifacts/     the content-addressed store
- storage/       schema and backup
"""
