"""Property-based fuzzing of every gateway route: no input may get a 5xx or a traceback.

    python -m bench.fuzz --minutes 10

starts a real cluster (nats-server, a gateway with the admin API on, a sim embedding worker
and a sim generation worker), sends hypothesis-generated requests to every route for the
given time, and then checks: no 5xx, every 4xx in the API's error shape, no traceback in any
process's log, every process alive, and a normal request still correct. It prints a JSON
summary and exits 1 on any failure. tests/test_fuzz.py runs the same probe, bounded.

The requests: each route's fields with plausible values or any JSON value in their place
(wrong types, NaN, huge numbers, deep nesting), bodies mutated at the byte level (invalid
UTF-8, truncation, nesting wrappers), raw bytes, every method on every path, unknown paths.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from shoal.process import child_preexec, free_port

EMBED_MODEL = "fuzz-embed"
GENERATE_MODEL = "fuzz-generate"
ADMIN_TOKEN = "fuzz-admin-token"
METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS")
KNOWN_PATHS = (
    "/v1/embeddings",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/rerank",
    "/v1/models",
    "/healthz",
    "/readyz",
    "/metrics",
    "/openapi.json",
    "/admin/models",
)


@dataclass(frozen=True)
class Case:
    """One request the fuzzer sends."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class FuzzReport:
    """What a run saw: counts by status class, and every request that broke a rule."""

    requests: int = 0
    by_class: Counter[str] = field(default_factory=Counter)
    failures: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "by_class": dict(sorted(self.by_class.items())),
            "failures": self.failures[:20],
            "failure_count": len(self.failures),
        }


# -- strategies --------------------------------------------------------------------------

