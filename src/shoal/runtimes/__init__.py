"""Runtimes behind three interfaces (`EmbeddingRuntime`, `GenerationRuntime`, `ScoringRuntime`).

They import nothing from the queue layer. `load_runtime` imports a runtime's module only when
it is used: torch takes seconds to import and a `sim` worker must not pay for it.
"""

from __future__ import annotations

from shoal.protocol import ModelSpec, Task
from shoal.runtimes.base import (
    EmbeddingRuntime,
    EmbedOutput,
    GenerationRuntime,
    SamplingParams,
    ScoreOutput,
    ScoringRuntime,
)

# Which tasks each runtime serves; `sim` is a simulated accelerator (no model runs).
RUNTIME_TASKS: dict[str, tuple[Task, ...]] = {
    "torch": (Task.EMBEDDINGS, Task.GENERATE, Task.RERANK),
    "llamacpp": (Task.GENERATE,),
    "sim": (Task.EMBEDDINGS, Task.GENERATE),
}
RUNTIMES = tuple(RUNTIME_TASKS)


def check_runtime(spec: ModelSpec) -> None:
    """Raise ValueError when no runtime of that name serves the spec's task."""
    tasks = RUNTIME_TASKS.get(spec.runtime)
    if tasks is None:
        raise ValueError(f"unknown runtime {spec.runtime!r}; known: {', '.join(RUNTIMES)}")
    if spec.task not in tasks:
        served = ", ".join(t.value for t in tasks)
        raise ValueError(f"runtime {spec.runtime!r} serves {served}, not {spec.task.value}")


def load_runtime(spec: ModelSpec) -> EmbeddingRuntime | GenerationRuntime | ScoringRuntime:
    """Load the model a spec names on the runtime it names, for the spec's task."""
    check_runtime(spec)
    if spec.task is Task.GENERATE:
        return _load_generation(spec)
    if spec.task is Task.RERANK:
        from shoal.runtimes.torch_cross import TorchCrossEncoderRuntime

        return TorchCrossEncoderRuntime(spec.name, spec.source, spec.options)
    if spec.runtime == "sim":
        from shoal.runtimes.sim import SimEmbeddingRuntime

        return SimEmbeddingRuntime(spec.name, spec.options)
    from shoal.runtimes.torch_st import TorchEmbeddingRuntime

    return TorchEmbeddingRuntime(spec.name, spec.source, spec.options)


def _load_generation(spec: ModelSpec) -> GenerationRuntime:
    if spec.runtime == "sim":
        from shoal.runtimes.sim_generate import SimGenerationRuntime

        return SimGenerationRuntime(spec.name, spec.options)
    if spec.runtime == "llamacpp":
        from shoal.runtimes.llamacpp import LlamaCppRuntime

        return LlamaCppRuntime(spec.name, spec.source, spec.options)
    from shoal.runtimes.torch_causal import TorchCausalRuntime

    return TorchCausalRuntime(spec.name, spec.source, spec.options)


def is_scoring(runtime: object) -> bool:
    """Whether a loaded runtime is a cross-encoder (`ScoringRuntime`) rather than an embedder."""
    return callable(getattr(runtime, "score", None)) and not hasattr(runtime, "embed")


def run_texts(runtime: EmbeddingRuntime | ScoringRuntime, texts: list[str]) -> None:
    """Run one batch of len(texts) items, whatever the runtime's interface (for profiling).

    A cross-encoder scores each text against itself: a pair as long as a typical request's.
    """
    if is_scoring(runtime):
        runtime.score([(text, text) for text in texts])  # type: ignore[union-attr]
    else:
        runtime.embed(texts)  # type: ignore[union-attr]


__all__ = [
    "RUNTIMES",
    "RUNTIME_TASKS",
    "EmbedOutput",
    "EmbeddingRuntime",
    "GenerationRuntime",
    "SamplingParams",
    "ScoreOutput",
    "ScoringRuntime",
    "check_runtime",
    "is_scoring",
    "load_runtime",
    "run_texts",
]
