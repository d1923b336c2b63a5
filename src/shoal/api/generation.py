"""Completions and chat: OpenAI's request and response shapes, their parse and encode.

This is where a generation request body is decoded and validated (once) and where responses
and stream chunks are encoded. Stop strings are applied by worker/tasks/text.py; the
continuous-batching scheduler feeds both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from shoal.api.errors import ApiError, invalid_body
from shoal.protocol import Endpoint, encode_json
from shoal.runtimes.base import SamplingParams

MAX_STOP_SEQUENCES = 4
FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, slots=True)
class ChatTurn:
    """One validated chat message: its role and its text."""

    role: str  # system, developer, user or assistant
    content: str


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields completions and chat share. Unknown fields are ignored, as OpenAI's API does."""

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionsRequest(_SamplingFields, kw_only=True):
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


_decode_completions = msgspec.json.Decoder(CompletionsRequest).decode
_decode_chat = msgspec.json.Decoder(ChatRequest).decode

CHAT_ROLES = ("system", "developer", "user", "assistant")


@dataclass(slots=True)
class GenerationJob:
    """A validated generation request: what to prompt with and when to stop."""

    endpoint: Endpoint
    model: str
    max_tokens: int | None  # None: until end of generation or the context is full
    stops: list[str]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    prompt: str | None = None  # completions
    turns: list[ChatTurn] = field(default_factory=list)  # chat


