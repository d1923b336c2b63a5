"""One record per runtime: what it serves, what it needs, how to load it.

Deployments (validation), placement (memory estimates), profiling, the worker (loading) and
the CLI (`shoal runtimes`) all read these records, so adding a runtime means adding its
module and its record here, nothing else. This module imports no runtime and no numpy: the
gateway validates deployments with it, and a `sim` worker must not pay for importing torch.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.protocol import ModelSpec, Task


class AdapterFormat:
    """Kinds of LoRA adapter a runtime takes."""

    PEFT = "peft"  # a PEFT adapter directory (adapter_config.json + weights)
    GGUF = "gguf"  # a GGUF LoRA file


@dataclass(frozen=True, slots=True)
class RuntimeRecord:
    """What one runtime can do. `loaders` name each task's class as "module:Class"."""

    name: str
    summary: str
    loaders: dict[Task, str]
    simulated: bool = False  # a simulated accelerator: no model runs, no weights
    requires: tuple[str, ...] = ()  # modules that must be importable ("installed here")
    extra: str = ""  # the pip extra that installs them
    adapter_tasks: tuple[Task, ...] = ()  # tasks on which it serves LoRA adapters
    adapter_formats: tuple[str, ...] = ()
    # Loaded size as a multiple of the weights on disk, by task (default 1.5).
    memory_factor: dict[Task, float] = field(default_factory=dict)
    # An engine: a server the worker runs as a child and feeds through the relay scheduler
    # (worker/schedulers/relay.py); it batches for itself, so it is not profiled in-process.
    engine: bool = False
    source_required: bool = True  # an engine's command may name its model itself
    # "module:function" that checks a spec's options at deploy time (ValueError says why).
    check_options: str = ""
    # "module:function" that checks, at deploy time, that a base deployment's options let it
    # take adapters (an engine's command must turn run-time LoRA loading on).
    check_adapter_base: str = ""

    @property
    def tasks(self) -> tuple[Task, ...]:
        return tuple(self.loaders)

    def installed(self) -> bool:
        """Whether what it needs is importable in this environment."""
        return all(importlib.util.find_spec(module) is not None for module in self.requires)

    def serves_adapters(self, task: Task) -> bool:
        return task in self.adapter_tasks


RUNTIME_RECORDS: dict[str, RuntimeRecord] = {
    record.name: record
    for record in (
        RuntimeRecord(
            name="torch",
            summary="PyTorch: sentence-transformers embedders and cross-encoders, causal LMs",
            loaders={
                Task.EMBEDDINGS: "shoal.runtimes.torch_st:TorchEmbeddingRuntime",
                Task.GENERATE: "shoal.runtimes.torch_causal:TorchCausalRuntime",
                Task.RERANK: "shoal.runtimes.torch_cross:TorchCrossEncoderRuntime",
            },
            requires=("torch", "sentence_transformers", "transformers"),
            extra="torch",
            adapter_tasks=(Task.EMBEDDINGS, Task.GENERATE),
            adapter_formats=(AdapterFormat.PEFT,),
            # A generative model from a GGUF file is dequantized to float32: ~4.5x its Q4 file.
            memory_factor={Task.GENERATE: 4.5},
        ),
        RuntimeRecord(
            name="llamacpp",
            summary="llama.cpp (llama-cpp-python): GGUF causal LMs, batched decoding",
            loaders={Task.GENERATE: "shoal.runtimes.llamacpp:LlamaCppRuntime"},
            requires=("llama_cpp",),
            extra="llamacpp",
            adapter_tasks=(Task.GENERATE,),
            # PEFT directories are converted to GGUF LoRA files once (runtimes/gguf_lora.py).
            adapter_formats=(AdapterFormat.GGUF, AdapterFormat.PEFT),
        ),
        RuntimeRecord(
            name="onnx",
            summary="ONNX Runtime: sentence-transformers embedders and cross-encoders, "
            "exported once (fp32, or dynamic int8 with its measured cosine)",
            loaders={
                Task.EMBEDDINGS: "shoal.runtimes.onnx:OnnxEmbeddingRuntime",
                Task.RERANK: "shoal.runtimes.onnx:OnnxCrossEncoderRuntime",
            },
            # Exporting needs torch and sentence-transformers; serving the tokenizer.
            requires=("onnxruntime", "onnx", "torch", "sentence_transformers"),
            extra="onnx",
        ),
        RuntimeRecord(
            name="candle",
            summary="Hugging Face Candle (candle-pyo3 bindings): BERT sentence-transformers "
            "embedders, no torch",
            loaders={Task.EMBEDDINGS: "shoal.runtimes.candle:CandleEmbeddingRuntime"},
            # The `candle` module comes from the hash-pinned `candle-nn` wheel
            # (requirements/candle.txt); tokenization from `tokenizers`.
            requires=("candle", "tokenizers"),
            extra="candle",
        ),
        RuntimeRecord(
            name="engine",
            summary="an OpenAI-compatible inference server (vLLM, SGLang, llama.cpp's server, "
            "TEI, ...) run as a supervised child from its own command line or virtualenv",
            loaders={
                Task.GENERATE: "shoal.runtimes.engine:EngineRuntime",
                Task.EMBEDDINGS: "shoal.runtimes.engine:EngineRuntime",
            },
            requires=("httpx",),
            extra="engine",
            engine=True,
            source_required=False,
            check_options="shoal.runtimes.engine:check_engine_options",
            # Loaded at run time by engines started with --enable-lora (vLLM, SGLang).
            adapter_tasks=(Task.GENERATE,),
            adapter_formats=(AdapterFormat.PEFT,),
            check_adapter_base="shoal.runtimes.engine:check_engine_adapter_base",
        ),
        RuntimeRecord(
            name="sim",
            summary="simulated accelerator (no model runs): scheduling experiments, fast tests",
            loaders={
                Task.EMBEDDINGS: "shoal.runtimes.sim:SimEmbeddingRuntime",
                Task.GENERATE: "shoal.runtimes.sim_generate:SimGenerationRuntime",
            },
            simulated=True,
        ),
    )
}
RUNTIMES = tuple(RUNTIME_RECORDS)


