"""The device job collector: queue, registry, results, artifacts, scheduler, alerts, stream."""
