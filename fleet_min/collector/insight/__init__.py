"""Insight: pipeline topics, shaped result views, what the collector holds on disk and its
retention, and the metrics."""
