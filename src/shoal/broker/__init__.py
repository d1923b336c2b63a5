"""The queue layer: the embedded nats-server, JetStream streams, consumers, KV and pulling.

Nothing here knows about models or runtimes.
"""
