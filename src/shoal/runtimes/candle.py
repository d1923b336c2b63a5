"""`candle`: BERT embedding models on Hugging Face Candle, through its Python bindings.

Where the bindings come from: the `candle-nn` 0.4.2 wheel on PyPI (the `candle` extra; pinned
by version and sha256 in `requirements/candle.txt`). Despite its name it holds the `candle`
Python module built from Candle's `candle-pyo3` crate (`candle.models.bert`,
`candle.utils.load_safetensors`), an abi3 build from March 2024 without MKL. Hugging Face does
not publish these bindings on PyPI itself: it is an old, unofficially published build, so its
outputs are checked against sentence-transformers by `tests/test_candle.py` (cosine >= 0.999
per row on the default model) rather than trusted.

What it runs: the model's own `config.json` and `model.safetensors` in candle's `BertModel`
(no pooling layer), every weight the model needs loaded strictly; tokenization with the
`tokenizers` package from the model's `tokenizer.json`; truncation, pooling and normalization
as the model's sentence-transformers configuration says (`sentence_bert_config.json`,
`modules.json`, the pooling module's `config.json`, a `Normalize` module). Only what candle's
`BertModel` computes exactly is accepted: `model_type` "bert", absolute positions, a `gelu`
(erf) or `relu` activation; a model outside that (RoBERTa, DistilBERT, Dense modules, other
pooling modes) is refused at load with the reason, never served with different vectors.

Options (deployment `--option K=V`):
  threads   CPU threads (else `$SHOAL_THREADS`, else `$RAYON_NUM_THREADS`, else every core);
            see `_set_threads` for how candle reads it.

LoRA adapters are not supported: any adapter name is a ValueError.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from shoal.runtimes.base import EmbedOutput
from shoal.runtimes.model_files import resolve_source

# Pooling modes computed here, by their sentence-transformers names; in the legacy boolean
# form of the pooling config (`pooling_mode_<x>`) they appear in this order, which is also the
# order sentence-transformers concatenates them in.
LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
POOLING_MODES = frozenset({"cls", "max", "mean", "mean_sqrt_len_tokens"})
# candle's bert.py maps every activation but "gelu" to relu without a word, and its F.gelu is
# the exact (erf) GELU that BERT's "gelu" means; the tanh approximations ("gelu_new", ...)
# would silently differ, so only these two are accepted.
ACTIVATIONS = frozenset({"gelu", "relu"})
# Weights a BERT checkpoint may carry that an embedder does not use: the pooler (candle's
# model is built without it, as sentence-transformers ignores it) and pre-training heads.
UNUSED_PREFIXES = ("pooler.", "cls.")
# A buffer, not a weight: candle makes it from the config when the checkpoint lacks it.
OPTIONAL_KEYS = frozenset({"embeddings.position_ids"})


@dataclasses.dataclass(frozen=True, slots=True)
class SentenceTransformerLayout:
    """What the model's sentence-transformers configuration says about its pipeline."""

    transformer_dir: Path
    pooling: tuple[str, ...]
    normalize: bool
    max_seq_length: int | None
    do_lower_case: bool


