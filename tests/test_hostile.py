"""Hostile clients and bodies: slow connections are closed, every bad input is a 4xx.

A real gateway (short header and body timeouts) on the session's nats-server, with sim
workers for an embedding and a generation model. Each test sends what a hostile or broken
client would over real sockets and checks the status, the OpenAI error shape, and that the
gateway still answers a normal request afterwards.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
import uvicorn
from conftest import Launcher
from uvicorn.server import ServerState

from shoal.config import GatewaySettings, HttpTimeouts
from shoal.gateway.app import Gateway
from shoal.gateway.http_protocol import Exchange, protocol_factory
from shoal.gateway.openapi import build_document, encode_document, load_document

HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 2.0
KEEP_ALIVE_S = 4.0
MAX_BODY_BYTES = 256 * 1024
EMBED_MODEL = "hostile-embed"
GENERATE_MODEL = "hostile-generate"


@pytest.fixture(scope="module")
def cluster(nats_server, tmp_path_factory) -> dict:
    """A gateway with short read timeouts and the two sim models; its processes' logs."""
    launcher = Launcher(tmp_path_factory.mktemp("hostile"))
    env = {
        "SHOAL_HEADER_TIMEOUT": str(HEADER_TIMEOUT_S),
        "SHOAL_BODY_TIMEOUT": str(BODY_TIMEOUT_S),
        "SHOAL_KEEP_ALIVE_TIMEOUT": str(KEEP_ALIVE_S),
        "SHOAL_ADMIN_TOKEN": "hostile-admin",
    }
    launcher.env.update(env)
    try:
        gateway, url = launcher.gateway(nats_server.url, "--max-body-bytes", str(MAX_BODY_BYTES))
        workers = [
            launcher.worker(
                nats_server.url, EMBED_MODEL, "--runtime", "sim", "--option", "batch_ms=2"
            ),
            launcher.worker(
                nats_server.url,
                GENERATE_MODEL,
                "--runtime",
                "sim",
                "--task",
                "generate",
                "--option",
                "step_ms=2",
            ),
        ]
        yield {"url": url, "processes": [gateway, *workers]}
    finally:
        launcher.stop_all()


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def _parse_raw_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return status, headers, body


def assert_normal_request_works(url: str) -> None:
    response = httpx.post(
        f"{url}/v1/embeddings", json={"model": EMBED_MODEL, "input": ["a", "b"]}, timeout=30
    )
    assert response.status_code == 200, response.text
    assert [item["index"] for item in response.json()["data"]] == [0, 1]


# -- slow clients ------------------------------------------------------------------------


