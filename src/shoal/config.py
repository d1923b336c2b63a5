"""Settings from flags and `SHOAL_*` environment variables (flags win)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, replace
from typing import NoReturn, TypeVar

from shoal.protocol import ModelSpec

T = TypeVar("T", int, float, str)

# argparse's exit status for a command line it refuses; a refused `SHOAL_*` setting exits with
# it too. `shoal up` stops when a child exits with it: started again the same way, the child
# would be refused again (before, a worker refused its SHOAL_THREADS forever, restarted with
# backoff).
USAGE_EXIT_CODE = 2


def refuse_setting(message: str) -> NoReturn:
    """Stop the command: a setting is wrong, and starting it again will not mend it."""
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(USAGE_EXIT_CODE)


def env_default(name: str, fallback: T) -> T:
    """The value of `SHOAL_<name>` converted to the fallback's type, else the fallback."""
    raw = os.environ.get(f"SHOAL_{name}")
    if raw is None or raw == "":
        return fallback
    try:
        return type(fallback)(raw)
    except ValueError:
        refuse_setting(f"SHOAL_{name}={raw!r} is not a valid {type(fallback).__name__}")


def env_choice(name: str, fallback: str, choices: tuple[str, ...]) -> str:
    """The value of `SHOAL_<name>`, which must be one of `choices`, else the fallback.

    For a flag with choices: argparse checks a value given on the command line, not a default,
    so an unchecked `SHOAL_BATCH_WAIT=eager` reached `shoal up`'s workers as `--batch-wait
    eager`, and each exited at its start, again and again."""
    value = env_default(name, fallback)
    if value not in choices:
        refuse_setting(f"SHOAL_{name}={value!r} is not one of: {', '.join(choices)}")
    return value


DEFAULT_INBOX_PREFIX = "_INBOX"


@dataclass(frozen=True)
class NatsAuth:
    """Who a process is to NATS and how it reaches it: read once, passed to `connect()`.

    Either a user and password (the embedded server's roles), or a NATS `.creds` file (JWT and
    NKey seed, for an operator-run cluster); TLS files for a server off this machine. Secrets
    are read from the environment or a file, never from the command line (`ps` shows it).
    `inbox_prefix` is where replies to this process's requests arrive: the embedded server
    lets each role subscribe only to its own prefix, so no role sees another's pulled work.
    """

    user: str = ""
    password: str = field(default="", repr=False)
    password_file: str = ""  # where `password` was read from, handed on to children
    creds_file: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    inbox_prefix: str = DEFAULT_INBOX_PREFIX

    @property
    def given(self) -> bool:
        """Whether this names an identity (a user or a .creds file), not only TLS files."""
        return bool(self.user or self.creds_file)

    @classmethod
    def read(
        cls,
        *,
        user: str | None = None,
        password_file: str | None = None,
        creds_file: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ) -> NatsAuth:
        """From flags (a None falls back to its variable): `SHOAL_NATS_USER`,
        `SHOAL_NATS_PASSWORD` or the first line of `SHOAL_NATS_PASSWORD_FILE`,
        `SHOAL_NATS_CREDS`, `SHOAL_NATS_TLS_CA`, `SHOAL_NATS_TLS_CERT`, `SHOAL_NATS_TLS_KEY`,
        `SHOAL_NATS_INBOX_PREFIX`."""
        password_path = _or_env(password_file, "NATS_PASSWORD_FILE")
        return cls(
            user=_or_env(user, "NATS_USER"),
            password=_read_password(password_path),
            password_file=password_path,
            creds_file=_or_env(creds_file, "NATS_CREDS"),
            tls_ca=_or_env(tls_ca, "NATS_TLS_CA"),
            tls_cert=_or_env(tls_cert, "NATS_TLS_CERT"),
            tls_key=_or_env(tls_key, "NATS_TLS_KEY"),
            inbox_prefix=_or_env(None, "NATS_INBOX_PREFIX") or DEFAULT_INBOX_PREFIX,
        )

    def without_password(self) -> NatsAuth:
        """This auth less its password, to hand to another process (`with_password_read`
        there): a process's environment is readable in /proc for as long as it runs."""
        return replace(self, password="")

    def with_password_read(self) -> NatsAuth:
        """This auth with its password read as `read` reads it: from `password_file`, else
        from `SHOAL_NATS_PASSWORD`."""
        return replace(self, password=_read_password(self.password_file))

    def environment(self, password_file: str = "") -> dict[str, str]:
        """The `SHOAL_NATS_*` variables that make a child process read this same auth.

        With a password file (`password_file`, else the one this was read from), the child
        reads the password from it and `SHOAL_NATS_PASSWORD` is emptied; every variable is
        set, so none is inherited.
        """
        password_file = password_file or self.password_file
        return {
            "SHOAL_NATS_USER": self.user,
            "SHOAL_NATS_PASSWORD": "" if password_file else self.password,
            "SHOAL_NATS_PASSWORD_FILE": password_file,
            "SHOAL_NATS_CREDS": self.creds_file,
            "SHOAL_NATS_TLS_CA": self.tls_ca,
            "SHOAL_NATS_TLS_CERT": self.tls_cert,
            "SHOAL_NATS_TLS_KEY": self.tls_key,
            "SHOAL_NATS_INBOX_PREFIX": self.inbox_prefix,
        }


