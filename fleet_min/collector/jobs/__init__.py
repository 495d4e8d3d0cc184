"""The job's path, from a spec to its result: the closed sets of names (kinds), spec checks
(specs, compat, match, templates), the pure rules, the queue (enqueue, leases, closing), claims,
the dispatcher that holds waiting polls, devices and executors, who may act for what
(authority), result rows and beacons, and the read-side listings (views). The one room the
others build on: it imports none of them."""
