"""The cluster's shared state, in NATS JetStream key-value buckets: one module per bucket.

    deployments.py   shoal_models    model name -> ModelSpec (what is deployed)
    workers.py       shoal_workers   worker + model -> WorkerStatus (expires when a worker dies)
    profiles.py      shoal_profiles  model + runtime + hardware -> BatchProfile (tuned budgets)
    fleet.py         (a read model)  the deployments with who holds each, for `shoal models`

Nothing outside this package reads or writes those buckets.
"""
