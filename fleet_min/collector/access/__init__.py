"""Access: the dashboard guard, the mesh allowlist, peers (other collectors), mDNS advertising and
the commit statuses posted for CI jobs."""
