"""One batch handler skeleton: parse each body, run the valid ones together, isolate failures.

Every non-generative task (embeddings, rerank by cosine, rerank on a cross-encoder) answers a
batch the same way, so the rules live here once (invariant 6, one bad item fails only itself):

- a body that does not parse gets its own 400 and never reaches the runtime;
- the valid items run in one runtime call;
- if that call raises, each item is run alone, so only the culprit gets an error: 400 when
  the runtime says the input is unacceptable (ValueError), 500 when it fails otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from shoal.api.errors import ApiError
from shoal.protocol import Endpoint
from shoal.worker.items import BatchOutcome, Reply

Job = TypeVar("Job")


def answer_batch(
    count: int,
    parse: Callable[[int], Job],
    run: Callable[[Sequence[Job]], list[bytes]],
    size: Callable[[Job], int],
) -> BatchOutcome:
    """Answer `count` items: `parse(i)` validates item i (raising ApiError), `run(jobs)` runs
    valid jobs in one runtime call and returns one response body per job, `size(job)` counts
    the texts a job needs (for accounting)."""
    replies: list[Reply | None] = [None] * count
    jobs: list[tuple[int, Job]] = []
    for i in range(count):
        try:
            jobs.append((i, parse(i)))
        except ApiError as err:
            replies[i] = Reply.from_error(err)
    started = time.perf_counter()
    if jobs:
        try:
            bodies = run([job for _, job in jobs])
        except Exception:
            for i, job in jobs:
                replies[i] = _run_alone(run, job)
        else:
            for (i, _), body in zip(jobs, bodies, strict=True):
                replies[i] = Reply(200, body)
    runtime_seconds = time.perf_counter() - started
    done = [r if r is not None else Reply.from_error(ApiError(500, "no result")) for r in replies]
    return BatchOutcome(done, runtime_seconds, sum(size(job) for _, job in jobs))


def _run_alone(run: Callable[[Sequence[Job]], list[bytes]], job: Job) -> Reply:
    try:
        return Reply(200, run([job])[0])
    except ApiError as err:
        return Reply.from_error(err)
    except ValueError as err:
        return Reply.from_error(ApiError(400, f"The model cannot take this input: {err}"))
    except Exception as err:
        return Reply.from_error(ApiError(500, f"The runtime failed on this item: {err}"))


class BatchTask(Generic[Job]):
    """A non-generative task on one runtime: subclasses say how to parse, run and count.

    `handle` is what the batch scheduler calls, in the executor thread.
    """

    def __init__(self, runtime: Any, model: str) -> None:
        self.runtime = runtime
        self.model = model

    def handle(
        self,
        bodies: list[bytes],
        adapters: list[str | None] | None = None,
        endpoints: list[Endpoint | None] | None = None,
    ) -> BatchOutcome:
        """Answer each body; `adapters[i]` is the LoRA deployment body i was sent to (or
        None), `endpoints[i]` the API it came through (None: the task's default)."""
        adapters = adapters or [None] * len(bodies)
        endpoints = endpoints or [None] * len(bodies)
        return answer_batch(
            len(bodies),
            lambda i: self.parse(bodies[i], adapters[i], endpoints[i]),
            self.run,
            self.size,
        )

    def parse(self, body: bytes, adapter: str | None, endpoint: Endpoint | None) -> Job:
        """Decode and validate one body; ApiError(400) for a bad one."""
        raise NotImplementedError

    def run(self, jobs: Sequence[Job]) -> list[bytes]:
        """Run valid jobs in one runtime call: one response body per job."""
        raise NotImplementedError

    def size(self, job: Job) -> int:
        """Texts (or pairs) the job runs, for accounting."""
        raise NotImplementedError
