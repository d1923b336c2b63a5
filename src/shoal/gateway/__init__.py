"""The gateway: OpenAI-compatible HTTP in front of the work queue. It never picks a worker."""
