"""The CI runner control plane: supervises one host's self-hosted runners and serves their API.

Where things are (docs/architecture.md walks through them):

- state.py       the plane: what the daemon holds (config, database, live settings, tokens,
                 runners, GitHub data, agents' reports, the snapshot, when each round is due)
- snapshot.py    the snapshot and its tick; live.py changing a live setting
- runners/       this host's runners: discovery, their services, the host's vitals, their logs
                 and bundles, and the actions on them
- github/        what GitHub says: the client, the refresh, the job history, workflow files
- analysis/      figures from the snapshot and the history (pure modules) and the features
                 that serve them: reports, forecasts, autoscale, the analysis round
- federation/    several hosts: the coordinator's record of its agents, an agent's link
- http/          the app and, per feature, its routes, loops and hooks; nothing imports it
                 but cli.py
- store.py, loops.py, tokens.py, settings.py, telemetry.py, cli.py: shared tables, loop
  pacing, token files, the settings tables, metrics, the command line
"""
