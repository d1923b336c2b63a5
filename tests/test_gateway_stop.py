"""A gateway stopped with requests still in flight answers each of them: a 503 to retry, in
the API's error shape, not uvicorn's plain-text 500 and a traceback in its log.

Real processes: a gateway and two sim workers on the session's nats-server. uvicorn waits 5 s
for running requests after SIGTERM, then cancels them; here one unary request waits for a
worker that is stopped (SIGSTOP), and one stream has started on a slow generation.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
from conftest import Launcher

EMBED_MODEL = "stop-embed"
GENERATE_MODEL = "stop-generate"


def test_requests_in_flight_when_the_gateway_stops_are_told_to_retry(nats_server, tmp_path):
    launcher = Launcher(tmp_path)
    try:
        gateway, url = launcher.gateway(nats_server.url)
        embedder = launcher.worker(nats_server.url, EMBED_MODEL, "--runtime", "sim")
        launcher.worker(
            nats_server.url,
            GENERATE_MODEL,
            "--runtime",
            "sim",
            "--task",
            "generate",
            "--option",
            "step_ms=200",
        )
        embedder.process.send_signal(signal.SIGSTOP)  # its requests wait in the queue
        answers: dict[str, object] = {}

        def unary() -> None:
            body = {"model": EMBED_MODEL, "input": "hello"}
            answers["unary"] = httpx.post(f"{url}/v1/embeddings", json=body, timeout=30)

        def stream() -> None:
            body = {"model": GENERATE_MODEL, "prompt": "x", "max_tokens": 500, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as reply:
                answers["stream_status"] = reply.status_code
                answers["events"] = [line for line in reply.iter_lines() if line]

        clients = [threading.Thread(target=unary), threading.Thread(target=stream)]
        for client in clients:
            client.start()
        time.sleep(2)  # both queued; the stream has sent some chunks
        gateway.process.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        for client in clients:
            client.join(20)
        assert not any(client.is_alive() for client in clients), "a client got no answer"
        assert time.monotonic() - stopped < 12
        embedder.process.send_signal(signal.SIGCONT)

        unary_reply = answers["unary"]
        assert isinstance(unary_reply, httpx.Response)
        assert unary_reply.status_code == 503, unary_reply.text
        assert unary_reply.headers["retry-after"] == "1"
        assert unary_reply.json()["error"]["code"] == "shutting_down"

        assert answers["stream_status"] == 200
        events = answers["events"]
        assert isinstance(events, list) and len(events) >= 3, events
        last = json.loads(events[-1].removeprefix("data: "))
        assert last["error"]["code"] == "shutting_down", events[-3:]

        # uvicorn raises the signal it handled again once it has shut down: the normal end.
        assert gateway.process.wait(20) in (0, -signal.SIGTERM)
        log = gateway.log()
        assert "Traceback" not in log and "Exception in ASGI application" not in log, log
    finally:
        launcher.stop_all()
