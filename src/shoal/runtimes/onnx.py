"""`onnx`: sentence-transformers embedders and cross-encoders on ONNX Runtime (CPU).

The model is exported from its sentence-transformers form once per (model, content hash of its
weight and configuration files) into the cache directory, and every later load, in any
process, reads that file. The exported graph is the whole sentence-transformers pipeline as the
model's own configuration declares it (modules.json: the transformer, then pooling in the mode
its pooling config names, Dense layers, Normalize where present; for a cross-encoder, the
classifier and the activation its `predict` applies), so the ONNX output is the
sentence-transformers output, not a re-implementation of it. Each export is checked against
the torch model on fixed sentences before it is written; a model that does not export
faithfully is refused with the reason, never served with wrong vectors.

Options (deployment `--option K=V`):
  quantize  `int8`: dynamic int8 quantization of the fp32 export (measured cosine to fp32 in
            `int8_cosine`); absent or `fp32`: fp32.
  threads   intra-op threads (the worker passes its thread setting; else this process's cores,
            at most 8).
  device    `cpu` (default), or `cuda` where onnxruntime has the CUDA provider.

Exporting needs torch and sentence-transformers (the `torch` extra); serving a cached export
needs only onnxruntime and the model's tokenizer. LoRA adapters are not supported.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shoal.runtimes.base import EmbedOutput, ScoreOutput
from shoal.runtimes.model_files import cache_dir, resolve_source, write_once

# Part of every cache key: bump it when the wrapper or the metadata below change, so that old
# exports are ignored instead of misread.
EXPORT_VERSION = 1
OPSET = 17
# Small encoders stop scaling past a few intra-op threads at serving batch sizes, and several
# workers often share one machine: more threads would only contend with each other.
MAX_DEFAULT_THREADS = 8
# Exports this process ran; a load served from the cache leaves it unchanged (tests read it).
exports = 0

# Fixed inputs for the export check and the int8-vs-fp32 measurement. Varied on purpose:
# lengths, casing, punctuation, non-Latin scripts, an empty string.
CHECK_SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Shoal workers pull their own batches from a shared queue.",
    "A cat sleeps on the warm windowsill all afternoon.",
    "Interest rates rose again this quarter, and bond prices fell.",
    "How do I reset my password?",
    "Ein kleiner Satz auf Deutsch.",
    "短い日本語の文です。",
    "The mitochondria is the powerhouse of the cell.",
    "RAID 10 mirrors pairs of disks and stripes across the pairs.",
    "She sold seashells by the seashore on a Sunday.",
    "  Leading and trailing whitespace  ",
    "UPPER CASE TEXT AND numbers 12345",
    "",
    "A much longer passage about queues, batching and latency: when the backlog is small the "
    "worker waits a little for a fuller batch, and when it is large it never waits at all.",
)
CHECK_PAIRS = tuple(
    (query, document)
    for query in ("how do workers get their batches", "what is a cat doing")
    for document in CHECK_SENTENCES[:7]
)

# Module types whose forward traces into a static graph, by class name: modules.json may say
# `sentence_transformers.models.Pooling` or `sentence_transformers...modules.pooling.Pooling`.
EMBEDDING_MODULES = frozenset(
    {"Transformer", "Pooling", "Normalize", "Dense", "LayerNorm", "Dropout", "WeightedLayerPooling"}
)
CROSS_ENCODER_MODULES = frozenset({"Transformer"})
# Legacy pooling configs name the mode with one boolean per mode.
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
# Files whose content decides the export; other formats' weights (onnx/, openvino/, flax) and
# READMEs do not.
_HASHED_SUFFIXES = frozenset({".json", ".safetensors", ".bin", ".txt", ".model", ".pt"})
_SKIPPED_DIRS = frozenset({"onnx", "openvino", ".git", ".cache"})


# -- what the model's sentence-transformers configuration says -----------------------------


def read_pipeline(model_dir: Path, kind: str) -> dict[str, Any]:
    """The module chain of a sentence-transformers model directory, from its own files.

    Returns {"modules": [class names], "pooling": mode or None, "normalize": bool,
    "transformer_dir": directory of the transformer and its tokenizer}. Raises ValueError for
    a module that cannot be exported to a static graph.
    """
    if not model_dir.is_dir():
        raise ValueError(f"the onnx runtime needs a model directory, not the file {model_dir}")
    modules_file = model_dir / "modules.json"
    if modules_file.exists():
        entries = json.loads(modules_file.read_text())
    else:
        # A plain transformers checkpoint: sentence-transformers wraps it in a Transformer and,
        # for an embedder, mean pooling. Said here so the metadata tells what ran.
        entries = [{"type": "Transformer", "path": ""}]
        if kind == "embed":
            entries.append({"type": "Pooling", "path": None, "default": "mean"})
    allowed = EMBEDDING_MODULES if kind == "embed" else CROSS_ENCODER_MODULES
    names: list[str] = []
    pooling: str | None = None
    transformer_dir = model_dir
    for entry in entries:
        name = str(entry["type"]).rsplit(".", 1)[-1]
        if name not in allowed:
            raise ValueError(
                f"the onnx runtime cannot export the sentence-transformers module {name} "
                f"(it exports {', '.join(sorted(allowed))}); use --runtime torch"
            )
        names.append(name)
        if name == "Transformer":
            transformer_dir = model_dir / (entry.get("path") or "")
        elif name == "Pooling":
            pooling = entry.get("default") or _pooling_mode(model_dir / (entry.get("path") or ""))
    return {
        "modules": names,
        "pooling": pooling,
        "normalize": "Normalize" in names,
        "transformer_dir": transformer_dir,
    }


def _pooling_mode(pooling_dir: Path) -> str:
    config_file = pooling_dir / "config.json"
    if not config_file.exists():
        raise ValueError(f"the pooling module has no config.json in {pooling_dir}")
    config = json.loads(config_file.read_text())
    mode = config.get("pooling_mode")
    if mode is None:
        mode = [m for key, m in _LEGACY_POOLING_KEYS.items() if config.get(key)]
    if isinstance(mode, str):
        mode = [mode]
    if not mode:
        raise ValueError(f"the pooling config in {pooling_dir} names no pooling mode")
    return "+".join(mode)  # several modes are concatenated, as sentence-transformers does


def content_hash(model_dir: Path, kind: str) -> str:
    """SHA-256 over the files that decide the export, with the export's own version."""
    digest = hashlib.sha256(f"shoal-onnx {EXPORT_VERSION} opset {OPSET} {kind}\n".encode())
    for path in sorted(model_dir.rglob("*")):
        relative = path.relative_to(model_dir)
        if _SKIPPED_DIRS.intersection(relative.parts[:-1]) or path.suffix not in _HASHED_SUFFIXES:
            continue
        if not path.is_file():
            continue
        digest.update(f"{relative.as_posix()}\n".encode())
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def default_threads(options: dict[str, Any]) -> int:
    """Intra-op threads: `threads`, else this process's cores (at most 8)."""
    threads = int(options.get("threads") or 0)
    if threads > 0:
        return threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, MAX_DEFAULT_THREADS))


