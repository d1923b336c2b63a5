"""`torch`: sentence-transformers models on PyTorch, loaded from a local path or a package."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
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
        path = resolve_source(source)
        self.model = SentenceTransformer(str(path), device=self.device)
        self.model.eval()
        # sentence-transformers 6.x renamed get_sentence_embedding_dimension (now deprecated).
        dimension = getattr(self.model, "get_embedding_dimension", None)
        dimension = dimension or self.model.get_sentence_embedding_dimension
        self.dimensions = int(dimension() or 0)
        self._peft = None  # the transformer wrapped by peft once an adapter is added
        self._adapters: set[str] = set()
        self.matryoshka_dimensions = card_matryoshka_dimensions(Path(path))
        self._setup_token_ids()

    def embed(self, texts: list[str], adapters: list[str | None] | None = None) -> EmbedOutput:
        # Tokenize once: the attention mask gives usage counts and feeds the forward pass.
        # Sorting by length, as sentence-transformers' encode does, keeps padding small.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]), reverse=True)
        features = self.model.preprocess([texts[i] for i in order])
        return self._forward(features, order, adapters)

    def embed_token_ids(
        self, inputs: list[list[int]], adapters: list[str | None] | None = None
    ) -> EmbedOutput:
        """Token ids of this model's tokenizer, run as `embed` runs the text they came from.

        The ids go straight into the model (no decode and re-encode, which need not give the
        same ids back); the special tokens and the length cut are the tokenizer's own.
        """
        torch = self._torch
        rows = [self._as_model_input(ids) for ids in inputs]
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]), reverse=True)
        width = len(rows[order[0]])
        input_ids = torch.full((len(rows), width), self._pad_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        left = self.model.tokenizer.padding_side == "left"
        for position, original in enumerate(order):
            row = rows[original]
            span = slice(width - len(row), width) if left else slice(0, len(row))
            input_ids[position, span] = torch.tensor(row, dtype=torch.long)
            attention[position, span] = 1
        features = dict(self._feature_extras)
        features["input_ids"] = input_ids
        features["attention_mask"] = attention
        if self._token_types:
            features["token_type_ids"] = torch.zeros_like(input_ids)
        return self._forward(features, order, adapters)

    def _forward(
        self, features: dict[str, Any], order: list[int], adapters: list[str | None] | None
    ) -> EmbedOutput:
        """Run features whose row i is input order[i]; vectors and counts in input order."""
        counts_sorted = features["attention_mask"].sum(dim=1).tolist()
        features = self._batch_to_device(features, self.device)
        with (
            self._torch.inference_mode(),
            self._adapters_for([adapters[i] for i in order] if adapters else None),
        ):
            sorted_vectors = self.model(features)["sentence_embedding"].float().cpu().numpy()
        vectors = np.empty_like(sorted_vectors)
        token_counts = [0] * len(order)
        for position, original in enumerate(order):
            vectors[original] = sorted_vectors[position]
            token_counts[original] = int(counts_sorted[position])
        return EmbedOutput(vectors, token_counts)

    def _setup_token_ids(self) -> None:
        """What `embed_token_ids` needs from the tokenizer, read once: its special tokens
        around a text, padding, the features it returns, and the ids the model can look up."""
        tokenizer = self.model.tokenizer
        probe = "a"
        with_specials = list(tokenizer(probe)["input_ids"])
        bare = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
        start = next(
            (
                i
                for i in range(len(with_specials) - len(bare) + 1)
                if with_specials[i : i + len(bare)] == bare
            ),
            0,
        )
        self._prefix = with_specials[:start]
        self._suffix = with_specials[start + len(bare) :]
        self._pad_id = int(tokenizer.pad_token_id or 0)
        features = self.model.preprocess([probe])
        self._token_types = "token_type_ids" in features
        # Keys that are not tensors (sentence-transformers 6 adds "modality") go in as they are.
        self._feature_extras = {
            key: value for key, value in features.items() if not hasattr(value, "shape")
        }
        self._max_length = int(self.model.max_seq_length or tokenizer.model_max_length)
        vocab_size = len(tokenizer)
        with contextlib.suppress(AttributeError, IndexError, TypeError):
            rows = self.model[0].auto_model.get_input_embeddings().num_embeddings
            vocab_size = min(vocab_size, int(rows))
        self.vocab_size = vocab_size

    def _as_model_input(self, ids: list[int]) -> list[int]:
        """The ids with the tokenizer's special tokens (added when absent), cut to the
        model's length as the tokenizer cuts a text (inside the special tokens)."""
        prefix, suffix = self._prefix, self._suffix
        has_specials = (prefix or suffix) and len(ids) >= len(prefix) + len(suffix)
        if (
            has_specials
            and ids[: len(prefix)] == prefix
            and ids[len(ids) - len(suffix) :] == suffix
        ):
            ids = ids[len(prefix) : len(ids) - len(suffix)]
        room = max(self._max_length - len(prefix) - len(suffix), 0)
        return [*prefix, *ids[:room], *suffix]

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


_MATRYOSHKA_DIMS = re.compile(r'"matryoshka_dims"\s*:\s*(\[[0-9,\s]*\])')


def card_matryoshka_dimensions(path: Path) -> tuple[int, ...]:
    """The sizes a sentence-transformers model was trained to be cut to, from its card.

    sentence-transformers writes the training loss's parameters into the model card
    (README.md); a model trained with MatryoshkaLoss lists `"matryoshka_dims": [...]` there.
    No card, or no such loss: () (the model's vectors may not be shortened).
    """
    card = path / "README.md" if path.is_dir() else None
    if card is None or not card.is_file():
        return ()
    found = _MATRYOSHKA_DIMS.search(card.read_text(errors="replace"))
    if found is None:
        return ()
    with contextlib.suppress(ValueError):
        return tuple(int(d) for d in json.loads(found.group(1)))
    return ()