def _read_password(password_file: str) -> str:
    """The first line of `password_file`, else `SHOAL_NATS_PASSWORD`."""
    return read_secret_file(password_file) if password_file else _or_env(None, "NATS_PASSWORD")


def _or_env(value: str | None, name: str) -> str:
    return value if value is not None else os.environ.get(f"SHOAL_{name}", "")


def read_secret_file(path: str) -> str:
    """The first line of a secret file, stripped; a clear exit when it is missing or empty."""
    try:
        with open(path, encoding="utf-8") as file:
            secret = file.readline().strip()
    except OSError as err:
        raise SystemExit(f"shoal: cannot read the secret file {path}: {err}") from None
    if not secret:
        raise SystemExit(f"shoal: the secret file {path} is empty")
    return secret


@dataclass(frozen=True)
class QueueSettings:
    """Limits of the work stream and its consumers (set by whoever creates them first)."""

    max_queued_per_model: int = 10_000
    ack_wait_s: float = 10.0
    max_deliver: int = 5
    # The only publish it has to catch is the gateway's one retry, within 2 x 2 s of the first
    # (broker/publish.py). nats-server keeps every id of the window, and each expired one until
    # its id list is compacted (up to ~4 windows' worth): JetStream's default 120 s grew the
    # server's RSS from 23 to 53 MB over ~6 minutes at ~330 messages/s (docs/benchmarks.md, Soak).
    duplicate_window_s: float = 30.0

    @classmethod
    def from_environment(cls) -> QueueSettings:
        """`SHOAL_MAX_QUEUED`, `SHOAL_ACK_WAIT`, `SHOAL_MAX_DELIVER`, `SHOAL_DEDUP_WINDOW`."""
        return cls(
            max_queued_per_model=env_default("MAX_QUEUED", cls.max_queued_per_model),
            ack_wait_s=env_default("ACK_WAIT", cls.ack_wait_s),
            max_deliver=env_default("MAX_DELIVER", cls.max_deliver),
            duplicate_window_s=env_default("DEDUP_WINDOW", cls.duplicate_window_s),
        )


@dataclass(frozen=True)
class LatencyTargets:
    """What the batch profile may spend: one batch's time, and the time between two tokens."""

    batch_s: float = 1.0
    token_s: float = 0.25  # at least 4 tokens a second per stream, about reading speed

    @classmethod
    def from_environment(cls) -> LatencyTargets:
        """`SHOAL_BATCH_LATENCY_TARGET` and `SHOAL_TOKEN_LATENCY_TARGET` (seconds)."""
        return cls(
            batch_s=env_default("BATCH_LATENCY_TARGET", cls.batch_s),
            token_s=env_default("TOKEN_LATENCY_TARGET", cls.token_s),
        )


@dataclass(frozen=True)
class HttpTimeouts:
    """How long a client may take to send a request: slow clients hold a connection each."""

    # From a request's first byte to its last header.
    header_s: float = 10.0
    # To read a request's whole body, once its headers are in (408 past it).
    body_s: float = 30.0
    # An idle connection (new, or between two requests) is closed after this. Longer than
    # clients and load balancers keep theirs (60 s is common), so they close first: a client
    # that sends on a connection just as the server closes it loses that request.
    keep_alive_s: float = 75.0

    @classmethod
    def from_environment(cls) -> HttpTimeouts:
        """`SHOAL_HEADER_TIMEOUT`, `SHOAL_BODY_TIMEOUT`, `SHOAL_KEEP_ALIVE_TIMEOUT` (seconds)."""
        return cls(
            header_s=env_default("HEADER_TIMEOUT", cls.header_s),
            body_s=env_default("BODY_TIMEOUT", cls.body_s),
            keep_alive_s=env_default("KEEP_ALIVE_TIMEOUT", cls.keep_alive_s),
        )