def _quantize_option(options: dict[str, Any]) -> str:
    value = str(options.get("quantize") or "fp32").lower()
    if value not in ("fp32", "int8"):
        raise ValueError(f"option quantize={value!r}: the onnx runtime knows fp32 and int8")
    return value


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)
    b = b / np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-12)
    return (a * b).sum(axis=1)


# -- the loaded model -----------------------------------------------------------------------


class _OnnxModel:
    """What both runtimes share: the cached export, the session and the tokenizer."""

    def __init__(self, name: str, source: str, options: dict[str, Any], kind: str) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        import onnxruntime

        self._ort = onnxruntime
        self.name = name
        self.kind = kind
        self.quantize = _quantize_option(options)
        self.threads = default_threads(options)
        self._providers = self._pick_providers(str(options.get("device") or "cpu"))
        self._options = options
        self.source_dir = resolve_source(source)
        self.pipeline = read_pipeline(self.source_dir, kind)
        digest = content_hash(self.source_dir, kind)
        # Named for people reading the cache; the digest alone decides which entry is used.
        label = (
            source.removeprefix("package:")
            if source.startswith("package:")
            else "-".join(Path(source).expanduser().resolve().parts[-2:])
        )
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", label).strip("-.")[-60:] or "model"
        self.entry = cache_dir() / "onnx" / f"{slug}-{digest[:16]}"
        self.exported = False  # whether this load ran the export (False: read from the cache)
        self.quantized = False  # whether this load ran the int8 quantization

        fp32_path = self.entry / "model.onnx"
        if not fp32_path.exists():
            write_once(fp32_path, self._export)
            self.exported = True
        self.path = fp32_path
        if self.quantize == "int8":
            self.path = self.entry / "model.int8.onnx"
            if not self.path.exists():
                write_once(self.path, lambda partial: self._quantize(fp32_path, partial))
                self.quantized = True
        _remove_stale_partials(self.entry)
        self.session = self._session(self.path)
        meta = self.session.get_modelmeta().custom_metadata_map
        self.metadata = meta
        self.input_names = json.loads(meta["shoal.input_names"])
        self.max_length = int(meta["shoal.max_length"])
        self.lower_case = meta.get("shoal.do_lower_case") == "1"
        self.tokenizer = self._load_tokenizer()

    # -- inference ----------------------------------------------------------------------------

    def _pick_providers(self, device: str) -> list[str]:
        available = self._ort.get_available_providers()
        if device == "cpu":
            return ["CPUExecutionProvider"]
        if device.startswith("cuda") and "CUDAExecutionProvider" in available:
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]
        raise ValueError(
            f"device {device!r}: this onnxruntime has {', '.join(available)}; use device=cpu"
        )

    def _session(self, path: Path) -> Any:
        ort = self._ort
        options = ort.SessionOptions()
        # Threads set deliberately: onnxruntime's default takes every core, and several workers
        # (and torch, and the sidecar's event loop) share this machine. intra-op threads split
        # each operator (a MatMul) and are where an encoder's time goes. inter-op threads run
        # independent branches in parallel, but an encoder is one chain of operators and the
        # default sequential executor never uses them: 1 keeps a second idle pool from existing.
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3  # errors only: export-time warnings are not news here
        return ort.InferenceSession(str(path), options, providers=self._providers)

    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        # The tokenizer of the model's own files, truncating where sentence-transformers does
        # (its max_seq_length), so texts longer than the model takes are cut, not refused.
        return AutoTokenizer.from_pretrained(
            str(self.pipeline["transformer_dir"]), model_max_length=self.max_length
        )

    def tokenize(self, first: Sequence[str], second: Sequence[str] | None = None) -> dict:
        """Token ids as sentence-transformers' preprocess makes them (numpy, int64)."""
        if self.lower_case:
            first = [t.lower() for t in first]
            second = [t.lower() for t in second] if second is not None else None
        encoded = self.tokenizer(
            list(first),
            list(second) if second is not None else None,
            padding=True,
            truncation="longest_first",
            max_length=self.max_length,
            return_tensors="np",
        )
        return {name: np.asarray(encoded[name], dtype=np.int64) for name in self.input_names}

    def run(self, features: dict[str, np.ndarray], session: Any = None) -> np.ndarray:
        return (session or self.session).run(None, features)[0]

    def close(self) -> None:
        self.session = None
        self.tokenizer = None

    # -- export (once per model and content hash) ----------------------------------------------

    def _export(self, partial: Path) -> None:
        """Export the sentence-transformers pipeline to `partial`, check it, add metadata."""
        global exports
        from shoal.runtimes.torch_setup import import_torch

        torch, _ = import_torch(self._options)
        # Exported on the CPU whatever serves it later: the graph is the same, and a CUDA
        # export would need the GPU just to write a file.
        if self.kind == "embed":
            from sentence_transformers import SentenceTransformer

            model = SentenceTransformer(str(self.source_dir), device="cpu")
        else:
            from sentence_transformers import CrossEncoder

            model = CrossEncoder(str(self.source_dir), device="cpu")
            if model.num_labels != 1:
                raise ValueError(
                    f"a rerank model has one output label; this one has {model.num_labels}"
                )
        model.eval()
        transformer = model[0]
        tokenizer = transformer.tokenizer
        max_length = _max_length(transformer)
        sample = tokenizer(
            ["a short one", "and a somewhat longer second text"],
            ["a document", "another document"] if self.kind == "cross" else None,
            padding=True,
            return_tensors="pt",
        )
        input_names = [n for n in tokenizer.model_input_names if n in sample]
        wrapper = _wrapper(model, input_names, self.kind, torch)
        output_name = "sentence_embedding" if self.kind == "embed" else "score"
        axes = {n: {0: "batch", 1: "sequence"} for n in input_names}
        axes[output_name] = {0: "batch"}
        with torch.no_grad(), warnings.catch_warnings():
            # The tracer warns that a few shape tests (mask as long as the ids, a mask present)
            # become constants in the graph: they hold for every input the tokenizer makes, and
            # _check_export runs the graph on other batch and sequence sizes than the sample.
            warnings.simplefilter("ignore", category=torch.jit.TracerWarning)
            warnings.filterwarnings("ignore", message="Exporting aten::index operator")
            # The TorchScript exporter (dynamo=False) on purpose: it traces sentence-transformers'
            # Python-level module chain as run, needs no onnxscript, and was measured to match
            # sentence-transformers here. torch calls it legacy; the check below guards it.
            warnings.simplefilter("ignore", category=DeprecationWarning)
            torch.onnx.export(
                wrapper,
                tuple(sample[n] for n in input_names),
                str(partial),
                input_names=input_names,
                output_names=[output_name],
                dynamic_axes=axes,
                opset_version=OPSET,
                dynamo=False,
            )
        exports += 1
        metadata = {
            "shoal.export_version": str(EXPORT_VERSION),
            "shoal.kind": self.kind,
            "shoal.input_names": json.dumps(input_names),
            "shoal.max_length": str(max_length),
            "shoal.do_lower_case": "1" if getattr(transformer, "do_lower_case", False) else "0",
            "shoal.modules": json.dumps(self.pipeline["modules"]),
            "shoal.pooling": self.pipeline["pooling"] or "",
            "shoal.normalize": "1" if self.pipeline["normalize"] else "0",
            "shoal.source": str(self.source_dir),
            "shoal.torch": str(torch.__version__),
        }
        self._check_export(partial, model, input_names, max_length, metadata, torch)
        _set_metadata(partial, metadata)

    def _check_export(
        self,
        partial: Path,
        model: Any,
        input_names: list[str],
        max_length: int,
        metadata: dict[str, str],
        torch: Any,
    ) -> None:
        """Refuse an export whose tokens or outputs differ from sentence-transformers'."""
        self.input_names, self.max_length = input_names, max_length
        self.lower_case = metadata["shoal.do_lower_case"] == "1"
        self.tokenizer = self._load_tokenizer()
        session = self._session(partial)
        if self.kind == "embed":
            texts = list(CHECK_SENTENCES)
            ours = self.tokenize(texts)
            theirs = model.preprocess(texts)
            with torch.inference_mode():
                expected = model.encode(texts, convert_to_numpy=True, batch_size=len(texts))
            got = self.run(ours, session)
            metadata["shoal.dimensions"] = str(got.shape[1])
            worst = float(_cosines(got, expected).min())
            metadata["shoal.check_cosine_min"] = f"{worst:.7f}"
            faithful = worst >= 0.9999
        else:
            queries, documents = zip(*CHECK_PAIRS, strict=True)
            ours = self.tokenize(queries, documents)
            theirs = model.preprocess([list(pair) for pair in CHECK_PAIRS])
            expected = np.asarray(model.predict(list(CHECK_PAIRS)), dtype=np.float32)
            got = self.run(ours, session)
            worst = float(np.abs(got - expected).max())
            metadata["shoal.check_max_abs_error"] = f"{worst:.3g}"
            faithful = worst <= 1e-4
        for name in input_names:
            if not np.array_equal(ours[name], theirs[name].cpu().numpy()):
                raise ValueError(
                    f"the onnx runtime tokenizes differently from sentence-transformers for "
                    f"{self.source_dir} ({name}); use --runtime torch"
                )
        if not faithful:
            raise ValueError(
                f"the ONNX export of {self.source_dir} does not match sentence-transformers "
                f"(worst {'cosine' if self.kind == 'embed' else 'abs error'} {worst:.6g}); "
                "use --runtime torch"
            )

    # -- int8 ------------------------------------------------------------------------------------

    def _quantize(self, fp32_path: Path, partial: Path) -> None:
        """Dynamic int8 quantization of the fp32 export, with its measured error to fp32."""
        from onnxruntime.quantization import QuantType, quantize_dynamic

        # Weights per output channel: on all-MiniLM-L6-v2 the default per-tensor scales give a
        # mean cosine of 0.957 to fp32 (worst 0.93); per channel 0.992 (worst 0.989), at about
        # the same speed on this CPU (AVX-512 VNNI).
        quantize_dynamic(
            str(fp32_path), str(partial), weight_type=QuantType.QInt8, per_channel=True
        )
        fp32 = self._session(fp32_path)
        meta = dict(fp32.get_modelmeta().custom_metadata_map)
        self.input_names = json.loads(meta["shoal.input_names"])
        self.max_length = int(meta["shoal.max_length"])
        self.lower_case = meta.get("shoal.do_lower_case") == "1"
        self.tokenizer = self._load_tokenizer()
        int8 = self._session(partial)
        if self.kind == "embed":
            features = self.tokenize(list(CHECK_SENTENCES))
            cosines = _cosines(self.run(features, int8), self.run(features, fp32))
            meta["shoal.int8_cosine"] = f"{float(cosines.mean()):.6f}"
            meta["shoal.int8_cosine_min"] = f"{float(cosines.min()):.6f}"
        else:
            queries, documents = zip(*CHECK_PAIRS, strict=True)
            features = self.tokenize(queries, documents)
            error = np.abs(self.run(features, int8) - self.run(features, fp32)).max()
            meta["shoal.int8_max_abs_error"] = f"{float(error):.6f}"
        meta["shoal.quantize"] = "int8"
        del fp32, int8
        # quantize_dynamic drops the fp32 model's metadata: carry it over, with the measurement.
        _set_metadata(partial, meta)


