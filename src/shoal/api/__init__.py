"""The public API: OpenAI-shaped request and response types, their parse and encode.

One module per endpoint family, plus the error body. Nothing here knows NATS or a runtime's
internals; the gateway imports only what it needs (errors, models, admin), the worker decodes
and encodes bodies with the rest.
"""
