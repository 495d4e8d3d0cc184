"""The job's path, from a spec to its result: spec checks (specs, compat, match, templates), the
pure rules, the queue (enqueue, claims, leases, closing), the dispatcher that holds waiting polls,
devices and executors, who may act for what (authority), result rows and beacons, and the
read-side listings (views)."""
