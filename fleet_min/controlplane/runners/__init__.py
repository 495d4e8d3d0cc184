"""This host's runners: finding them (discovery, procs), their services (supervisor, commands),
the host they run on (vitals), their logs and bundles (diag, bundle, redact, detail), and the
actions on them (actions)."""