async def _slow_headers(host: str, port: int, index: int, give_up_s: float) -> tuple[float, bytes]:
    """Send a request line, then a header line every 0.5 s until the server closes."""
    reader, writer = await asyncio.open_connection(host, port)
    started = time.monotonic()
    writer.write(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n")
    received = b""
    try:
        while time.monotonic() - started < give_up_s:
            try:
                chunk = await asyncio.wait_for(reader.read(65536), 0.5)
            except TimeoutError:
                writer.write(f"X-Slow-{index}: {time.monotonic():.3f}\r\n".encode())
                continue
            if not chunk:  # the server closed the connection
                return time.monotonic() - started, received
            received += chunk
        return float("inf"), received
    except (ConnectionError, OSError):
        return time.monotonic() - started, received
    finally:
        writer.close()


def test_slow_header_connections_are_closed_and_others_are_served(cluster):
    host, port = _address(cluster["url"])
    give_up_s = HEADER_TIMEOUT_S + 8

    async def scenario() -> tuple[list[tuple[float, bytes]], list[int]]:
        slow = [asyncio.create_task(_slow_headers(host, port, i, give_up_s)) for i in range(300)]
        await asyncio.sleep(0.5)  # every slow connection is open and trickling
        statuses = []
        async with httpx.AsyncClient(timeout=10) as client:
            for _ in range(3):  # served while the slow ones are held, and after
                response = await client.post(
                    f"{cluster['url']}/v1/embeddings", json={"model": EMBED_MODEL, "input": "x"}
                )
                statuses.append(response.status_code)
                await asyncio.sleep(0.3)
        return await asyncio.gather(*slow), statuses

    results, statuses = asyncio.run(scenario())
    assert statuses == [200, 200, 200]
    held = [elapsed for elapsed, _ in results if elapsed > HEADER_TIMEOUT_S + 3]
    assert not held, f"{len(held)} of 300 slow connections were held past the header timeout"
    assert min(elapsed for elapsed, _ in results) >= HEADER_TIMEOUT_S - 0.5
    for _, raw in results:  # each got a 408 in the API's shape before the close
        status, headers, body = _parse_raw_response(raw)
        assert status == 408 and headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == "header_timeout"
    assert_normal_request_works(cluster["url"])


def test_an_idle_connection_is_kept_past_the_header_timeout_then_closed_quietly(cluster):
    """A connection that sends nothing is idle, not slow: it is kept for the keep-alive
    timeout (longer than the header timeout), then closed without an unasked-for answer."""
    host, port = _address(cluster["url"])

    async def idle() -> tuple[float, bytes]:
        reader, writer = await asyncio.open_connection(host, port)
        started = time.monotonic()
        try:
            received = await asyncio.wait_for(reader.read(), KEEP_ALIVE_S + 8)
        finally:
            writer.close()
        return time.monotonic() - started, received

    elapsed, received = asyncio.run(idle())
    assert received == b""
    assert KEEP_ALIVE_S - 0.5 <= elapsed <= KEEP_ALIVE_S + 3, elapsed
    assert elapsed > HEADER_TIMEOUT_S + 1


def test_keep_alive_counts_from_the_last_response(cluster):
    """A connection that asks every second for longer than the keep-alive timeout stays open;
    once it stops, it is closed a keep-alive timeout after its last response, not before."""
    host, port = _address(cluster["url"])
    request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"

    async def ask_then_idle() -> tuple[int, float]:
        reader, writer = await asyncio.open_connection(host, port)
        answered = 0
        try:
            started = time.monotonic()
            while time.monotonic() - started < KEEP_ALIVE_S * 1.6:
                writer.write(request)
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                length = int(_parse_raw_response(head)[1]["content-length"])
                await reader.readexactly(length)
                answered += 1
                last_answer = time.monotonic()
                await asyncio.sleep(1.0)
            rest = await asyncio.wait_for(reader.read(), KEEP_ALIVE_S + 8)
            assert rest == b""
            return answered, time.monotonic() - last_answer
        finally:
            writer.close()

    answered, closed_after_s = asyncio.run(ask_then_idle())
    assert answered >= KEEP_ALIVE_S * 1.6 - 1  # one a second, none refused by a closed socket
    assert KEEP_ALIVE_S - 0.2 <= closed_after_s <= KEEP_ALIVE_S + 2, closed_after_s


def test_trickling_body_gets_408_and_the_connection_closes(cluster):
    host, port = _address(cluster["url"])

    async def trickle() -> tuple[float, bytes]:
        reader, writer = await asyncio.open_connection(host, port)
        started = time.monotonic()
        writer.write(
            b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{"
        )
        received = b""
        try:
            while time.monotonic() - started < BODY_TIMEOUT_S + 8:
                try:
                    chunk = await asyncio.wait_for(reader.read(65536), 0.3)
                except TimeoutError:
                    writer.write(b" ")  # one byte at a time: never idle, never done
                    continue
                if not chunk:
                    break
                received += chunk
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()
        return time.monotonic() - started, received

    elapsed, raw = asyncio.run(trickle())
    assert BODY_TIMEOUT_S - 0.5 <= elapsed <= BODY_TIMEOUT_S + 3, elapsed
    status, headers, body = _parse_raw_response(raw)
    assert status == 408 and headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert error["code"] == "body_timeout" and error["type"] == "invalid_request_error"
    assert_normal_request_works(cluster["url"])


async def _raw_request(url: str, data: bytes, timeout: float = 10) -> bytes:
    reader, writer = await asyncio.open_connection(*_address(url))
    writer.write(data)
    try:
        return await asyncio.wait_for(reader.read(), timeout)  # until the server closes
    finally:
        writer.close()


def test_headers_past_the_limit_are_431(cluster):
    huge = b"X-Big: " + b"a" * (200 * 1024) + b"\r\n"
    raw = asyncio.run(_raw_request(cluster["url"], b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + huge))
    status, headers, body = _parse_raw_response(raw)
    assert status == 431 and headers["content-type"] == "application/json"
    assert json.loads(body)["error"]["code"] == "headers_too_large"
    assert_normal_request_works(cluster["url"])


@pytest.mark.parametrize(
    "data",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /healthz HTTP/9.9\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nBad Header\r\n\r\n",
        b"POST /v1/embeddings HTTP/1.1\r\nContent-Length: x\r\n\r\n",
        b"POST /v1/embeddings HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"GET /\xff\xfe HTTP/1.1\r\n\r\n",
    ],
)
def test_invalid_http_is_400_in_the_error_shape(cluster, data):
    status, headers, body = _parse_raw_response(asyncio.run(_raw_request(cluster["url"], data)))
    assert status == 400 and headers["content-type"] == "application/json"
    assert json.loads(body)["error"]["code"] == "invalid_http"


# -- one write per response ------------------------------------------------------------


class _RecordingTransport:
    """Where the exchange's writes land, one entry per write call (each a send on a socket)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name)

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _exchange(method: str = "POST", keep_alive: bool = True):
    """One request's exchange as the gateway's protocol makes it, over a recording
    transport; call inside a running loop. Returns (exchange, transport, server state)."""
    config = uvicorn.Config(_no_app, http=protocol_factory(HttpTimeouts()), lifespan="off")
    config.load()
    state = ServerState()
    state.default_headers = [(b"server", b"uvicorn")]
    protocol = config.http_protocol_class(config=config, server_state=state, app_state={})
    transport = _RecordingTransport()
    protocol.connection_made(transport)
    scope = {"type": "http", "method": method, "path": "/", "headers": []}
    return Exchange(protocol, scope, keep_alive, False), transport, state


async def _no_app(scope, receive, send) -> None:
    raise AssertionError("not called")


def test_a_whole_response_is_one_write():
    headers = [(b"content-type", b"application/json"), (b"content-length", b"2")]

    async def answer(method: str = "POST", keep_alive: bool = True, extra=()) -> tuple:
        exchange, transport, state = _exchange(method, keep_alive)
        await exchange.send_whole(200, [*headers, *extra], b"{}")
        assert exchange.response_complete and state.total_requests == 1
        # After its response, the app's next receive is the disconnect, at once.
        assert (await asyncio.wait_for(exchange.receive(), 1))["type"] == "http.disconnect"
        return transport, exchange

    transport, exchange = asyncio.run(answer())
    assert len(transport.writes) == 1 and not transport.closed and exchange.keep_alive
    status, response_headers, body = _parse_raw_response(transport.writes[0])
    assert (status, body) == (200, b"{}")
    assert response_headers == {
        "server": "uvicorn",
        "content-type": "application/json",
        "content-length": "2",
    }
    # HEAD: the head alone. An HTTP/1.0 client (no keep-alive): told, and closed.
    # `connection: close` from the app (a body left unread): closed.
    transport, _ = asyncio.run(answer("HEAD"))
    assert _parse_raw_response(transport.writes[0])[2] == b""
    transport, _ = asyncio.run(answer(keep_alive=False))
    assert _parse_raw_response(transport.writes[0])[1]["connection"] == "close"
    assert transport.closed
    transport, exchange = asyncio.run(answer(extra=[(b"connection", b"close")]))
    assert transport.closed and not exchange.keep_alive
    assert list(_parse_raw_response(transport.writes[0])[1]).count("connection") == 1


def test_a_whole_response_to_a_client_gone_writes_nothing():
    async def answer() -> _RecordingTransport:
        exchange, transport, _ = _exchange()
        exchange.lost()
        await exchange.send_whole(200, [(b"content-length", b"2")], b"{}")
        return transport

    assert asyncio.run(answer()).writes == []


def test_head_and_expect_continue_are_answered_by_the_gateway(cluster):
    """A HEAD request (a head and no body) and Expect: 100-continue, over a real socket."""
    host, port = _address(cluster["url"])
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(b"HEAD /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, body = _parse_raw_response(sock.recv(65536))
        assert status == 405 and body == b""
        payload = json.dumps({"model": EMBED_MODEL, "input": "hello"}).encode()
        sock.sendall(
            b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(payload)
        )
        assert sock.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(payload)
        raw = b""
        while b"\r\n\r\n" not in raw or len(raw.partition(b"\r\n\r\n")[2]) < int(
            _parse_raw_response(raw)[1].get("content-length", "1")
        ):
            chunk = sock.recv(65536)
            assert chunk, raw
            raw += chunk
        status, _, body = _parse_raw_response(raw)
        assert status == 200 and json.loads(body)["data"][0]["index"] == 0


def _read_responses(sock: socket.socket, count: int) -> list[tuple[int, dict[str, str], bytes]]:
    """`count` whole responses (each with a content-length) from `sock`, in order."""
    raw, responses = b"", []
    while len(responses) < count:
        head, sep, rest = raw.partition(b"\r\n\r\n")
        if sep:
            status, headers, _ = _parse_raw_response(head + sep)
            length = int(headers["content-length"])
            if len(rest) >= length:
                responses.append((status, headers, rest[:length]))
                raw = rest[length:]
                continue
        chunk = sock.recv(65536)
        assert chunk, f"closed after {len(responses)} responses"
        raw += chunk
    return responses


def test_pipelined_requests_are_answered_in_order(cluster):
    """Three requests in one write: a health check, an embedding that waits on a worker, and
    the model list; the answers come back in the order asked, on the one connection."""
    host, port = _address(cluster["url"])
    payload = json.dumps({"model": EMBED_MODEL, "input": "pipelined"}).encode()
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(
            b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
            b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s"
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n" % (len(payload), payload)
        )
        health, embedding, models = _read_responses(sock, 3)
    assert (health[0], json.loads(health[2])) == (200, {"status": "ok"})
    assert embedding[0] == 200 and json.loads(embedding[2])["data"][0]["object"] == "embedding"
    assert models[0] == 200 and EMBED_MODEL in {m["id"] for m in json.loads(models[2])["data"]}


def test_a_chunked_request_body_in_two_reads_is_served(cluster):
    host, port = _address(cluster["url"])
    payload = json.dumps({"model": EMBED_MODEL, "input": "chunked"}).encode()
    first, second = payload[:10], payload[10:]
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(first), first)
        )
        time.sleep(0.2)  # the app reads the first chunk and waits for the rest
        sock.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(second), second))
        ((status, _, body),) = _read_responses(sock, 1)
    assert status == 200 and len(json.loads(body)["data"]) == 1


def test_an_app_error_is_a_500_in_the_error_shape_and_the_connection_closes():
    async def failing_app(scope, receive, send) -> None:
        raise ValueError("a bug")

    async def run() -> _RecordingTransport:
        exchange, transport, _ = _exchange()
        exchange.body_complete()
        await exchange.run(failing_app)
        return transport

    transport = asyncio.run(run())
    status, headers, body = _parse_raw_response(b"".join(transport.writes))
    assert status == 500 and headers["connection"] == "close" and transport.closed
    assert json.loads(body)["error"]["code"] == "internal_error"


# -- HTTP-level errors -------------------------------------------------------------------


def test_unknown_route_wrong_method_and_large_body_are_openai_errors(cluster):
    url = cluster["url"]
    assert_openai_error(httpx.get(f"{url}/nope"), 404)
    assert_openai_error(httpx.get(f"{url}/v1/embeddings"), 405)
    assert_openai_error(httpx.delete(f"{url}/healthz"), 405)
    response = httpx.post(
        f"{url}/v1/embeddings",
        content=b'{"model": "' + b"m" * (MAX_BODY_BYTES + 10) + b'"}',
        timeout=30,
    )
    assert_openai_error(response, 413)
    assert response.headers["connection"] == "close"
    assert_normal_request_works(url)


# -- hostile bodies ----------------------------------------------------------------------


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _hostile_bodies() -> list[tuple[str, str, bytes]]:
    """(name, path, body): each must get a 4xx, never a 5xx."""
    e, g = EMBED_MODEL, GENERATE_MODEL
    bodies = {
        "deep input": (
            "/v1/embeddings",
            b'{"model":"%s","input":%s}' % (e.encode(), _nested(100_000)),
        ),
        "deep ignored field": (
            "/v1/chat/completions",
            b'{"model":"%s","messages":[],"x":%s}'
            % (g.encode(), b'{"a":' * 50_000 + b"1" + b"}" * 50_000),
        ),
        "deep unclosed": ("/v1/embeddings", b"[" * 200_000),
        "huge integer": (
            "/v1/completions",
            b'{"model":"%s","prompt":"x","max_tokens":%s}' % (g.encode(), b"9" * 5000),
        ),
        "huge float": (
            "/v1/completions",
            b'{"model":"%s","prompt":"x","temperature":1e400}' % g.encode(),
        ),
        "NaN": ("/v1/completions", b'{"model":"%s","prompt":"x","temperature":NaN}' % g.encode()),
        "Infinity top_p": (
            "/v1/chat/completions",
            b'{"model":"%s","messages":[{"role":"user","content":"x"}],"top_p":Infinity}'
            % g.encode(),
        ),
        "negative max_tokens": (
            "/v1/completions",
            b'{"model":"%s","prompt":"x","max_tokens":-1}' % g.encode(),
        ),
        "max_tokens 2**63": (
            "/v1/completions",
            b'{"model":"%s","prompt":"x","max_tokens":9223372036854775808}' % g.encode(),
        ),
        "seed 2**64": (
            "/v1/completions",
            b'{"model":"%s","prompt":"x","seed":18446744073709551616}' % g.encode(),
        ),
        "seed negative": (
            "/v1/completions",
            b'{"model":"%s","prompt":"x","seed":-99999999999999}' % g.encode(),
        ),
        "invalid UTF-8": ("/v1/embeddings", b'{"model":"%s","input":"\xff\xfe\xc3"}' % e.encode()),
        "lone surrogate": ("/v1/embeddings", b'{"model":"%s","input":"\\ud800"}' % e.encode()),
        "NUL in model": ("/v1/embeddings", b'{"model":"a\\u0000b","input":"x"}'),
        "empty input list": ("/v1/embeddings", b'{"model":"%s","input":[]}' % e.encode()),
        "empty string input": ("/v1/embeddings", b'{"model":"%s","input":""}' % e.encode()),
        "2049 inputs": ("/v1/embeddings", json.dumps({"model": e, "input": ["x"] * 2049}).encode()),
        # Token ids are taken (the model's own tokenizer's); past its vocabulary they are not.
        "huge token id": ("/v1/embeddings", json.dumps({"model": e, "input": [[2**130]]}).encode()),
        "token id -1": ("/v1/embeddings", json.dumps({"model": e, "input": [5, -1]}).encode()),
        "unknown model": ("/v1/embeddings", b'{"model":"no-such-model","input":"x"}'),
        "model wrong task": ("/v1/embeddings", b'{"model":"%s","input":"x"}' % g.encode()),
        "model is a list": ("/v1/embeddings", b'{"model":["x"],"input":"x"}'),
        "body is a list": ("/v1/embeddings", b'[{"model":"x"}]'),
        "body is a string": ("/v1/rerank", b'"hello"'),
        "body is null": ("/v1/rerank", b"null"),
        "empty body": ("/v1/chat/completions", b""),
        "trailing garbage": ("/v1/embeddings", b'{"model":"%s","input":"x"} x' % e.encode()),
        "stream is a string": (
            "/v1/chat/completions",
            b'{"model":"%s","messages":[],"stream":"yes"}' % g.encode(),
        ),
        "messages wrong type": (
            "/v1/chat/completions",
            b'{"model":"%s","messages":{"role":"user"}}' % g.encode(),
        ),
        "bad role": (
            "/v1/chat/completions",
            b'{"model":"%s","messages":[{"role":"god","content":"x"}]}' % g.encode(),
        ),
        "content parts wrong": (
            "/v1/chat/completions",
            b'{"model":"%s","messages":[{"role":"user","content":[{"type":"image_url"}]}]}'
            % g.encode(),
        ),
        "stop 5": (
            "/v1/completions",
            json.dumps({"model": g, "prompt": "x", "stop": ["a"] * 5}).encode(),
        ),
        "n 2": ("/v1/completions", json.dumps({"model": g, "prompt": "x", "n": 2}).encode()),
        "rerank no documents": (
            "/v1/rerank",
            json.dumps({"model": e, "query": "q", "documents": []}).encode(),
        ),
        "rerank 1001 documents": (
            "/v1/rerank",
            json.dumps({"model": e, "query": "q", "documents": ["d"] * 1001}).encode(),
        ),
        "rerank document number": (
            "/v1/rerank",
            json.dumps({"model": e, "query": "q", "documents": [5]}).encode(),
        ),
        "rerank top_n 0": (
            "/v1/rerank",
            json.dumps({"model": e, "query": "q", "documents": ["d"], "top_n": 0}).encode(),
        ),
        "rerank empty query": (
            "/v1/rerank",
            json.dumps({"model": e, "query": "", "documents": ["d"]}).encode(),
        ),
        "dimensions wrong": (
            "/v1/embeddings",
            json.dumps({"model": e, "input": "x", "dimensions": 7}).encode(),
        ),
        "encoding_format wrong": (
            "/v1/embeddings",
            json.dumps({"model": e, "input": "x", "encoding_format": "hex"}).encode(),
        ),
        "huge string": (
            "/v1/embeddings",
            json.dumps({"model": e, "input": "word " * 50_000}).encode(),
        ),
        "huge prompt": (
            "/v1/completions",
            json.dumps({"model": g, "prompt": "word " * 50_000, "max_tokens": 1}).encode(),
        ),
        "admin deploy garbage": ("/admin/models/x", b'{"runtime": 5}'),
        "admin deploy unknown field": ("/admin/models/x", b'{"bogus": 1}'),
        "admin deploy bad name": ("/admin/models/..%2F..%2Fetc", b'{"runtime": "sim"}'),
        "admin deploy unknown runtime": ("/admin/models/fuzz-x", b'{"runtime": "nope"}'),
        "admin deploy bad task": ("/admin/models/fuzz-x", b'{"runtime": "sim", "task": "dance"}'),
        "admin deploy lora alone": ("/admin/models/fuzz-x", b'{"lora": "/tmp"}'),
    }
    return [(name, path, body) for name, (path, body) in bodies.items()]


# Odd but valid: these may succeed (a seed is any integer; a long text is embedded whole).
_MAY_SUCCEED = {"seed 2**64", "huge string", "huge prompt"}


@pytest.mark.parametrize(
    ("name", "path", "body"), _hostile_bodies(), ids=[name for name, _, _ in _hostile_bodies()]
)
def test_hostile_body_is_a_4xx_in_the_error_shape(cluster, name, path, body):
    url = cluster["url"]
    headers = {"content-type": "application/json", "authorization": "Bearer hostile-admin"}
    method = "PUT" if path.startswith("/admin/") else "POST"
    response = httpx.request(method, f"{url}{path}", content=body, headers=headers, timeout=30)
    if name in _MAY_SUCCEED and response.status_code == 200:
        return
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    assert_openai_error(response, response.status_code)


def test_no_process_logged_a_traceback_and_all_are_alive(cluster):
    """Runs after the others in this module (pytest keeps the file's order)."""
    assert_normal_request_works(cluster["url"])
    for process in cluster["processes"]:
        assert process.process.poll() is None, process.log()
        assert "Traceback" not in process.log(), process.log()


# -- the OpenAPI document ----------------------------------------------------------------


def test_openapi_document_is_served_and_current(cluster):
    response = httpx.get(f"{cluster['url']}/openapi.json")
    assert response.status_code == 200
    served = response.json()
    assert served == json.loads(load_document())
    # The shipped file is what the API's types build now: `python -m shoal.gateway.openapi`.
    assert load_document().decode() == encode_document(build_document())
    assert served["openapi"].startswith("3.1")


def test_openapi_document_covers_every_route():
    document = json.loads(load_document())
    gateway = Gateway(GatewaySettings(nats_url="nats://127.0.0.1:1"))
    for method, path in gateway._routes:
        assert method.lower() in document["paths"].get(path, {}), f"{method} {path} undocumented"
    admin = document["paths"]
    assert "get" in admin["/admin/models"]
    # Served by prefix, not from the route table: `client.models.retrieve`.
    assert "get" in admin["/v1/models/{model}"]
    assert {"put", "delete"} <= set(admin["/admin/models/{name}"])
    for path, operations in document["paths"].items():
        for operation in operations.values():
            for status, response in operation["responses"].items():
                for media in response["content"].values():
                    _resolve_refs(document, media["schema"], f"{path} {status}")


def _resolve_refs(document: dict, schema: object, where: str) -> None:
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if ref is not None:
            name = ref.removeprefix("#/components/schemas/")
            assert name in document["components"]["schemas"], f"{where}: {ref} missing"
            return
        for value in schema.values():
            _resolve_refs(document, value, where)
    elif isinstance(schema, list):
        for value in schema:
            _resolve_refs(document, value, where)
