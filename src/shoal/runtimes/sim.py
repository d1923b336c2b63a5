"""`sim`: a SIMULATED accelerator, for scheduling experiments and fast tests. No model runs.

Cost model (documented in docs/architecture.md): a batch of texts with T tokens in all takes

    batch_ms / 1000  +  token_us / 1e6 * T      seconds,

spent sleeping (not burning CPU), so many simulated workers fit on a small machine while the
batch economics look like a GPU's: a fixed cost per batch that dominates small batches.
A text's tokens are estimated as ceil(utf8 bytes / 4) + 2.

Vectors are deterministic pseudo-embeddings: unit float32 vectors, the same for the same text
in every process. They come from a fixed pool of `POOL_SIZE` unit vectors per dimension
(drawn once from a fixed seed), picked by a cheap hash of the text, so a batch costs one hash
per text and one gather, about what a real accelerator's host side spends copying results
back. Drawing a fresh vector per text (a seeded generator per item) cost the worker ~25 us of
CPU per item, which a benchmark of the sidecar's own cost would have counted as Shoal's. Two
different texts share a vector with probability 1 / POOL_SIZE.

Token-id inputs are taken too (`embed_token_ids`), as deterministically: ids 0 .. vocab_size-1
(option `vocab_size`, default 32,000), one token per id, and a vector picked the same way from
the ids' little-endian bytes behind a marker no UTF-8 text starts with, so ids and texts never
share a vector by construction of their bytes (only by the pool's 1 / POOL_SIZE chance).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import zlib
from typing import Any

import numpy as np

from shoal.runtimes.base import EmbedOutput

POOL_BITS = 13
POOL_SIZE = 1 << POOL_BITS
_POOL_SEED = 0x5E0A1  # fixed, so every process (worker, test) draws the same pool
_pools: dict[int, np.ndarray] = {}
_pools_lock = threading.Lock()


def simulated_token_count(text: str) -> int:
    return -(-len(text.encode()) // 4) + 2


def vector_pool(dimensions: int) -> np.ndarray:
    """The read-only (POOL_SIZE, dimensions) float32 unit vectors texts are mapped to."""
    pool = _pools.get(dimensions)
    if pool is None:
        with _pools_lock:
            pool = _pools.get(dimensions)
            if pool is None:
                rng = np.random.default_rng(_POOL_SEED + dimensions)
                pool = rng.standard_normal((POOL_SIZE, dimensions), dtype=np.float32)
                pool /= np.linalg.norm(pool, axis=1, keepdims=True)
                pool.setflags(write=False)
                _pools[dimensions] = pool
    return pool


def _slot(encoded: bytes) -> int:
    # CRC-32 is linear: texts that differ only in a counter share many low bits (the low 13
    # bits of 256 numbered sentences collided 46 times). A multiplicative (Fibonacci) hash
    # moves every bit into the top ones, which are the slot.
    return ((zlib.crc32(encoded) * 0x9E3779B1) & 0xFFFFFFFF) >> (32 - POOL_BITS)


def pseudo_embedding(text: str, dimensions: int) -> np.ndarray:
    """The vector the sim runtime returns for `text`: tests compare against it."""
    return vector_pool(dimensions)[_slot(text.encode())].copy()


_IDS_MARKER = b"\xff"  # never the first byte of UTF-8 text


def _id_bytes(ids: list[int]) -> bytes:
    return _IDS_MARKER + np.asarray(ids, dtype="<u4").tobytes()


def pseudo_token_embedding(ids: list[int], dimensions: int) -> np.ndarray:
    """The vector the sim runtime returns for a token-id input: tests compare against it."""
    return vector_pool(dimensions)[_slot(_id_bytes(ids))].copy()


class SimEmbeddingRuntime:
    """A simulated embedding accelerator following the cost model above."""

    simulated = True

    def __init__(self, name: str, options: dict[str, Any]) -> None:
        self.name = name
        self.batch_seconds = float(options.get("batch_ms", 2.0)) / 1000
        self.token_seconds = float(options.get("token_us", 20.0)) / 1e6
        self.dimensions = int(options.get("dimensions", 384))
        self.vocab_size = int(options.get("vocab_size", 32_000))
        # Fault injection: a text containing this marker kills the process (SIGKILL, as the
        # kernel's OOM killer or a segfaulting kernel would), for dead-letter tests.
        self.crash_on = str(options.get("crash_on", "")).encode()
        # ... after running that long first (a kernel that works a while before it dies).
        self.crash_after_s = float(options.get("crash_after_ms", 0)) / 1000
        self._pool = vector_pool(self.dimensions)  # drawn at load, not in the first batch

    def batch_cost_seconds(self, token_counts: list[int]) -> float:
        return self.batch_seconds + self.token_seconds * sum(token_counts)

    def embed(self, texts: list[str], adapters: list[str | None] | None = None) -> EmbedOutput:
        if adapters and any(adapters):
            raise ValueError("the simulated runtime has no LoRA adapters")
        started = time.perf_counter()
        encoded = [t.encode() for t in texts]
        if self.crash_on and any(self.crash_on in e for e in encoded):
            time.sleep(self.crash_after_s)
            os.kill(os.getpid(), signal.SIGKILL)
        token_counts = [-(-len(e) // 4) + 2 for e in encoded]  # simulated_token_count
        slots = np.fromiter(map(_slot, encoded), dtype=np.intp, count=len(encoded))
        vectors = self._pool[slots]  # a gather makes a fresh, writable array
        remaining = self.batch_cost_seconds(token_counts) - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)
        return EmbedOutput(vectors, token_counts)

    def embed_token_ids(
        self, inputs: list[list[int]], adapters: list[str | None] | None = None
    ) -> EmbedOutput:
        """Token-id inputs under the same cost model: one token per id."""
        if adapters and any(adapters):
            raise ValueError("the simulated runtime has no LoRA adapters")
        started = time.perf_counter()
        token_counts = [len(ids) for ids in inputs]
        slots = np.fromiter(
            (_slot(_id_bytes(ids)) for ids in inputs), dtype=np.intp, count=len(inputs)
        )
        vectors = self._pool[slots]
        remaining = self.batch_cost_seconds(token_counts) - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)
        return EmbedOutput(vectors, token_counts)

    def close(self) -> None:
        pass