def _wrapper(model: Any, input_names: list[str], kind: str, torch: Any) -> Any:
    """A torch module over a sentence-transformers model that takes the tokenizer's tensors.

    Defined here, not at module level, so that importing this file needs no torch.
    """

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            # What CrossEncoder.predict applies to the logits (Sigmoid for one label, unless
            # the model's config names another): in the graph, so the scores are predict's.
            self.activation = getattr(model, "activation_fn", None) if kind == "cross" else None

        def forward(self, *tensors: Any) -> Any:
            features = dict(zip(input_names, tensors, strict=True))
            features["modality"] = "text"
            output = self.model(features)
            if kind == "embed":
                return output["sentence_embedding"]
            scores = output["scores"].float()
            if self.activation is not None:
                scores = self.activation(scores)
            return scores.reshape(-1)

    return Wrapper().eval()


def _max_length(transformer: Any) -> int:
    """Where sentence-transformers truncates: its max_seq_length, at most what the model takes."""
    limit = getattr(transformer.auto_model.config, "max_position_embeddings", None)
    length = transformer.max_seq_length
    if length is None or (limit is not None and length > limit):
        # An unset or huge tokenizer limit: torch would fail past the position embeddings, so
        # truncate there instead.
        length = limit
    if length is None:
        raise ValueError("the model declares no maximum sequence length")
    return int(length)


