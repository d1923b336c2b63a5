"""Metrics (Prometheus text) for the gateway and the worker."""
