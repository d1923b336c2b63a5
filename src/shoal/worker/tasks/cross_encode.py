"""Rerank on a cross-encoder: one runtime `score` call for every pair of a batch.

The request and response shapes are in api/rerank.py. It knows the runtime interface and
nothing of NATS, so it runs in the executor thread and is tested on its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from shoal.api.errors import ApiError
from shoal.api.rerank import RerankJob, encode_rerank_response, parse_rerank_request
from shoal.protocol import Endpoint
from shoal.runtimes.base import ScoringRuntime
from shoal.worker.tasks.isolate import BatchTask


class RerankHandler(BatchTask[RerankJob]):
    """Runs a batch of rerank requests on a cross-encoder: one `score` call for all pairs.

    Every body is a rerank request (the scheduler answers other endpoints itself); a
    cross-encoder has no LoRA adapters.
    """

    runtime: ScoringRuntime

    def parse(self, body: bytes, adapter: str | None, endpoint: Endpoint | None) -> RerankJob:
        if adapter:
            raise ApiError(400, "A rerank model takes no LoRA adapter", param="model")
        return parse_rerank_request(body)

    def run(self, jobs: Sequence[RerankJob]) -> list[bytes]:
        pairs = [(job.query, document) for job in jobs for document in job.documents]
        output = self.runtime.score(pairs)
        bodies, offset = [], 0
        for job in jobs:
            end = offset + len(job.documents)
            tokens = sum(output.token_counts[offset:end])
            scores = output.scores[offset:end]
            bodies.append(encode_rerank_response(job, scores, tokens, self.model))
            offset = end
        return bodies

    def size(self, job: RerankJob) -> int:
        return len(job.documents)
