"""`sim` generative mode: a SIMULATED decoder, for scheduling experiments and fast tests.

No model runs. Cost model (documented in docs/architecture.md): one decode step over R
running sequences, of which some process P prompt tokens in that step, takes

    step_ms / 1000  +  seq_us / 1e6 * R  +  prefill_token_us / 1e6 * P      seconds,

spent sleeping, so a fixed cost per step dominates as on a GPU and aggregate tokens/s grows
with the number of sequences decoded together. Text is made of words from a small fixed
vocabulary, chosen deterministically from the prompt (greedy, temperature 0) or from the
seed; the simulated model never emits end-of-generation, so `max_tokens` or a stop string
ends a sequence.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from shoal.runtimes.base import SamplingParams

WORDS = tuple(
    "the queue worker pulls a batch of small requests and every slot stays busy "  # noqa: SIM905
    "while tokens stream back to the gateway in order".split()
)
BOS = len(WORDS)


@dataclass(slots=True)
class _SimSequence:
    prompt_left: int
    rng: np.random.Generator


def _digest(tokens: list[int]) -> int:
    data = np.asarray(tokens, dtype=np.int64).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class SimGenerationRuntime:
    """A simulated generative accelerator following the cost model above."""

    simulated = True
    chat_template = None

    def __init__(self, name: str, options: dict[str, Any]) -> None:
        self.name = name
        self.max_sequences = int(options.get("max_sequences", 16))
        self.context_length = int(options.get("context_length", 4096))
        self.step_seconds = float(options.get("step_ms", 10.0)) / 1000
        self.seq_seconds = float(options.get("seq_us", 200.0)) / 1e6
        self.prefill_token_seconds = float(options.get("prefill_token_us", 20.0)) / 1e6
        self.prefill_chunk = int(options.get("prefill_chunk", 512))
        self._sequences: dict[int, _SimSequence] = {}

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        return [BOS] + [int(b) % len(WORDS) for b in data[::4]]  # ~4 bytes a token

    def token_bytes(self, token: int) -> bytes:
        return b"" if token == BOS else f" {WORDS[token]}".encode()

    def is_end_of_generation(self, token: int) -> bool:
        return False

    def add_sequence(
        self, slot: int, prompt: list[int], sampling: SamplingParams, adapter: str | None = None
    ) -> None:
        if adapter:
            raise ValueError(f"{type(self).__name__} serves no LoRA adapters")
        if not 0 <= slot < self.max_sequences or slot in self._sequences:
            raise ValueError(f"slot {slot} is not free")
        if len(prompt) >= self.context_length:
            raise ValueError(f"prompt of {len(prompt)} tokens exceeds the context")
        greedy = sampling.temperature == 0
        seed = _digest(prompt) if greedy or sampling.seed is None else sampling.seed
        if sampling.seed is None and not greedy:
            seed = None  # a fresh random stream, as a real sampler without a seed
        self._sequences[slot] = _SimSequence(len(prompt), np.random.default_rng(seed))

    def remove_sequence(self, slot: int) -> None:
        self._sequences.pop(slot, None)

    def step(self) -> dict[int, int]:
        started = time.perf_counter()
        prefill_tokens = 0
        tokens: dict[int, int] = {}
        for slot, sequence in self._sequences.items():
            if sequence.prompt_left:
                chunk = min(sequence.prompt_left, self.prefill_chunk)
                sequence.prompt_left -= chunk
                prefill_tokens += chunk
                if sequence.prompt_left:
                    continue
            tokens[slot] = int(sequence.rng.integers(len(WORDS)))
        cost = (
            self.step_seconds
            + self.seq_seconds * len(self._sequences)
            + self.prefill_token_seconds * prefill_tokens
        )
        remaining = cost - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)
        return tokens

    def close(self) -> None:
        self._sequences.clear()
