"""Shoal: a pull-based serving cluster for fleets of small models."""

__version__ = "0.1.0"
