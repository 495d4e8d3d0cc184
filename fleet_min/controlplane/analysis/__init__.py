"""Figures drawn from the snapshot and the job history. Pure modules compute them (analytics,
queue_causes, capacity, drift, workflows, simulate, forecast, autoscale, stats); the features
that gather their inputs and keep their results are reports, forecaster, autoscaler, rounds,
admission and billing."""