def read_layout(root: Path) -> SentenceTransformerLayout:
    """The pipeline of the sentence-transformers model at `root`, as its files declare it.

    Without modules.json the directory is a plain transformer, which sentence-transformers
    loads with mean pooling and no normalization; this does the same. Raises ValueError for a
    module this runtime does not compute.
    """
    modules_file = root / "modules.json"
    transformer_dir, pooling_dir, normalize = root, None, False
    if modules_file.exists():
        modules = json.loads(modules_file.read_text())
        for module in modules:
            kind = str(module.get("type", "")).rsplit(".", 1)[-1]
            path = root / str(module.get("path", ""))
            if kind == "Transformer":
                transformer_dir = path
            elif kind == "Pooling":
                pooling_dir = path
            elif kind == "Normalize":
                normalize = True
            else:
                raise ValueError(
                    f"the candle runtime computes Transformer, Pooling and Normalize modules; "
                    f"this model also has {module.get('type')!r}"
                )
        order = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
        if order[:1] != ["Transformer"] or (normalize and order[-1] != "Normalize"):
            raise ValueError(f"unexpected module order in modules.json: {order}")
    pooling: tuple[str, ...] = ("mean",)
    if pooling_dir is not None:
        pooling = _pooling_modes(json.loads((pooling_dir / "config.json").read_text()))
    st_config = _read_json(transformer_dir / "sentence_bert_config.json")
    if not st_config and transformer_dir != root:
        st_config = _read_json(root / "sentence_bert_config.json")
    max_seq_length = st_config.get("max_seq_length")
    return SentenceTransformerLayout(
        transformer_dir=transformer_dir,
        pooling=pooling,
        normalize=normalize,
        max_seq_length=int(max_seq_length) if max_seq_length else None,
        do_lower_case=bool(st_config.get("do_lower_case", False)),
    )


def _pooling_modes(config: dict[str, Any]) -> tuple[str, ...]:
    mode = config.get("pooling_mode")
    if mode is None:
        modes = tuple(name for key, name in LEGACY_POOLING_KEYS.items() if config.get(key))
        modes = modes or ("mean",)  # sentence-transformers' default when none is set
    else:
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    unsupported = [m for m in modes if m not in POOLING_MODES]
    if unsupported:
        raise ValueError(
            f"the candle runtime pools with {', '.join(sorted(POOLING_MODES))}; "
            f"this model asks for {', '.join(unsupported)}"
        )
    if config.get("include_prompt") is False:
        raise ValueError("the candle runtime does not support include_prompt=false pooling")
    return modes


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _set_threads(options: dict[str, Any]) -> int:
    """Fix how many CPU threads candle uses in this process; returns the number.

    candle has no thread-count API: on CPU it reads `RAYON_NUM_THREADS` (candle-core's
    `utils::get_num_threads`, else every logical core). It reads the variable at each matmul,
    to split the gemm into that many rayon tasks, and rayon sizes its global pool from the same
    variable on first use. So the variable is set here, before this model runs anything: the
    pool then has that many threads and every matmul asks for that many (measured: 1024x1024
    matmuls take twice as long with 1 as with 2 on 2 cores). Without a setting candle takes
    every core, and several workers on one machine would fight over them, as with torch.
    The variable is per process: a second candle model in the same worker with another
    `threads` changes the matmul split for both, while the pool keeps its first size.
    """
    threads = int(
        options.get("threads")
        or os.environ.get("SHOAL_THREADS")
        or os.environ.get("RAYON_NUM_THREADS")
        or 0
    )
    if threads <= 0:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    return threads