API_KEY_MODES = ("auto", "required", "off")
HTTP_SERVERS = ("uvicorn", "granian")
# How a worker forms batches: wait a little for a fuller one when that pays, or never.
BATCH_WAITS = ("adaptive", "off")

# One gateway process serves about a core's worth of requests: `shoal up` gives the gateway
# one process per this many cores.
CORES_PER_LOCAL_GATEWAY = 4
MAX_LOCAL_GATEWAYS = 8


def local_gateway_processes(cores: int | None) -> int:
    """`shoal up`'s gateway processes on a machine with `cores` (None: unknown, one).

    Two from 2 cores, then one per `CORES_PER_LOCAL_GATEWAY` cores, at most
    `MAX_LOCAL_GATEWAYS`. On 2 cores two processes served 1.3x one's requests at 32 simulated
    workers, level at 1 and 8, and level on the one-worker hot path (docs/benchmarks.md,
    "Two gateway processes by default"); above 2 cores the rule is the per-process rate, not
    a measurement. `shoal gateway` stays at one: a deployment scales it by replicas.
    """
    if cores is None or cores < 2:
        return 1
    return min(MAX_LOCAL_GATEWAYS, max(2, cores // CORES_PER_LOCAL_GATEWAY))


@dataclass(frozen=True)
class GatewaySettings:
    nats_url: str
    nats_auth: NatsAuth = field(default_factory=NatsAuth)
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 4 * 1024 * 1024
    request_timeout_s: float = 60.0
    # A stream that has started and then sends nothing for this long ends with an error
    # event (its worker is gone and no other worker restarted it).
    stream_idle_timeout_s: float = 30.0
    retry_after_s: int = 1
    http_server: str = "uvicorn"
    # Gateway processes sharing the port (the kernel spreads connections over them): one
    # Python process serves about one core's worth of requests.
    processes: int = 1
    queue: QueueSettings = field(default_factory=QueueSettings)
    admin_token: str = ""  # empty: the admin API (/admin/models) is off
    # API keys on the inference routes (gateway/auth.py): "auto" requires them unless the
    # gateway listens on loopback only, "required" always, "off" never (`--no-auth`).
    api_keys: str = "auto"
    http_timeouts: HttpTimeouts = field(default_factory=HttpTimeouts)
    # How long an Idempotency-Key's answer is kept (`SHOAL_IDEMPOTENCY_WINDOW`, seconds): the
    # TTL of the bucket, set by the gateway that creates it.
    idempotency_window_s: float = field(
        default_factory=lambda: env_default("IDEMPOTENCY_WINDOW", 600.0)
    )


def default_memory_budget_mb() -> float:
    """Half of this machine's memory: room for the models, the rest for everything else."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**20 / 2
    except (OSError, ValueError):
        return 4096.0


@dataclass(frozen=True)
class WorkerSettings:
    nats_url: str
    nats_auth: NatsAuth = field(default_factory=NatsAuth)
    # Models loaded at start and kept (pinned); a fleet worker may start with none.
    models: tuple[ModelSpec, ...] = ()
    # Models to load at start and keep, named only: their spec is read from the deployments.
    deployed_models: tuple[str, ...] = ()
    # 0: profile the model on first load and use the stored profile (zero tuning).
    max_batch_items: int = 0
    max_batch_tokens: int = 8192
    poll_s: float = 1.0
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    queue: QueueSettings = field(default_factory=QueueSettings)
    # Placement by pulling: load any deployed model that has a backlog nobody serves.
    fleet: bool = False
    memory_budget_mb: float = field(default_factory=default_memory_budget_mb)
    idle_unload_s: float = 600.0  # a placed model with no work this long is unloaded; 0: never
    min_residency_s: float = 10.0  # a placed model is not evicted sooner (no thrashing)
    placement_interval_s: float = 0.5
    latency_targets: LatencyTargets = field(default_factory=LatencyTargets)
    # Wait a little for a fuller batch when that pays (worker/batch_wait.py); False: eager.
    adaptive_batch_wait: bool = True
    # Threads each runtime may use (torch, llama.cpp); 0: the runtime's own choice.
    runtime_threads: int = 0
