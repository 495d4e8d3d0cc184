"""fleet_min: a job collector for a shelf of devices and a control plane for CI runners."""

__version__ = "0.1.0"