class CandleEmbeddingRuntime:
    """A BERT sentence-transformers model run by candle (see the module docstring)."""

    simulated = False

    def __init__(self, name: str, source: str, options: dict[str, Any]) -> None:
        self.threads = _set_threads(options)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        try:
            import candle
            import candle.utils
            from candle.models.bert import BertModel, Config
        except ImportError as err:
            raise ImportError(
                "the candle runtime needs the `candle` extra: "
                "pip install --require-hashes --no-deps -r requirements/candle.txt "
                f'&& pip install -e ".[candle]" ({err})'
            ) from err
        from tokenizers import Tokenizer, normalizers

        self._candle = candle
        self.name = name
        root = resolve_source(source)
        self.layout = read_layout(root)
        model_dir = self.layout.transformer_dir
        config = json.loads((model_dir / "config.json").read_text())
        _check_config(config)
        fields = {f.name for f in dataclasses.fields(Config)}
        self._config = Config(**{k: v for k, v in config.items() if k in fields})
        self.model = BertModel(self._config, add_pooling_layer=False)
        self.unused_weights = _load_weights(
            self.model, candle.utils.load_safetensors(str(model_dir / "model.safetensors"))
        )
        _flatten_linears(self.model)

        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        padding = self.tokenizer.padding or {}
        # tokenizer.json often fixes padding to a length (128 here) and truncation to another:
        # pad to the batch's longest instead (the mask keeps padding out of the vectors), and
        # truncate where sentence-transformers does.
        self.tokenizer.no_padding()
        self.tokenizer.enable_padding(
            pad_id=int(padding.get("pad_id", config.get("pad_token_id") or 0)),
            pad_type_id=int(padding.get("pad_type_id", 0)),
            pad_token=str(padding.get("pad_token", "[PAD]")),
        )
        self.max_seq_length = self._max_seq_length(model_dir)
        self.tokenizer.no_truncation()
        self.tokenizer.enable_truncation(self.max_seq_length)
        if self.layout.do_lower_case:
            # As sentence-transformers does: lowercase in the normalizer, before everything else.
            current = self.tokenizer.normalizer
            parts = [normalizers.Lowercase()] + ([current] if current is not None else [])
            self.tokenizer.normalizer = normalizers.Sequence(parts)
        self.dimensions = int(self._config.hidden_size) * len(self.layout.pooling)

    def _max_seq_length(self, model_dir: Path) -> int:
        """sentence-transformers' truncation length: sentence_bert_config.json's
        `max_seq_length`, else the tokenizer's `model_max_length`; never past the position
        table (candle would fail on it, where sentence-transformers caps it too)."""
        positions = int(self._config.max_position_embeddings)
        length = self.layout.max_seq_length
        if length is None:
            length = _read_json(model_dir / "tokenizer_config.json").get("model_max_length")
        return min(int(length), positions) if length else positions

    def embed(self, texts: list[str], adapters: list[str | None] | None = None) -> EmbedOutput:
        """Embed a batch in one forward pass, padded to its longest text."""
        named = sorted({a for a in adapters or () if a is not None})
        if named:
            raise ValueError(f"the candle runtime has no LoRA adapters (asked for {named})")
        if not texts:
            return EmbedOutput(np.zeros((0, self.dimensions), dtype=np.float32), [])
        if not all(isinstance(text, str) for text in texts):
            raise ValueError("every input must be a string")
        candle = self._candle
        encodings = self.tokenizer.encode_batch(texts)
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        type_ids = np.array([e.type_ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        counts = mask.sum(axis=1)
        hidden, _ = self.model.forward(
            candle.Tensor(ids), candle.Tensor(type_ids), candle.Tensor(mask)
        )
        # Pool inside candle: only (batch, dimensions) floats cross into Python.
        pooled = [self._pool(mode, hidden, mask, counts) for mode in self.layout.pooling]
        vectors = np.concatenate(pooled, axis=1).astype(np.float32, copy=False)
        if self.layout.normalize:
            # torch.nn.functional.normalize: x / max(|x|, 1e-12)
            norms = np.linalg.norm(vectors, axis=1, keepdims=True)
            vectors = vectors / np.maximum(norms, 1e-12)
        return EmbedOutput(vectors, [int(c) for c in counts])

    def _pool(self, mode: str, hidden: Any, mask: np.ndarray, counts: np.ndarray) -> np.ndarray:
        candle = self._candle
        if mode == "cls":
            # Right padding: the first real token is position 0.
            return np.asarray(hidden.narrow(1, 0, 1).squeeze(1).values(), dtype=np.float32)
        mask3 = candle.Tensor(mask.astype(np.float32)[:, :, None])
        if mode == "max":
            keep = candle.Tensor(mask.astype(np.uint8)[:, :, None]).to_dtype("u8")
            keep = keep.broadcast_as(hidden.shape)
            floor = candle.tensor(-math.inf).broadcast_as(hidden.shape)
            best = keep.where_cond(hidden, floor).max_keepdim(1).squeeze(1)
            return np.asarray(best.values(), dtype=np.float32)
        summed = hidden.broadcast_mul(mask3).sum_keepdim(1).squeeze(1)
        total = np.asarray(summed.values(), dtype=np.float32)
        denominator = np.maximum(counts.astype(np.float32), 1e-9)[:, None]
        if mode == "mean_sqrt_len_tokens":
            denominator = np.sqrt(denominator)
        return total / denominator

    def close(self) -> None:
        """Drop the weights (candle frees them with the last reference)."""
        self.model = None


def _check_config(config: dict[str, Any]) -> None:
    """Refuse a model candle's `BertModel` would compute differently from transformers."""
    problems = []
    if config.get("model_type") != "bert":
        problems.append(f"model_type {config.get('model_type')!r} (only 'bert')")
    if config.get("position_embedding_type", "absolute") != "absolute":
        problems.append(f"position_embedding_type {config.get('position_embedding_type')!r}")
    if config.get("hidden_act", "gelu") not in ACTIVATIONS:
        problems.append(f"hidden_act {config.get('hidden_act')!r}")
    if config.get("is_decoder") or config.get("add_cross_attention"):
        problems.append("a decoder")
    if problems:
        raise ValueError(
            f"the candle runtime runs plain BERT encoders; this model has: {', '.join(problems)}"
        )


def _load_weights(model: Any, weights: dict[str, Any]) -> list[str]:
    """Load every weight `model` needs from `weights`, strictly; returns the names left over.

    Checkpoints saved from a task model prefix the encoder with `bert.`. Left over may be only
    the pooler and pre-training heads; a missing weight, or an unknown one (a sign of another
    architecture), is a ValueError naming them.
    """
    if weights and all(k.startswith("bert.") or k.startswith("cls.") for k in weights):
        weights = {k.removeprefix("bert."): v for k, v in weights.items()}
    expected = set(model.state_dict())
    unused = sorted(set(weights) - expected)
    unknown = [k for k in unused if not k.startswith(UNUSED_PREFIXES)]
    missing = sorted(expected - set(weights) - OPTIONAL_KEYS)
    if missing or unknown:
        raise ValueError(
            "model.safetensors does not fit candle's BertModel: "
            f"missing {missing or 'none'}; unexpected {unknown or 'none'}"
        )
    float_types = {"f16", "bf16", "f64"}
    used = {}
    for key in expected & set(weights):
        tensor = weights[key]
        # CPU inference in f32, as the torch runtime runs these models.
        if str(tensor.dtype).lower() in float_types:
            tensor = tensor.to_dtype("f32")
        used[key] = tensor
    if (OPTIONAL_KEYS & expected) - set(used):
        # Keep candle's own buffer for what the checkpoint lacks, then load strictly.
        state = model.state_dict()
        used.update({k: state[k] for k in OPTIONAL_KEYS & expected if k not in used})
    model.load_state_dict(used, strict=True)
    return unused


def _flatten_linears(module: Any) -> None:
    """Make every `Linear` under `module` one 2-D matmul, with the same result.

    candle-pyo3's `Linear.forward` multiplies a (batch, tokens, in) input by the weight
    broadcast to (batch, out, in): a batched gemm of `batch` small products, half as fast on
    this CPU as the single (batch * tokens, in) x (in, out) product computed here (measured:
    0.69 s against 1.38 s for a batch of 64 short sentences on 2 threads, vectors bit-equal).
    Called after the weights are loaded: it keeps a transposed view of each one.
    """
    from candle.nn import Linear

    for child in module._modules.values():
        if isinstance(child, Linear):
            child.forward = _flat_linear_forward(child.weight.t(), child.bias)
        elif child is not None:
            _flatten_linears(child)


def _flat_linear_forward(weight_t: Any, bias: Any) -> Any:
    def forward(x: Any) -> Any:
        *leading, features = x.shape
        y = x.reshape((math.prod(leading), features)).matmul(weight_t)
        if bias is not None:
            y = y.broadcast_add(bias)
        return y.reshape((*leading, y.shape[-1]))

    return forward
