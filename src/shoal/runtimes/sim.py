"""`sim`: a SIMULATED accelerator, for scheduling experiments and fast tests. No model runs.

Cost model (documented in docs/architecture.md): a batch of texts with T tokens in all takes

    batch_ms / 1000  +  token_us / 1e6 * T      seconds,

spent sleeping (not burning CPU), so many simulated workers fit on a small machine while the
batch economics look like a GPU's: a fixed cost per batch that dominates small batches.
A text's tokens are estimated as ceil(utf8 bytes / 4) + 2. Vectors are deterministic
pseudo-embeddings: unit vectors seeded by a hash of the text.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import numpy as np

from shoal.runtimes.base import EmbedOutput


def simulated_token_count(text: str) -> int:
    return -(-len(text.encode()) // 4) + 2


def pseudo_embedding(text: str, dimensions: int) -> np.ndarray:
    """The vector the sim runtime returns for `text`: tests compare against it."""
    seed = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
    vector = np.random.default_rng(seed).standard_normal(dimensions).astype(np.float32)
    return vector / np.linalg.norm(vector)


class SimEmbeddingRuntime:
    """A simulated embedding accelerator following the cost model above."""

    simulated = True

    def __init__(self, name: str, options: dict[str, Any]) -> None:
        self.name = name
        self.batch_seconds = float(options.get("batch_ms", 2.0)) / 1000
        self.token_seconds = float(options.get("token_us", 20.0)) / 1e6
        self.dimensions = int(options.get("dimensions", 384))

    def batch_cost_seconds(self, token_counts: list[int]) -> float:
        return self.batch_seconds + self.token_seconds * sum(token_counts)

    def embed(self, texts: list[str], adapters: list[str | None] | None = None) -> EmbedOutput:
        if adapters and any(adapters):
            raise ValueError("the simulated runtime has no LoRA adapters")
        token_counts = [simulated_token_count(t) for t in texts]
        started = time.perf_counter()
        vectors = np.stack([pseudo_embedding(t, self.dimensions) for t in texts])
        remaining = self.batch_cost_seconds(token_counts) - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)
        return EmbedOutput(vectors, token_counts)

    def close(self) -> None:
        pass