def _set_metadata(path: Path, metadata: dict[str, str]) -> None:
    import onnx

    model = onnx.load(str(path))
    del model.metadata_props[:]
    for key, value in sorted(metadata.items()):
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(model, str(path))


def _remove_stale_partials(entry: Path) -> None:
    """Delete private files that a killed exporter left (write_once names them .NAME.PID.*.part)."""
    for partial in entry.glob(".*.part"):
        match = re.match(r"^\.[^/]+?\.(\d+)\.[0-9a-f]+\.part$", partial.name)
        if match is None or int(match.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            partial.unlink(missing_ok=True)  # its writer is gone: nobody will finish it
        except PermissionError:
            pass  # alive, another user's


def _reject_adapters(adapters: list[str | None] | None) -> None:
    if adapters and any(a is not None for a in adapters):
        names = ", ".join(sorted({a for a in adapters if a is not None}))
        raise ValueError(f"the onnx runtime has no LoRA adapters (asked for {names})")


def _reorder(order: list[int], values: np.ndarray, counts: Sequence[int]) -> tuple:
    result = np.empty_like(values)
    token_counts = [0] * len(order)
    for position, original in enumerate(order):
        result[original] = values[position]
        token_counts[original] = int(counts[position])
    return result, token_counts


# -- the two runtimes -----------------------------------------------------------------------


class OnnxEmbeddingRuntime:
    """A sentence-transformers embedder on ONNX Runtime (implements EmbeddingRuntime)."""

    simulated = False

    def __init__(self, name: str, source: str, options: dict[str, Any]) -> None:
        self._model = _OnnxModel(name, source, options, "embed")
        meta = self._model.metadata
        self.name = name
        self.dimensions = int(meta["shoal.dimensions"])
        self.quantize = self._model.quantize
        self.threads = self._model.threads
        self.pooling = meta.get("shoal.pooling") or None
        self.normalize = meta.get("shoal.normalize") == "1"
        self.model_path = self._model.path
        self.exported = self._model.exported
        self.quantized = self._model.quantized
        # Mean cosine of int8 to fp32 vectors over CHECK_SENTENCES (None for fp32); the worst
        # sentence's in int8_cosine_min.
        cosine = meta.get("shoal.int8_cosine")
        self.int8_cosine: float | None = float(cosine) if cosine else None
        worst = meta.get("shoal.int8_cosine_min")
        self.int8_cosine_min: float | None = float(worst) if worst else None

    def embed(self, texts: list[str], adapters: list[str | None] | None = None) -> EmbedOutput:
        """Embed a batch; texts past the model's max_seq_length are truncated, as torch does."""
        _reject_adapters(adapters)
        _check_texts(texts)
        if not texts:
            return EmbedOutput(np.zeros((0, self.dimensions), dtype=np.float32), [])
        # Sorted by length, as sentence-transformers' encode does, so padding stays small.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]), reverse=True)
        features = self._model.tokenize([texts[i] for i in order])
        counts = features["attention_mask"].sum(axis=1).tolist()
        vectors = self._model.run(features).astype(np.float32, copy=False)
        vectors, token_counts = _reorder(order, vectors, counts)
        return EmbedOutput(vectors, token_counts)

    def close(self) -> None:
        self._model.close()


class OnnxCrossEncoderRuntime:
    """A sentence-transformers CrossEncoder on ONNX Runtime; scores equal its `predict`."""

    simulated = False

    def __init__(self, name: str, source: str, options: dict[str, Any]) -> None:
        self._model = _OnnxModel(name, source, options, "cross")
        meta = self._model.metadata
        self.name = name
        self.quantize = self._model.quantize
        self.threads = self._model.threads
        self.model_path = self._model.path
        self.exported = self._model.exported
        self.quantized = self._model.quantized
        # A cosine between score lists says little: int8 reports its largest score error over
        # CHECK_PAIRS instead, and int8_cosine stays None.
        self.int8_cosine: float | None = None
        error = meta.get("shoal.int8_max_abs_error")
        self.int8_max_abs_error: float | None = float(error) if error else None

    def score(self, pairs: list[tuple[str, str]]) -> ScoreOutput:
        """Score a batch of (query, document) pairs; over-long pairs are truncated."""
        for pair in pairs:
            if not (isinstance(pair, tuple | list) and len(pair) == 2):
                raise ValueError("each pair is (query, document)")
            _check_texts(list(pair))
        if not pairs:
            return ScoreOutput(np.zeros(0, dtype=np.float32), [])
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
        features = self._model.tokenize([pairs[i][0] for i in order], [pairs[i][1] for i in order])
        counts = features["attention_mask"].sum(axis=1).tolist()
        scores = self._model.run(features).astype(np.float32, copy=False).reshape(len(pairs))
        scores, token_counts = _reorder(order, scores, counts)
        return ScoreOutput(scores, token_counts)

    def close(self) -> None:
        self._model.close()


def _check_texts(texts: Sequence[Any]) -> None:
    if not isinstance(texts, list | tuple):
        raise ValueError("texts must be a list of strings")
    for text in texts:
        if not isinstance(text, str):
            raise ValueError(f"texts must be strings, not {type(text).__name__}")
