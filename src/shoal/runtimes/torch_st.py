"""`torch`: sentence-transformers models on PyTorch, loaded from a local path or a package."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from shoal.runtimes.base import EmbedOutput
from shoal.runtimes.model_files import resolve_source
from shoal.runtimes.torch_setup import import_torch


class TorchEmbeddingRuntime:
    """A sentence-transformers model, run batch by batch without the hub."""

    simulated = False

    def __init__(self, name: str, source: str, options: dict[str, Any]) -> None:
        torch, self.device = import_torch(options)
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.util import batch_to_device

        self._torch = torch
        self._batch_to_device = batch_to_device
        self.name = name
        self.model = SentenceTransformer(str(resolve_source(source)), device=self.device)
        self.model.eval()
        # sentence-transformers 6.x renamed get_sentence_embedding_dimension (now deprecated).
        dimension = getattr(self.model, "get_embedding_dimension", None)
        dimension = dimension or self.model.get_sentence_embedding_dimension
        self.dimensions = int(dimension() or 0)
        self._peft = None  # the transformer wrapped by peft once an adapter is added
        self._adapters: set[str] = set()

    def embed(self, texts: list[str], adapters: list[str | None] | None = None) -> EmbedOutput:
        # Tokenize once: the attention mask gives usage counts and feeds the forward pass.
        # Sorting by length, as sentence-transformers' encode does, keeps padding small.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]), reverse=True)
        features = self.model.preprocess([texts[i] for i in order])
        counts_sorted = features["attention_mask"].sum(dim=1).tolist()
        features = self._batch_to_device(features, self.device)
        with (
            self._torch.inference_mode(),
            self._adapters_for([adapters[i] for i in order] if adapters else None),
        ):
            sorted_vectors = self.model(features)["sentence_embedding"].float().cpu().numpy()
        vectors = np.empty_like(sorted_vectors)
        token_counts = [0] * len(texts)
        for position, original in enumerate(order):
            vectors[original] = sorted_vectors[position]
            token_counts[original] = int(counts_sorted[position])
        return EmbedOutput(vectors, token_counts)

    # -- LoRA adapters ---------------------------------------------------------------------

    def add_adapter(self, name: str, path: str) -> None:
        """Load a PEFT LoRA adapter beside the base weights (the base is not reloaded)."""
        from peft import PeftModel

        if name in self._adapters:
            self.remove_adapter(name)
        transformer = self.model[0]
        if self._peft is None:
            self._peft = PeftModel.from_pretrained(transformer.model, path, adapter_name=name)
            transformer.model = self._peft
        else:
            self._peft.load_adapter(path, adapter_name=name)
        self._adapters.add(name)

    def remove_adapter(self, name: str) -> None:
        if self._peft is not None and name in self._adapters:
            self._peft.delete_adapter(name)
            self._adapters.discard(name)

    def _adapters_for(self, names: list[str | None] | None):
        """A context in which row i of the next forward pass runs with adapter names[i]."""
        if not names or not any(names):
            return contextlib.nullcontext() if self._peft is None else self._peft.disable_adapter()
        unknown = {n for n in names if n is not None and n not in self._adapters}
        if unknown:
            raise ValueError(f"no adapter {', '.join(sorted(unknown))} is loaded")
        # peft's mixed-batch inference: each row's LoRA delta is its own adapter's (or none,
        # "__base__"), while everything else in the model runs once for the whole batch.
        # PeftModel.forward does the same; sentence-transformers does not pass the names on.
        rows = [n if n is not None else "__base__" for n in names]
        return self._peft._enable_peft_forward_hooks(adapter_names=rows)

    def close(self) -> None:
        del self.model
