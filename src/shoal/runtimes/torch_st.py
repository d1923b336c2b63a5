"""`torch`: sentence-transformers models on PyTorch, loaded from a local path or a package."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from shoal.runtimes.base import EmbedOutput
from shoal.runtimes.model_files import resolve_source


class TorchEmbeddingRuntime:
    """A sentence-transformers model, run batch by batch without the hub."""

    simulated = False

    def __init__(self, name: str, source: str, options: dict[str, Any]) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        import torch
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.util import batch_to_device

        threads = int(options.get("threads") or os.environ.get("SHOAL_THREADS") or 0)
        if threads > 0:
            torch.set_num_threads(threads)
        self._torch = torch
        self._batch_to_device = batch_to_device
        self.name = name
        self.device = str(options.get("device", "cuda" if torch.cuda.is_available() else "cpu"))
        self.model = SentenceTransformer(str(resolve_source(source)), device=self.device)
        self.model.eval()
        self.dimensions = int(self.model.get_sentence_embedding_dimension() or 0)

    def embed(self, texts: list[str]) -> EmbedOutput:
        # Tokenize once: the attention mask gives usage counts and feeds the forward pass.
        # Sorting by length, as sentence-transformers' encode does, keeps padding small.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]), reverse=True)
        features = self.model.preprocess([texts[i] for i in order])
        counts_sorted = features["attention_mask"].sum(dim=1).tolist()
        features = self._batch_to_device(features, self.device)
        with self._torch.inference_mode():
            sorted_vectors = self.model(features)["sentence_embedding"].float().cpu().numpy()
        vectors = np.empty_like(sorted_vectors)
        token_counts = [0] * len(texts)
        for position, original in enumerate(order):
            vectors[original] = sorted_vectors[position]
            token_counts[original] = int(counts_sorted[position])
        return EmbedOutput(vectors, token_counts)

    def close(self) -> None:
        del self.model
