"""What the tests share: real collector and control-plane processes, fake hosts and tools that
are themselves real (an HTTP server, executables on PATH), spec builders and small clients.

Every test folder imports from here and never from another folder's test or conftest module.
Modules:
- collector: collector processes, a tiny HTTP client, job/registration/row builders, free ports
- controlplane: a fake runner host (Host), the daemon as a process (Daemon), `until`
- cp_fakes, fake_github, history_gen, cp_fixtures: the control plane's fake host, GitHub API,
  generated job history and a populated host
- agent: the agent file, fake tools on PATH, small HTTP helpers
- faults: the fault suite's lean agent, producer, ledger and invariants; tmpfs mounts
- live: seeded services shared by the contract suite; slow-client probes
- browser: Chromium for Playwright, page watching, screenshots
- stream: a live-stream (SSE) reader
- raw_http: requests written byte by byte on a socket
- web_seed: a collector filled with realistic data
- metrics: GET /metrics read with prometheus_client's parser of the text format
"""
