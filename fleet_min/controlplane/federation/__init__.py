"""Several hosts, one coordinator: hosts (the coordinator's record of its agents and their
ordered command queues), coordinator (serving heartbeats, results and the hosts list) and link
(an agent's link to its coordinator)."""
