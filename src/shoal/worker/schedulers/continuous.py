"""Continuous batching by pulling: a generative worker keeps its decode slots full.

The runtime decodes up to S sequences together, one token each per step. Between steps the
scheduler ends the sequences that finished (stop string, token limit, end of generation,
cancellation, deadline), answers them, and starts pulled requests in the freed slots, so new
requests join the running batch without waiting for it to drain. The fill loop asks the queue
for at most as many requests as there are free slots: a worker never holds queued work it
has no slot for, so another worker can take it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from shoal.api.errors import ApiError
from shoal.api.generation import (
    FinishReason,
    GenerationJob,
    ResponseEncoder,
    Usage,
    parse_generation_request,
)
from shoal.protocol import Endpoint, Task, now_ms
from shoal.runtimes.base import GenerationRuntime
from shoal.worker.items import Reply, WorkItem
from shoal.worker.schedulers.base import SchedulerBase, SchedulerContext
from shoal.worker.tasks.chat_template import render_chat
from shoal.worker.tasks.text import TextAssembler

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Admission:
    """A pulled request given a slot; the engine thread renders and tokenizes its prompt."""

    item: WorkItem
    job: GenerationJob
    slot: int
    prompt_tokens: int = 0
    stops: list[str] = field(default_factory=list)
    error: ApiError | None = None


@dataclass(slots=True)
class StepToken:
    slot: int
    token_bytes: bytes
    end_of_generation: bool


@dataclass(slots=True)
class Sequence:
    """A request being decoded in a slot."""

    item: WorkItem
    job: GenerationJob
    slot: int
    prompt_tokens: int
    encoder: ResponseEncoder
    assembler: TextAssembler
    completion_tokens: int = 0
    next_chunk: int = 0
    cancelled: bool = False

    def usage(self) -> Usage:
        total = self.prompt_tokens + self.completion_tokens
        return Usage(self.prompt_tokens, self.completion_tokens, total)


class ContinuousScheduler(SchedulerBase):
    """Runs pulled completions and chat requests with continuous batching (a `Scheduler`)."""

    def __init__(self, ctx: SchedulerContext, runtime: GenerationRuntime) -> None:
        super().__init__(ctx, Task.GENERATE)
        self._runtime = runtime
        self._active: dict[int, Sequence] = {}  # by slot
        # The batch budget (profiled, or --max-batch-items) caps the sequences decoded at once.
        budget = ctx.settings.max_batch_items
        self._slots = min(runtime.max_sequences, budget) if budget > 0 else runtime.max_sequences
        self._free_slots = list(range(self._slots - 1, -1, -1))
        self._to_remove: list[int] = []  # slots whose sequences ended, freed at the next step
        # Admitted and in their first step: neither pending nor active until it returns.
        self._starting: list[Admission] = []

    @property
    def slots(self) -> int:
        """Sequences decoded together at most."""
        return self._slots

    # -- Scheduler interface ------------------------------------------------------------

    def room(self) -> int:
        return len(self._free_slots) - len(self._pending)

    def held(self) -> list[WorkItem]:
        return [
            *(s.item for s in self._active.values()),
            *(a.item for a in self._starting),
            *self._pending,
        ]

    def cancel(self, request_id: str) -> None:
        for sequence in self._active.values():
            if sequence.item.request_id == request_id:
                sequence.cancelled = True
                return
        self._remember_cancel(request_id)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._end_cancelled_and_expired()
            admissions = await self._admit()
            if not self._active and not admissions:
                if not await self._wait_for_work():
                    return
                continue
            removals, self._to_remove = self._to_remove, []
            self._starting = admissions
            self._ctx.busy.start()
            try:
                tokens = await loop.run_in_executor(
                    self._ctx.executor, self._engine_step, removals, admissions
                )
            except Exception:
                # A broken step leaves every sequence in doubt: end them with an error;
                # their messages are acked so the same poison is not redelivered forever.
                log.exception("decode step failed")
                self._ctx.busy.stop()
                self._starting = []
                await self._fail_all(admissions)
                continue
            busy_s = self._ctx.busy.stop()
            await self._start_admitted()
            self._account_batch(busy_s, len(self._active))
            await self._advance(tokens)

    # -- between steps --------------------------------------------------------------------

    async def _admit(self) -> list[Admission]:
        """Give pulled requests free slots; requests that cannot run are answered now."""
        admissions = []
        while self._pending and self._free_slots:
            item = self._pending.popleft()
            if self._take_cancel(item):
                await self._drop_cancelled(item)
                continue
            if await self._reject_if_unservable(item):
                continue
            try:
                job = parse_generation_request(item.endpoint or Endpoint.COMPLETIONS, item.body)
            except ApiError as err:
                await self._answer(item, Reply.from_error(err))
                continue
            admissions.append(Admission(item, job, self._free_slots.pop()))
            self._observe_queue_wait(item)
        return admissions

    async def _start_admitted(self) -> None:
        """Their first step done: the admitted requests become running sequences."""
        while self._starting:
            admission = self._starting.pop(0)
            item, job = admission.item, admission.job
            if admission.error is not None:
                self._free_slots.append(admission.slot)
                await self._answer(item, Reply.from_error(admission.error))
                continue
            sequence = Sequence(
                item=item,
                job=job,
                slot=admission.slot,
                prompt_tokens=admission.prompt_tokens,
                encoder=ResponseEncoder(job, item.request_id),
                assembler=TextAssembler(admission.stops),
            )
            self._active[admission.slot] = sequence
            # A cancel that came while its first step ran found it neither pending nor active:
            # it was remembered, and is met here (ended before the next step).
            sequence.cancelled = self._take_cancel(item)
            if sequence.cancelled:
                continue
            if item.stream and (first := sequence.encoder.first_chunk()) is not None:
                await self._send_chunk(sequence, first)
        self._report_running()

    async def _advance(self, tokens: list[StepToken]) -> None:
        for token in tokens:
            sequence = self._active.get(token.slot)
            if sequence is None or sequence.cancelled:
                continue
            sequence.completion_tokens += 1
            self._ctx.counters.tokens_generated += 1
            self._ctx.metrics.tokens.inc()
            if sequence.completion_tokens == 1:
                waited_ms = max(0, now_ms() - sequence.item.sent_ms)
                self._ctx.metrics.first_token.observe(waited_ms / 1000)
            text = "" if token.end_of_generation else sequence.assembler.add(token.token_bytes)
            if text and sequence.item.stream:
                await self._send_chunk(sequence, sequence.encoder.text_chunk(text))
            finish = self._finish_reason(sequence, token.end_of_generation)
            if finish is not None:
                await self._finish(sequence, finish)

    def _finish_reason(self, sequence: Sequence, end_of_generation: bool) -> FinishReason | None:
        if end_of_generation or sequence.assembler.stopped:
            return "stop"
        limit = sequence.job.max_tokens
        if limit is not None and sequence.completion_tokens >= limit:
            return "length"
        if sequence.prompt_tokens + sequence.completion_tokens >= self._runtime.context_length:
            return "length"
        return None

    async def _finish(self, sequence: Sequence, finish: FinishReason) -> None:
        outbox, item = self._ctx.outbox, sequence.item
        rest = sequence.assembler.finish()
        if item.stream:
            if rest:
                await self._send_chunk(sequence, sequence.encoder.text_chunk(rest))
            await self._send_chunk(sequence, sequence.encoder.finish_chunk(finish))
            usage = sequence.encoder.usage_chunk(sequence.usage())
            await outbox.last_chunk(item, sequence.next_chunk, Reply(200, usage))
        else:
            body = sequence.encoder.complete(sequence.assembler.text, finish, sequence.usage())
            await outbox.reply(item, Reply(200, body))
        await self._release(sequence)

    async def _end_cancelled_and_expired(self) -> None:
        now = now_ms()
        for sequence in list(self._active.values()):
            if sequence.cancelled:
                await self._release(sequence, cancelled=True)
            elif sequence.item.expired(now):
                error = ApiError(504, "The request's deadline passed during generation")
                await self._end_with_error(sequence, error)

    async def _end_with_error(self, sequence: Sequence, error: ApiError) -> None:
        if sequence.item.stream and sequence.next_chunk:
            await self._ctx.outbox.last_chunk(
                sequence.item, sequence.next_chunk, Reply.from_error(error)
            )
        else:
            await self._ctx.outbox.reply(sequence.item, Reply.from_error(error))
        await self._release(sequence)

    async def _release(self, sequence: Sequence, *, cancelled: bool = False) -> None:
        del self._active[sequence.slot]
        self._to_remove.append(sequence.slot)
        self._free_slots.append(sequence.slot)
        if cancelled:
            await self._drop_cancelled(sequence.item)
        else:
            await self._ack(sequence.item)
        self._report_running()
        self._ctx.room_changed.set()

    async def _fail_all(self, admissions: list[Admission]) -> None:
        error = ApiError(500, "The runtime failed during generation")
        for admission in admissions:
            self._free_slots.append(admission.slot)
            await self._answer(admission.item, Reply.from_error(error))
        for sequence in list(self._active.values()):
            await self._end_with_error(sequence, error)

    async def _send_chunk(self, sequence: Sequence, body: bytes) -> None:
        await self._ctx.outbox.chunk(sequence.item, sequence.next_chunk, body)
        sequence.next_chunk += 1

    def _report_running(self) -> None:
        counters = self._ctx.counters
        counters.running_sequences = len(self._active)

    # -- in the engine thread ----------------------------------------------------------------

    def _engine_step(self, removals: list[int], admissions: list[Admission]) -> list[StepToken]:
        runtime = self._runtime
        for slot in removals:
            runtime.remove_sequence(slot)
        for admission in admissions:
            try:
                self._prepare(admission)
            except ApiError as err:
                admission.error = err
        tokens = runtime.step() if runtime_has_work(admissions, self._active) else {}
        return [
            StepToken(slot, runtime.token_bytes(token), runtime.is_end_of_generation(token))
            for slot, token in tokens.items()
        ]

    def _prepare(self, admission: Admission) -> None:
        runtime, job = self._runtime, admission.job
        stops = list(job.stops)
        if job.endpoint is Endpoint.CHAT_COMPLETIONS:
            try:
                rendered = render_chat(job.turns, runtime.chat_template)
            except Exception as err:  # the model's template refused the conversation
                raise ApiError(
                    400, f"The chat template cannot render: {err}", param="messages"
                ) from None
            prompt, stops = rendered.text, [*stops, *rendered.extra_stops]
        else:
            prompt = job.prompt or ""
        tokens = runtime.tokenize(prompt)
        chat = job.endpoint is Endpoint.CHAT_COMPLETIONS
        limit = runtime.context_length
        wanted = len(tokens) + (job.max_tokens or 1)
        if wanted > limit:
            raise ApiError(
                400,
                f"This model's context is {limit} tokens; the prompt has {len(tokens)} and "
                f"{job.max_tokens or 1} more were asked for",
                param="max_tokens" if job.max_tokens else ("messages" if chat else "prompt"),
                code="context_length_exceeded",
            )
        try:
            runtime.add_sequence(admission.slot, tokens, job.sampling, admission.item.adapter)
        except ValueError as err:  # e.g. its adapter was unloaded meanwhile
            raise ApiError(400, str(err), param="model") from None
        admission.prompt_tokens = len(tokens)
        admission.stops = stops


def runtime_has_work(admissions: list[Admission], active: dict[int, Sequence]) -> bool:
    return bool(active) or any(a.error is None for a in admissions)
