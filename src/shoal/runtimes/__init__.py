"""Runtimes: one module per runtime behind the small interfaces of `runtimes/base.py`.

What each runtime can do, and how to load it, is its record in `runtimes/registry.py`.
Runtimes import nothing from the queue layer (broker, worker, gateway): they know models.
"""