def runtime_record(name: str) -> RuntimeRecord:
    """The record of a runtime by name; ValueError naming the known ones otherwise."""
    record = RUNTIME_RECORDS.get(name)
    if record is None:
        raise ValueError(f"unknown runtime {name!r}; known: {', '.join(RUNTIMES)}")
    return record


def is_simulated(runtime: str) -> bool:
    """Whether a runtime name is a simulated accelerator (False for an unknown name)."""
    record = RUNTIME_RECORDS.get(runtime)
    return record is not None and record.simulated


def check_runtime(spec: ModelSpec) -> RuntimeRecord:
    """The spec's runtime record; ValueError unless it serves the spec's task."""
    record = runtime_record(spec.runtime)
    if spec.task not in record.loaders:
        served = ", ".join(t.value for t in record.tasks)
        raise ValueError(f"runtime {spec.runtime!r} serves {served}, not {spec.task.value}")
    return record


def check_options(spec: ModelSpec) -> None:
    """ValueError unless the spec's options suit its runtime (for runtimes that check them)."""
    _run_check(runtime_record(spec.runtime).check_options, spec.options)


def check_adapter_base(spec: ModelSpec) -> None:
    """ValueError unless the base deployment `spec` can take LoRA adapters as configured."""
    _run_check(runtime_record(spec.runtime).check_adapter_base, spec.options)


def _run_check(reference: str, options: dict[str, Any]) -> None:
    """Call a record's "module:function" check on a deployment's options (none: no check);
    imported only when called, so a runtime's module loads only where it is used."""
    if reference:
        module_name, function_name = reference.split(":")
        getattr(importlib.import_module(module_name), function_name)(options)


def load_runtime(spec: ModelSpec) -> Any:
    """Load the model a spec names on the runtime it names, for the spec's task.

    The runtime's module is imported only now: torch takes seconds to import.
    """
    record = check_runtime(spec)
    module_name, class_name = record.loaders[spec.task].split(":")
    runtime_class = getattr(importlib.import_module(module_name), class_name)
    if record.simulated:
        return runtime_class(spec.name, spec.options)
    return runtime_class(spec.name, spec.source, spec.options)


def check_adapter_source(record: RuntimeRecord, adapter: str) -> None:
    """ValueError unless `adapter` is a LoRA adapter in a format the runtime takes."""
    path = Path(adapter).expanduser()
    formats = record.adapter_formats
    if path.is_file():
        from shoal.runtimes.gguf_lora import is_gguf_file

        if AdapterFormat.GGUF in formats and is_gguf_file(path):
            return
        if AdapterFormat.GGUF in formats:
            raise ValueError(f"{adapter!r} is neither a GGUF LoRA file nor a directory")
        raise ValueError(f"{adapter!r} is not a PEFT adapter (no adapter_config.json)")
    if AdapterFormat.PEFT not in formats:
        raise ValueError(f"{adapter!r} is not a GGUF LoRA file")
    if AdapterFormat.GGUF in formats:  # a PEFT directory converted to GGUF: check it converts
        from shoal.runtimes.gguf_lora import check_convertible

        check_convertible(path)
    elif not (path / "adapter_config.json").is_file():
        raise ValueError(f"{adapter!r} is not a PEFT adapter (no adapter_config.json)")


def estimate_memory_mb(spec: ModelSpec, weights_mb: float) -> float:
    """What loading a spec will take, before it was ever measured.

    A simulated model declares its footprint (option `memory_mb`, default 0); a real one
    takes its weights' size times the runtime's factor.
    """
    record = runtime_record(spec.runtime)
    if record.simulated:
        return float(spec.options.get("memory_mb", 0.0))
    return weights_mb * record.memory_factor.get(spec.task, 1.5)
