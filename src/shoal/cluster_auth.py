"""Who may do what on the local cluster's NATS: the roles, their subjects, their credentials.

`shoal up` (and `shoal nats`) run the embedded nats-server with three users, one per role, each
with a fresh random password kept in `<state dir>/nats-auth/` (folder 0700, files 0600) next to
the server's config file. A connection without credentials is refused.

- `admin`: every subject. `shoal deploy|undeploy|keys|dlq|status|models`, the supervisor,
  and a gateway whose admin API is on (the admin token then guards what it writes).
- `gateway`: publish work and cancels, receive results on `shoal.reply.>`, read (and watch)
  the deployments, the API keys and the worker reports, read the work queue's backlog,
  claim Idempotency-Keys, store large request bodies. It cannot pull, read or delete queued
  work, and cannot write deployments, keys, reports, profiles or the dead-letter stream.
- `worker`: pull and ack work, publish results, watch cancels and max-delivery advisories,
  move poison messages to the dead-letter stream, write its reports, profiles and attempts,
  read the deployments, read and delete large bodies, keep answers for Idempotency-Keys. It
  cannot publish work, write a deployment or the API keys, or receive any gateway's results.

Each role receives its JetStream answers on its own inbox prefix (`_INBOX.<role>.>`): were the
inboxes shared, a gateway could subscribe to the inbox a worker pulls work into.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shoal.broker.bodies import BODIES_BUCKET
from shoal.broker.credentials import (
    NatsUser,
    Permissions,
    consumer_create,
    consumer_info,
    generate_password,
    kv_read,
    kv_write,
    object_store,
    pull,
    server_config,
    stream_info,
    write_private,
)
from shoal.broker.dlq import DLQ_STREAM, DLQ_SUBJECT_PREFIX, MAX_DELIVERIES_ADVISORY
from shoal.config import NatsAuth, read_secret_file
from shoal.protocol import (
    CANCEL_SUBJECT_PREFIX,
    REPLY_SUBJECT_PREFIX,
    WORK_STREAM,
    WORK_SUBJECT_PREFIX,
)
from shoal.state.attempts import ATTEMPTS_BUCKET
from shoal.state.deployments import MODELS_BUCKET
from shoal.state.idempotency import IDEMPOTENCY_BUCKET
from shoal.state.keys import KEYS_BUCKET
from shoal.state.profiles import PROFILES_BUCKET, REPROFILES_BUCKET
from shoal.state.workers import WORKERS_BUCKET

ADMIN = "admin"
GATEWAY = "gateway"
WORKER = "worker"
ROLES = (ADMIN, GATEWAY, WORKER)

CONFIG_NAME = "nats-server.conf"


def inbox_prefix(role: str) -> str:
    """Where a role's request answers (and pulled messages) arrive."""
    return f"_INBOX.{role}"


def role_permissions(role: str) -> Permissions | None:
    """The subjects of one role; None for the admin (every subject)."""
    if role == ADMIN:
        return None
    inbox = Permissions(subscribe=(f"{inbox_prefix(role)}.>",))
    work_queue = stream_info(WORK_STREAM) + consumer_info(WORK_STREAM)
    if role == GATEWAY:
        return (
            inbox
            + work_queue
            + Permissions(
                publish=(f"{WORK_SUBJECT_PREFIX}.>", f"{CANCEL_SUBJECT_PREFIX}.>"),
                subscribe=(f"{REPLY_SUBJECT_PREFIX}.>",),
            )
            + kv_read(MODELS_BUCKET)
            + kv_read(KEYS_BUCKET)
            + kv_read(WORKERS_BUCKET)
            # Idempotency-Key claims; large request bodies, and answers kept for retries.
            + kv_write(IDEMPOTENCY_BUCKET)
            + object_store(BODIES_BUCKET)
        )
    if role == WORKER:
        return (
            inbox
            + work_queue
            + consumer_create(WORK_STREAM)
            + pull(WORK_STREAM)
            + Permissions(
                publish=(
                    f"{REPLY_SUBJECT_PREFIX}.>",
                    f"{DLQ_SUBJECT_PREFIX}.>",
                    # A poison message is read by its sequence, stored in the dead-letter
                    # stream, then deleted from the work stream (broker/dlq.py).
                    f"$JS.API.STREAM.MSG.GET.{WORK_STREAM}",
                    f"$JS.API.STREAM.MSG.DELETE.{WORK_STREAM}",
                ),
                subscribe=(
                    f"{CANCEL_SUBJECT_PREFIX}.>",
                    f"{MAX_DELIVERIES_ADVISORY}.{WORK_STREAM}.>",
                ),
            )
            + stream_info(DLQ_STREAM)
            + kv_read(MODELS_BUCKET)
            + kv_write(WORKERS_BUCKET)
            + kv_write(PROFILES_BUCKET)
            + kv_write(REPROFILES_BUCKET)
            + kv_write(ATTEMPTS_BUCKET)
            # Answers kept for Idempotency-Key retries; large bodies, read then deleted.
            + kv_write(IDEMPOTENCY_BUCKET)
            + object_store(BODIES_BUCKET)
        )
    raise ValueError(f"unknown NATS role {role!r}; one of {', '.join(ROLES)}")


@dataclass(frozen=True)
class ClusterCredentials:
    """The folder that holds the server's config and one password file per role."""

    directory: Path

    @property
    def config_file(self) -> Path:
        return self.directory / CONFIG_NAME

    def password_file(self, role: str) -> Path:
        return self.directory / f"{role}.password"

    def auth(self, role: str) -> NatsAuth:
        """A role's credentials, read from its password file."""
        path = str(self.password_file(role))
        return NatsAuth(
            user=role,
            password=read_secret_file(path),
            password_file=path,
            inbox_prefix=inbox_prefix(role),
        )

    def environment(self, role: str) -> dict[str, str]:
        """The variables that give a child process a role: the path of its password file,
        never the password itself (a child's environment can outlive its need)."""
        auth = NatsAuth(user=role, inbox_prefix=inbox_prefix(role))
        return auth.environment(password_file=str(self.password_file(role)))


def create_cluster_credentials(directory: Path) -> ClusterCredentials:
    """Fresh passwords for every role and the server config that knows them (all 0600).

    Called once per `shoal up` (a restarted nats-server reads the same config), so the
    passwords of an earlier run stop working.
    """
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    directory.chmod(0o700)  # an existing folder keeps its mode otherwise
    credentials = ClusterCredentials(directory)
    users = [NatsUser(role, generate_password(), role_permissions(role)) for role in ROLES]
    for user in users:
        write_private(credentials.password_file(user.name), user.password + "\n")
    write_private(credentials.config_file, server_config(users))
    return credentials
