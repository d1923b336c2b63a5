"""Ray Serve peer: all-MiniLM-L6-v2 in a deployment with @serve.batch (run by bench.peers).

Runs inside bench/.peers/ray (its own virtualenv, made by bench/peers/install.sh):

    bench/.peers/ray/bin/python bench/peers/ray_app.py --port P --model-path DIR \\
        --max-batch-size 128 --max-ongoing-requests 256 --threads 2

Answers POST /v1/embeddings in OpenAI's shape (float or base64), like Shoal, so the same load
generator drives both. The batch method runs sentence-transformers' `encode` on the batch in a
thread, so the replica's event loop stays free. GET /v1/embeddings/metrics exports Shoal's busy
and batch counters. Stops on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import signal
import threading
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--model-name", default="all-MiniLM-L6-v2")
    parser.add_argument("--max-batch-size", type=int, default=128)
    parser.add_argument("--batch-wait-timeout-s", type=float, default=0.0)
    parser.add_argument("--max-ongoing-requests", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=1)
    args = parser.parse_args()

    import ray
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse

    @serve.deployment(
        num_replicas=args.replicas,
        max_ongoing_requests=args.max_ongoing_requests,
        ray_actor_options={"num_cpus": 0},
    )
    class Embedder:
        def __init__(self) -> None:
            import torch
            from sentence_transformers import SentenceTransformer

            torch.set_num_threads(args.threads)
            self.model = SentenceTransformer(args.model_path, device="cpu")
            # The same counters Shoal's workers export, so busy fraction and mean batch are
            # measured the same way (time inside the model call, items per batch).
            self.busy_s = 0.0
            self.batches = 0
            self.items = 0

        @serve.batch(
            max_batch_size=args.max_batch_size, batch_wait_timeout_s=args.batch_wait_timeout_s
        )
        async def embed(self, texts: list[str]):
            started = time.perf_counter()
            # In a thread, as Shoal's worker does: a blocked event loop cannot answer the
            # proxy's queue-length probes ("Failed to get queue length from Replica"), and
            # the proxy then backs off; measured at 63 req/s with encode on the loop.
            vectors = await asyncio.to_thread(
                self.model.encode, texts, batch_size=len(texts), convert_to_numpy=True
            )
            self.busy_s += time.perf_counter() - started
            self.batches += 1
            self.items += len(texts)
            return list(vectors.astype("<f4"))

        async def __call__(self, request: Request):
            if request.method == "GET":  # GET /v1/embeddings/metrics
                return PlainTextResponse(
                    f"shoal_worker_busy_seconds_total {self.busy_s}\n"
                    f"shoal_worker_batch_items_sum {self.items}\n"
                    f"shoal_worker_batch_items_count {self.batches}\n"
                )
            body = await request.json()
            text = body["input"] if isinstance(body["input"], str) else body["input"][0]
            vector = await self.embed(text)
            if body.get("encoding_format") == "base64":
                embedding = base64.b64encode(vector.tobytes()).decode()
            else:
                embedding = vector.tolist()
            tokens = max(1, len(text) // 4)
            return JSONResponse(
                {
                    "object": "list",
                    "data": [{"object": "embedding", "index": 0, "embedding": embedding}],
                    "model": args.model_name,
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                }
            )

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=256 * 1024 * 1024,
        log_to_driver=False,
    )
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(Embedder.bind(), route_prefix="/v1/embeddings", name="embedder")
    print("ray serve ready", flush=True)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
