"""The interfaces every runtime implements. A runtime knows models, not queues."""

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

    def embed(self, texts: list[str], adapters: list[str | None] | None = None) -> EmbedOutput:
        """Embed a batch of texts; raises ValueError for input the model cannot take.

        `adapters[i]` names the LoRA adapter text i runs with (None: the base model); a batch
        may mix them. Runtimes without adapters raise ValueError for any name.
        """
        ...

    def close(self) -> None:
        """Release what the model holds."""
        ...


class TokenIdEmbeddingRuntime(EmbeddingRuntime, Protocol):
    """An embedding runtime that also embeds token ids of the model's own tokenizer.

    Requests may send `input` as token ids (OpenAI's API allows it); a runtime that has this
    method and `vocab_size` takes them, the others get a 400 at parse time.
    """

    vocab_size: int  # ids must lie in 0 .. vocab_size - 1

    def embed_token_ids(
        self, inputs: list[list[int]], adapters: list[str | None] | None = None
    ) -> EmbedOutput:
        """Embed a batch of token-id lists exactly as the texts they were tokenized from.

        Ids with or without the tokenizer's special tokens both work: missing ones are added
        as the tokenizer would. Inputs longer than the model takes are cut as texts are.
        """
        ...


def takes_token_ids(runtime: object) -> int | None:
    """The vocabulary size of a runtime that embeds token ids; None for one that does not."""
    if not callable(getattr(runtime, "embed_token_ids", None)):
        return None
    vocab_size = getattr(runtime, "vocab_size", None)
    return int(vocab_size) if vocab_size else None


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one sequence picks its next token. temperature 0 means greedy (argmax)."""

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None  # same seed, same prompt, same settings: same tokens


class GenerationRuntime(Protocol):
    """A loaded causal language model that decodes up to `max_sequences` sequences together.

    The worker owns scheduling: it adds a sequence into a free slot (0 .. max_sequences-1),
    calls `step()` repeatedly, and removes the sequence when it has finished (stop string,
    token limit, end-of-generation token, cancellation). Stop strings, token limits and text
    assembly live in the worker, not here. All methods are called from one executor thread.
    """

    name: str
    simulated: bool
    max_sequences: int  # slots decoded in one step
    context_length: int  # tokens one sequence may hold: prompt + completion
    chat_template: str | None  # the model's own (Jinja) chat template, if it ships one

    def tokenize(self, text: str) -> list[int]:
        """Token ids for a prompt, with the beginning-of-sequence token the model expects."""
        ...

    def token_bytes(self, token: int) -> bytes:
        """The UTF-8 bytes a token adds to the text (may be part of one character)."""
        ...

    def is_end_of_generation(self, token: int) -> bool:
        """True for tokens that end a completion (EOS, end of turn)."""
        ...

    def add_sequence(
        self, slot: int, prompt: list[int], sampling: SamplingParams, adapter: str | None = None
    ) -> None:
        """Start a sequence in a free slot; its prompt is processed by the next `step()`s.

        `adapter` names a loaded LoRA adapter the sequence decodes with (None: the base);
        runtimes without adapters raise ValueError for any name.
        """
        ...

    def remove_sequence(self, slot: int) -> None:
        """Forget a sequence and free its slot and cache, finished or not."""
        ...

    def step(self) -> dict[int, int]:
        """Advance every sequence by one token: returns {slot: new token}.

        A sequence whose prompt is still being processed (prompts longer than one step's
        token budget are processed over several steps) is absent from the result.
        """
        ...

    def close(self) -> None:
        """Release what the model holds."""
        ...


@dataclass(frozen=True, slots=True)
class ScoreOutput:
    """Relevance scores for a list of (query, document) pairs, and the tokens each pair used."""

    scores: np.ndarray  # float32, shape (len(pairs),)
    token_counts: list[int]


class ScoringRuntime(Protocol):
    """A loaded cross-encoder: reads a query and a document together and scores the pair.

    `score` is called from one executor thread at a time.
    """

    name: str
    simulated: bool

    def score(self, pairs: list[tuple[str, str]]) -> ScoreOutput:
        """Score a batch of pairs; raises ValueError for input the model cannot take."""
        ...

    def close(self) -> None:
        """Release what the model holds."""
        ...


class AdapterHost(Protocol):
    """A loaded runtime that serves LoRA adapters beside its base weights.

    Which runtimes and tasks do, and in which formats, is in their registry record.
    """

    def add_adapter(self, name: str, path: str) -> None:
        """Load an adapter under a name (replacing one of that name); the base stays loaded."""
        ...

    def remove_adapter(self, name: str) -> None:
        """Release an adapter; no running sequence or batch may still use it."""
        ...
