"""The load generator's measured window: read at its start and end, not over the whole call."""

from __future__ import annotations

import itertools
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench.loadgen import LoadSpec, run_load_in_window

LATE_S = 2.0


class _OneLateAnswer(BaseHTTPRequestHandler):
    """Answers every POST at once except the fifth, which it answers LATE_S later."""

    protocol_version = "HTTP/1.1"
    counter: itertools.count

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        if next(self.counter) == 5:
            time.sleep(LATE_S)
        body = b'{"data":[]}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def _serve() -> ThreadingHTTPServer:
    """A started server of its own, its count of requests from 1."""
    handler = type("Handler", (_OneLateAnswer,), {"counter": itertools.count(1)})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_late_answer_does_not_stretch_the_measured_window():
    server = _serve()
    try:
        spec = LoadSpec(
            f"http://127.0.0.1:{server.server_address[1]}",
            "any",
            mode="open",
            rate=40,
            connections=4,
            seconds=1.0,
        )
        began = time.monotonic()
        result, readings = run_load_in_window(spec, time.monotonic)
        call_s = time.monotonic() - began
    finally:
        server.shutdown()
    assert result.ok == result.sent > 5
    assert result.max_ms >= 1000 * LATE_S  # the late answer was waited for and counted
    assert call_s >= 1.0 + LATE_S * 0.5
    # ...but the readings cover the window alone.
    assert 0.95 <= readings.seconds <= 1.3
    assert 0.95 <= readings.after - readings.before <= 1.3


def test_a_reading_that_fails_is_raised_to_the_caller():
    server = _serve()

    def unreachable_metrics() -> float:
        raise ConnectionRefusedError("metrics gone")

    try:
        spec = LoadSpec(
            f"http://127.0.0.1:{server.server_address[1]}", "any", mode="open", rate=5, seconds=0.3
        )
        with pytest.raises(ConnectionRefusedError, match="metrics gone"):
            run_load_in_window(spec, unreachable_metrics)
    finally:
        server.shutdown()
