"""The worker sidecar: pulls work for one model, forms batches, runs them on a runtime."""
