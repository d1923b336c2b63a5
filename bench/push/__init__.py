"""Push baselines, built only to be measured against Shoal: a router pushing requests at workers.

Same runtime (shoal.runtimes.load_runtime), same request handling (EmbeddingsHandler), same
worker-local batching and the same busy accounting (BusyMeter, WorkerMetrics) as Shoal's
workers; only the scheduling differs. Not part of Shoal.
"""
