"""The interface every runtime implements. A runtime knows models, not queues."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True, slots=True)
class EmbedOutput:
    """Vectors for a list of texts, row i for text i, and the tokens each text used."""

    vectors: np.ndarray  # float32, shape (len(texts), dimensions)
    token_counts: list[int]


class EmbeddingRuntime(Protocol):
    """A loaded embedding model. `embed` is called from one executor thread at a time."""

    name: str
    simulated: bool
    dimensions: int

    def embed(self, texts: list[str]) -> EmbedOutput:
        """Embed a batch of texts; raises ValueError for input the model cannot take."""
        ...

    def close(self) -> None:
        """Release what the model holds."""
        ...
