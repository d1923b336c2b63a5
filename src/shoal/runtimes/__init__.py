"""Runtimes behind one interface (`EmbeddingRuntime`). They import nothing from the queue layer.

`load_runtime` imports a runtime's module only when it is used: torch takes seconds to import
and a `sim` worker must not pay for it.
"""

from __future__ import annotations

from shoal.protocol import ModelSpec
from shoal.runtimes.base import EmbeddingRuntime, EmbedOutput

RUNTIMES = ("torch", "sim")


def load_runtime(spec: ModelSpec) -> EmbeddingRuntime:
    """Load the model a spec names on the runtime it names."""
    if spec.runtime == "sim":
        from shoal.runtimes.sim import SimEmbeddingRuntime

        return SimEmbeddingRuntime(spec.name, spec.options)
    if spec.runtime == "torch":
        from shoal.runtimes.torch_st import TorchEmbeddingRuntime

        return TorchEmbeddingRuntime(spec.name, spec.source, spec.options)
    raise ValueError(f"unknown runtime {spec.runtime!r}; known: {', '.join(RUNTIMES)}")


__all__ = ["RUNTIMES", "EmbedOutput", "EmbeddingRuntime", "load_runtime"]
