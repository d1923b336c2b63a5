"""`torch`, task `rerank`: sentence-transformers CrossEncoder models on PyTorch.

A cross-encoder reads a query and a document together and gives the pair one relevance
score. Loaded from a local directory or `package:NAME`, never from the hub.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shoal.runtimes.base import ScoreOutput
from shoal.runtimes.model_files import resolve_source
from shoal.runtimes.torch_setup import import_torch


class TorchCrossEncoderRuntime:
    """A CrossEncoder run batch by batch; scores equal its `predict` (implements ScoringRuntime)."""

    simulated = False

    def __init__(self, name: str, source: str, options: dict[str, Any]) -> None:
        torch, self.device = import_torch(options)
        from sentence_transformers import CrossEncoder
        from sentence_transformers.util import batch_to_device

        self._torch = torch
        self._batch_to_device = batch_to_device
        self.name = name
        self.model = CrossEncoder(str(resolve_source(source)), device=self.device)
        self.model.eval()
        if self.model.num_labels != 1:
            # Reranking needs one relevance score per pair; a classifier over several labels
            # (entailment, ...) has no single score to sort by.
            raise ValueError(
                f"a rerank model has one output label; this one has {self.model.num_labels}"
            )

    def score(self, pairs: list[tuple[str, str]]) -> ScoreOutput:
        # What CrossEncoder.predict does, in one forward pass, tokenizing once: the attention
        # mask gives the usage counts. Sorted by length, as predict does, to keep padding small.
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
        features = self.model.preprocess([list(pairs[i]) for i in order])
        counts_sorted = features["attention_mask"].sum(dim=1).tolist()
        features = self._batch_to_device(features, self.device)
        with self._torch.inference_mode():
            logits = self.model(features)["scores"].float()
            activation = self.model.activation_fn
            scored = activation(logits) if activation is not None else logits
            sorted_scores = scored.reshape(len(pairs)).cpu().numpy()
        scores = np.empty(len(pairs), dtype=np.float32)
        token_counts = [0] * len(pairs)
        for position, original in enumerate(order):
            scores[original] = sorted_scores[position]
            token_counts[original] = int(counts_sorted[position])
        return ScoreOutput(scores, token_counts)

    def close(self) -> None:
        del self.model