_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
)
# Any JSON value: what a field gets when the fuzzer ignores its type.
any_json = st.recursive(
    _scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
short_text = st.text(min_size=0, max_size=40)
small_int = st.integers(min_value=-2, max_value=40)


def _field(plausible: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a plausible value, sometimes anything at all."""
    return st.one_of(plausible, plausible, any_json)


def _models() -> st.SearchStrategy[Any]:
    return _field(st.sampled_from([EMBED_MODEL, GENERATE_MODEL, "no-such-model", ""]))


def _sampling_fields() -> dict[str, st.SearchStrategy[Any]]:
    return {
        "max_tokens": _field(small_int),
        "temperature": _field(st.floats(min_value=-1, max_value=3)),
        "top_p": _field(st.floats(min_value=-0.5, max_value=1.5)),
        "stop": _field(st.lists(short_text, max_size=6) | short_text),
        "seed": _field(st.integers()),
        "n": _field(st.integers(min_value=0, max_value=3)),
        "stream": _field(st.booleans()),
        "stream_options": _field(st.fixed_dictionaries({"include_usage": st.booleans()})),
        "presence_penalty": _field(st.floats(min_value=-1, max_value=1)),
        "logit_bias": _field(st.dictionaries(short_text, st.floats(), max_size=2)),
        "user": _field(short_text),
    }


_message = st.fixed_dictionaries(
    {"role": _field(st.sampled_from(["system", "user", "assistant", "developer", "tool"]))},
    optional={
        "content": _field(
            short_text
            | st.lists(
                st.fixed_dictionaries(
                    {"type": _field(st.sampled_from(["text", "image_url"]))},
                    optional={"text": _field(short_text)},
                ),
                max_size=3,
            )
        ),
        "name": _field(short_text),
    },
)

BODIES: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "/v1/embeddings": st.fixed_dictionaries(
        {"model": _models()},
        optional={
            "input": _field(short_text | st.lists(short_text, max_size=5)),
            "encoding_format": _field(st.sampled_from(["float", "base64", "hex"])),
            "dimensions": _field(st.sampled_from([384, 0, -1, 7])),
            "user": _field(short_text),
        },
    ),
    "/v1/completions": st.fixed_dictionaries(
        {"model": _models()},
        optional={
            "prompt": _field(short_text | st.lists(short_text, max_size=2)),
            "echo": _field(st.booleans()),
            "logprobs": _field(st.none() | small_int),
            "suffix": _field(st.none() | short_text),
            "best_of": _field(st.none() | small_int),
            **_sampling_fields(),
        },
    ),
    "/v1/chat/completions": st.fixed_dictionaries(
        {"model": _models()},
        optional={
            "messages": _field(st.lists(_message, max_size=3)),
            "max_completion_tokens": _field(small_int),
            "tools": _field(st.none() | st.lists(any_json, max_size=2)),
            "response_format": _field(st.fixed_dictionaries({"type": short_text})),
            **_sampling_fields(),
        },
    ),
    "/v1/rerank": st.fixed_dictionaries(
        {"model": _models()},
        optional={
            "query": _field(short_text),
            "documents": _field(
                st.lists(short_text | st.fixed_dictionaries({"text": _field(short_text)}))
            ),
            "top_n": _field(small_int),
            "return_documents": _field(st.booleans()),
        },
    ),
    "/admin/models/{name}": st.fixed_dictionaries(
        {},
        optional={
            # Only the sim runtime: a real one would download or load a model.
            "runtime": _field(st.sampled_from(["sim", "nope", ""])),
            "task": _field(st.sampled_from(["embeddings", "generate", "rerank", "dance"])),
            "source": _field(short_text),
            "options": _field(st.dictionaries(short_text, any_json, max_size=3)),
            "base": _field(short_text),
            "lora": _field(short_text),
        },
    ),
}


# Well-formed requests the served models answer. Without them the generator's share of valid
# requests is so small (3-12 of 600) that a short run sometimes served none at all.
SERVED: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "/v1/embeddings": st.fixed_dictionaries(
        {
            "model": st.just(EMBED_MODEL),
            "input": st.text(min_size=1, max_size=40)
            | st.lists(st.text(min_size=1, max_size=40), min_size=1, max_size=3),
        }
    ),
    "/v1/completions": st.fixed_dictionaries(
        {
            "model": st.just(GENERATE_MODEL),
            "prompt": st.text(min_size=1, max_size=40),
            "max_tokens": st.integers(min_value=1, max_value=8),
        }
    ),
}


@st.composite
def _encoded(draw: st.DrawFn, document: Any) -> bytes:
    """JSON text of `document` (NaN and Infinity as bare words), then perhaps mangled."""
    body = json.dumps(document, allow_nan=True).encode()
    mutation = draw(st.sampled_from(["none"] * 6 + ["truncate", "utf8", "nest", "wrap", "garbage"]))
    if mutation == "truncate" and body:
        body = body[: draw(st.integers(min_value=0, max_value=len(body) - 1))]
    elif mutation == "utf8":
        at = draw(st.integers(min_value=0, max_value=len(body)))
        body = (
            body[:at]
            + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00"]))
            + body[at:]
        )
    elif mutation == "nest":  # a field nested past any limit, before or after the others
        depth = draw(st.sampled_from([100, 129, 1000, 100_000]))
        body = (
            b'{"x":' + b"[" * depth + b"]" * depth + b"," + body[1:] if body[:1] == b"{" else body
        )
    elif mutation == "wrap":
        body = b"[" + body + b"]"
    elif mutation == "garbage":
        body = body + draw(st.binary(min_size=1, max_size=8))
    return body


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """A request for any route, with any method, headers and body."""
    headers = {"content-type": draw(st.sampled_from(["application/json", "text/plain", ""]))}
    if draw(st.booleans()):
        headers["authorization"] = draw(
            st.sampled_from([f"Bearer {ADMIN_TOKEN}", "Bearer wrong", "Basic abc", "Bearer"])
        )
    kind = draw(st.sampled_from(["route"] * 8 + ["served", "admin", "method", "path", "raw"]))
    if kind == "route":
        path = draw(st.sampled_from(list(BODIES)[:4]))
        return Case("POST", path, headers, draw(_encoded(draw(BODIES[path]))))
    if kind == "served":
        path = draw(st.sampled_from(list(SERVED)))
        headers["content-type"] = "application/json"
        return Case("POST", path, headers, json.dumps(draw(SERVED[path])).encode())
    if kind == "admin":
        name = draw(
            # Never the served models' names: redeploying those would change what they serve.
            st.sampled_from(["fuzz-deployed", "no-such-model", "..", "a%2Fb", "x" * 300, "%00"])
            | st.text(alphabet="abc-_.%/ ", min_size=0, max_size=12)
        )
        method = draw(st.sampled_from(["PUT", "DELETE", "GET", "POST"]))
        body = draw(_encoded(draw(BODIES["/admin/models/{name}"])))
        headers["authorization"] = f"Bearer {ADMIN_TOKEN}"
        return Case(method, f"/admin/models/{name}", headers, body)
    if kind == "method":
        path = draw(st.sampled_from(KNOWN_PATHS))
        return Case(draw(st.sampled_from(METHODS)), path, headers, draw(st.binary(max_size=64)))
    if kind == "path":
        path = "/" + draw(st.text(alphabet="abcv1/._-%?&=#", max_size=30))
        return Case(draw(st.sampled_from(METHODS)), path, headers, b"")
    path = draw(st.sampled_from(list(BODIES)[:4]))
    return Case("POST", path, headers, draw(st.binary(max_size=200)))


# -- the probe ---------------------------------------------------------------------------


def send(client: httpx.Client, case: Case) -> httpx.Response:
    # Unknown paths go out as they are: httpx would otherwise read "?" and "#" as URL parts.
    # A "#" no client sends in a request line (it starts the fragment, kept by the client,
    # and httpx refuses some such paths): it goes out encoded.
    request = client.build_request(case.method, "/", headers=case.headers, content=case.body)
    request.url = request.url.copy_with(raw_path=case.path.replace("#", "%23").encode())
    return client.send(request)


def check(case: Case, response: httpx.Response, report: FuzzReport) -> None:
    """Count the response; record it if it is a 5xx or a 4xx outside the error shape."""
    report.requests += 1
    status = response.status_code
    report.by_class[f"{status // 100}xx"] += 1
    problem = None
    if status >= 500:
        problem = "5xx"
    elif status >= 400 and case.method != "HEAD":
        try:
            error = response.json()["error"]
            if set(error) != {"message", "type", "param", "code"}:
                problem = "error shape"
        except (ValueError, KeyError, TypeError):
            problem = "error shape"
    if problem is not None:
        report.failures.append(
            {
                "problem": problem,
                "status": status,
                "method": case.method,
                "path": case.path,
                "body": case.body[:300].decode("utf-8", "replace"),
                "response": response.text[:300],
            }
        )


def probe(url: str, examples: int, report: FuzzReport) -> None:
    """Send `examples` generated requests to the gateway at `url`, recording into `report`."""
    with httpx.Client(base_url=url, timeout=30) as client:

        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            phases=[Phase.generate],  # no shrinking: every failure is recorded as it came
            suppress_health_check=list(HealthCheck),
        )
        @given(case=cases())
        def one(case: Case) -> None:
            try:
                response = send(client, case)
            except httpx.TransportError as err:  # the server dropped it without an answer
                report.requests += 1
                report.failures.append(
                    {"problem": f"transport: {err!r}", "method": case.method, "path": case.path}
                )
                return
            check(case, response, report)

        one()


def normal_request_works(url: str) -> bool:
    """An embeddings and a chat request, answered correctly."""
    embed = httpx.post(
        f"{url}/v1/embeddings", json={"model": EMBED_MODEL, "input": ["a", "b"]}, timeout=30
    )
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": GENERATE_MODEL, "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    vectors = embed.json().get("data", []) if embed.status_code == 200 else []
    return (
        embed.status_code == 200
        and [v["index"] for v in vectors] == [0, 1]
        and all(math.isfinite(x) for v in vectors for x in v["embedding"])
        and chat.status_code == 200
        and chat.json()["choices"][0]["message"]["role"] == "assistant"
    )


# -- the cluster (for the command) -------------------------------------------------------

WORKER_ARGS = {
    EMBED_MODEL: ("--runtime", "sim", "--option", "batch_ms=1"),
    # A short context: a fuzzed max_tokens cannot make a request run for long.
    GENERATE_MODEL: (
        "--runtime",
        "sim",
        "--task",
        "generate",
        "--option",
        "step_ms=1",
        "--option",
        "context_length=256",
    ),
}


class FuzzCluster:
    """nats-server, one gateway and the two sim workers, as real processes, logs in files."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="shoal-fuzz-"))
        self.env = {
            **os.environ,
            "SHOAL_STATE_DIR": str(self.dir / "state"),
            "SHOAL_ADMIN_TOKEN": ADMIN_TOKEN,
            "SHOAL_LOG_LEVEL": "WARNING",
            "SHOAL_THREADS": "1",
        }
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.url = ""

    def __enter__(self) -> FuzzCluster:
        from shoal.broker.embedded import EmbeddedNats

        self.nats = EmbeddedNats(store_dir=self.dir / "nats")
        self.nats.start()
        port = free_port()
        self._spawn("gateway", "gateway", "--nats", self.nats.url, "--port", str(port))
        self.url = f"http://127.0.0.1:{port}"
        for model, args in WORKER_ARGS.items():
            self._spawn(model, "worker", "--nats", self.nats.url, "--model", model, *args)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.dead():
                raise RuntimeError(f"a process exited while starting: {self.dead()}")
            try:
                if normal_request_works(self.url):
                    return self
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.5)
        raise RuntimeError("the cluster did not answer within 120 s")

    def __exit__(self, *exc: object) -> None:
        for process in self.processes.values():
            process.terminate()
        for process in self.processes.values():
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
        self.nats.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _spawn(self, name: str, *args: str) -> None:
        with (self.dir / f"{name}.log").open("wb") as log:
            self.processes[name] = subprocess.Popen(
                [sys.executable, "-m", "shoal", *args],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=child_preexec,
            )

    def dead(self) -> list[str]:
        return [name for name, p in self.processes.items() if p.poll() is not None]

    def logs(self) -> dict[str, str]:
        logs = {
            name: (self.dir / f"{name}.log").read_text(errors="replace") for name in self.processes
        }
        logs["nats-server"] = self.nats.log_tail()
        return logs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="how long to fuzz")
    parser.add_argument("--batch", type=int, default=500, help="examples per hypothesis run")
    args = parser.parse_args()
    report = FuzzReport()
    with FuzzCluster() as cluster:
        started = time.monotonic()
        while time.monotonic() - started < args.minutes * 60:
            probe(cluster.url, args.batch, report)
        normal = normal_request_works(cluster.url)
        dead = cluster.dead()
        tracebacks = [name for name, text in cluster.logs().items() if "Traceback" in text]
        summary = {
            **report.summary(),
            "seconds": round(time.monotonic() - started, 1),
            "normal_request_after": normal,
            "dead_processes": dead,
            "logs_with_tracebacks": tracebacks,
        }
        if tracebacks:
            summary["log_excerpts"] = {name: cluster.logs()[name][-3000:] for name in tracebacks}
    print(json.dumps(summary, indent=1))
    ok = not report.failures and normal and not dead and not tracebacks
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
