"""Rerank on a cross-encoder: one runtime `score` call for every pair of a batch.

The request and response shapes are in worker/rerank.py. It knows the runtime interface and
nothing of NATS, so it runs in the executor thread and is tested on its own.
"""

from __future__ import annotations

import time

from shoal.errors import ApiError
from shoal.protocol import Endpoint
from shoal.runtimes.base import ScoringRuntime
from shoal.worker.embeddings import BatchOutcome
from shoal.worker.outbox import Reply
from shoal.worker.rerank import RerankJob, encode_rerank_response, parse_rerank_request


class RerankHandler:
    """Runs a batch of rerank requests on a cross-encoder: one `score` call for all pairs."""

    def __init__(self, runtime: ScoringRuntime, model: str) -> None:
        self.runtime = runtime
        self.model = model

    def handle(
        self,
        bodies: list[bytes],
        adapters: list[str | None] | None = None,
        endpoints: list[Endpoint | None] | None = None,
    ) -> BatchOutcome:
        """Answer each body; a bad body, or one the model cannot take, fails only itself.

        Every body is a rerank request (the scheduler answers other endpoints itself), so
        `endpoints` is not read; a cross-encoder has no LoRA adapters.
        """
        replies: list[Reply | None] = [None] * len(bodies)
        jobs: list[tuple[int, RerankJob]] = []
        for i, body in enumerate(bodies):
            try:
                if adapters and adapters[i]:
                    raise ApiError(400, "A rerank model takes no LoRA adapter", param="model")
                jobs.append((i, parse_rerank_request(body)))
            except ApiError as err:
                replies[i] = Reply.from_error(err)
        started = time.perf_counter()
        if jobs:
            self._run(jobs, replies)
        runtime_seconds = time.perf_counter() - started
        done = [
            r if r is not None else Reply.from_error(ApiError(500, "no result")) for r in replies
        ]
        return BatchOutcome(done, runtime_seconds, sum(len(job.documents) for _, job in jobs))

    def _run(self, jobs: list[tuple[int, RerankJob]], replies: list[Reply | None]) -> None:
        pairs = [(job.query, document) for _, job in jobs for document in job.documents]
        try:
            output = self.runtime.score(pairs)
        except Exception:
            # One item broke the batch: run each alone so only that item fails.
            for index, job in jobs:
                replies[index] = self._run_alone(job)
            return
        offset = 0
        for index, job in jobs:
            end = offset + len(job.documents)
            tokens = sum(output.token_counts[offset:end])
            body = encode_rerank_response(job, output.scores[offset:end], tokens, self.model)
            replies[index] = Reply(200, body)
            offset = end

    def _run_alone(self, job: RerankJob) -> Reply:
        try:
            output = self.runtime.score([(job.query, document) for document in job.documents])
        except ValueError as err:
            return Reply.from_error(ApiError(400, f"The model cannot take this input: {err}"))
        except Exception as err:
            return Reply.from_error(ApiError(500, f"The runtime failed on this item: {err}"))
        tokens = sum(output.token_counts)
        return Reply(200, encode_rerank_response(job, output.scores, tokens, self.model))