def parse_generation_request(endpoint: Endpoint, body: bytes) -> GenerationJob:
    """Decode and validate one request; raises ApiError(400) naming the bad parameter."""
    try:
        if endpoint is Endpoint.COMPLETIONS:
            request: CompletionsRequest | ChatRequest = _decode_completions(body)
        else:
            request = _decode_chat(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as err:
        raise invalid_body(err) from None
    job = GenerationJob(
        endpoint=endpoint,
        model=request.model,
        max_tokens=_max_tokens(request),
        stops=_stops(request.stop),
        sampling=_sampling(request),
        stream=request.stream,
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
    )
    if isinstance(request, CompletionsRequest):
        _check_completions_only(request)
        job.prompt = _prompt(request.prompt)
    else:
        _check_chat_only(request)
        job.turns = _turns(request.messages)
    return job


def _unsupported(param: str, detail: str) -> ApiError:
    return ApiError(400, f"'{param}' {detail}", param=param, code="unsupported_parameter")


def _max_tokens(request: CompletionsRequest | ChatRequest) -> int | None:
    if isinstance(request, ChatRequest):
        value = request.max_completion_tokens or request.max_tokens
        name = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
    else:
        value, name = (16 if request.max_tokens is None else request.max_tokens), "max_tokens"
    if value is not None and value < 1:
        raise ApiError(400, f"'{name}' must be at least 1 (got {value})", param=name)
    return value


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_SEQUENCES:
        raise ApiError(400, f"'stop' holds at most {MAX_STOP_SEQUENCES} sequences", param="stop")
    if any(not s for s in stops):
        raise ApiError(400, "'stop' sequences must not be empty", param="stop")
    return stops


def _sampling(request: CompletionsRequest | ChatRequest) -> SamplingParams:
    if not 0.0 <= request.temperature <= 2.0:
        raise ApiError(400, "'temperature' must be between 0 and 2", param="temperature")
    if not 0.0 < request.top_p <= 1.0:
        raise ApiError(400, "'top_p' must be greater than 0 and at most 1", param="top_p")
    if request.n != 1:
        raise _unsupported("n", f"must be 1: one choice per request is supported (got {request.n})")
    if request.presence_penalty or request.frequency_penalty:
        param = "presence_penalty" if request.presence_penalty else "frequency_penalty"
        raise _unsupported(param, "is not supported yet; leave it at 0")
    if request.logit_bias:
        raise _unsupported("logit_bias", "is not supported yet")
    return SamplingParams(request.temperature, request.top_p, request.seed)


def _check_completions_only(request: CompletionsRequest) -> None:
    if request.logprobs is not None:
        raise _unsupported("logprobs", "is not supported yet")
    if request.echo:
        raise _unsupported("echo", "is not supported yet")
    if request.suffix is not None:
        raise _unsupported("suffix", "is not supported by this model")
    if request.best_of not in (None, 1):
        raise _unsupported("best_of", "must be 1")


def _check_chat_only(request: ChatRequest) -> None:
    if request.logprobs or request.top_logprobs is not None:
        raise _unsupported("logprobs", "is not supported yet")
    if request.tools:
        raise _unsupported("tools", "(function calling) is not supported by this model")
    if request.response_format and request.response_format.get("type", "text") != "text":
        raise _unsupported("response_format", "must be text")


def _prompt(prompt: str | list[Any]) -> str:
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise ApiError(
                400,
                "'prompt' must be a string or a list of one string "
                "(several prompts or token ids are not supported)",
                param="prompt",
            )
        prompt = prompt[0]
    if not prompt:
        raise ApiError(400, "'prompt' must not be empty", param="prompt")
    return prompt


def _turns(messages: list[ChatMessage]) -> list[ChatTurn]:
    if not messages:
        raise ApiError(400, "'messages' must not be empty", param="messages")
    turns = []
    for i, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise ApiError(
                400,
                f"'messages[{i}].role' must be one of {', '.join(CHAT_ROLES)} "
                f"(got {message.role!r})",
                param="messages",
            )
        turns.append(ChatTurn(message.role, _content_text(i, message.content)))
    return turns


def _content_text(index: int, content: str | list[ContentPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise ApiError(
                400,
                f"'messages[{index}].content' may hold text parts only (got {part.type!r})",
                param="messages",
            )
        texts.append(part.text)
    return "".join(texts)


# -- responses --------------------------------------------------------------------------


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(msgspec.Struct, omit_defaults=False):
    text: str
    index: int = 0
    logprobs: None = None
    finish_reason: FinishReason | None = None


class AssistantMessage(msgspec.Struct):
    content: str
    role: str = "assistant"


class ChatChoice(msgspec.Struct, omit_defaults=False):
    message: AssistantMessage
    index: int = 0
    logprobs: None = None
    finish_reason: FinishReason | None = None


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct, omit_defaults=False):
    delta: Delta
    index: int = 0
    logprobs: None = None
    finish_reason: FinishReason | None = None


class CompletionBody(msgspec.Struct, omit_defaults=False):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | None = None


class ChatBody(msgspec.Struct, omit_defaults=False):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    object: str = "chat.completion"
    usage: Usage | None = None


class ChatChunkBody(msgspec.Struct, omit_defaults=False):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None = None


class ResponseEncoder:
    """Encodes one request's response, or its stream chunks, in OpenAI's shapes."""

    def __init__(self, job: GenerationJob, request_id: str) -> None:
        self.job = job
        self.chat = job.endpoint is Endpoint.CHAT_COMPLETIONS
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{request_id}"
        self.created = int(time.time())

    def complete(self, text: str, finish: FinishReason, usage: Usage) -> bytes:
        """The whole response of a request that was not streamed."""
        model = self.job.model
        if self.chat:
            choice = ChatChoice(AssistantMessage(text), finish_reason=finish)
            return encode_json(ChatBody(self.id, self.created, model, [choice], usage=usage))
        choice_c = CompletionChoice(text, finish_reason=finish)
        return encode_json(CompletionBody(self.id, self.created, model, [choice_c], usage=usage))

    def first_chunk(self) -> bytes | None:
        """Chat streams open with the assistant's role, before any text."""
        if not self.chat:
            return None
        return self._chunk(Delta(role="assistant", content=""), None)

    def text_chunk(self, text: str) -> bytes:
        return self._chunk(Delta(content=text) if self.chat else None, None, text)

    def finish_chunk(self, finish: FinishReason) -> bytes:
        return self._chunk(Delta() if self.chat else None, finish, "")

    def usage_chunk(self, usage: Usage) -> bytes:
        """The last chunk: no choices, the request's usage (as with include_usage)."""
        body_type = ChatChunkBody if self.chat else CompletionBody
        return encode_json(body_type(self.id, self.created, self.job.model, [], usage=usage))

    def _chunk(self, delta: Delta | None, finish: FinishReason | None, text: str = "") -> bytes:
        model = self.job.model
        if delta is not None:
            choice = ChatChunkChoice(delta, finish_reason=finish)
            return encode_json(ChatChunkBody(self.id, self.created, model, [choice]))
        choice_c = CompletionChoice(text, finish_reason=finish)
        return encode_json(CompletionBody(self.id, self.created, model, [choice_c]))
