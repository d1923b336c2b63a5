"""Users and permissions of the embedded nats-server, as a config file, and private files.

The server knows a few users, each with a random password and the subjects it may publish
to and subscribe to; a connection without a user is refused. Which role gets which subjects is
the command's business (`shoal.cluster_auth`); this module only knows how NATS and JetStream
spell them and how to write them down where only this user can read them.

How JetStream subjects map to operations (nats-server 2.10+, nats.py 2.x):

- every JetStream API call is a request to `$JS.API.<VERB>...`; its answer comes back to the
  caller's inbox (`<inbox prefix>.>`), published by the server itself, so only the request
  needs a publish permission;
- a publish into a stream is a request to the stream's subject (a KV put: `$KV.<bucket>.<key>`);
- pulled messages arrive on the puller's inbox; acks go to `$JS.ACK.<stream>.<consumer>.>`;
- a KV read is `$JS.API.DIRECT.GET.KV_<bucket>...` (or `STREAM.MSG.GET`), a watch is an
  ephemeral consumer (`CONSUMER.CREATE`) whose flow control is answered on `$JS.FC.KV_<bucket>.>`.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

JS_API = "$JS.API"


@dataclass(frozen=True)
class Permissions:
    """The subjects a user may publish to and subscribe to; anything else is refused."""

    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()

    def __add__(self, other: Permissions) -> Permissions:
        return Permissions(
            tuple(dict.fromkeys((*self.publish, *other.publish))),
            tuple(dict.fromkeys((*self.subscribe, *other.subscribe))),
        )


@dataclass(frozen=True)
class NatsUser:
    """One user of the server. `permissions` None: every subject (the admin)."""

    name: str
    password: str = field(repr=False)
    permissions: Permissions | None


def generate_password() -> str:
    """A random password (256 bits, URL-safe characters: nothing to quote in a config)."""
    return secrets.token_urlsafe(32)


def stream_info(stream: str) -> Permissions:
    """Look a stream up, and create it when it is missing (never update or delete it): every
    component creates what it needs if it starts first, and a create with a configuration
    other than the existing one is refused by the server."""
    return Permissions(
        publish=(f"{JS_API}.STREAM.INFO.{stream}", f"{JS_API}.STREAM.CREATE.{stream}")
    )


def consumer_info(stream: str) -> Permissions:
    """Read the state (backlog) of a stream's consumers."""
    return Permissions(publish=(f"{JS_API}.CONSUMER.INFO.{stream}.*",))


def consumer_create(stream: str) -> Permissions:
    """Create consumers on a stream (with or without a name and filter in the subject)."""
    return Permissions(
        publish=(
            f"{JS_API}.CONSUMER.CREATE.{stream}",
            f"{JS_API}.CONSUMER.CREATE.{stream}.>",
            f"{JS_API}.CONSUMER.DURABLE.CREATE.{stream}.>",
        )
    )


def pull(stream: str) -> Permissions:
    """Pull from a stream's consumers and acknowledge (ack, nak, in progress) what was pulled."""
    return Permissions(publish=(f"{JS_API}.CONSUMER.MSG.NEXT.{stream}.*", f"$JS.ACK.{stream}.>"))


def kv_read(bucket: str) -> Permissions:
    """Read and watch a KV bucket (and create it if it is missing)."""
    stream = f"KV_{bucket}"
    return (
        stream_info(stream)
        + consumer_create(stream)
        + Permissions(
            publish=(
                f"{JS_API}.DIRECT.GET.{stream}",
                f"{JS_API}.DIRECT.GET.{stream}.>",
                f"{JS_API}.STREAM.MSG.GET.{stream}",
                f"{JS_API}.CONSUMER.INFO.{stream}.*",
                f"{JS_API}.CONSUMER.DELETE.{stream}.*",
                f"$JS.FC.{stream}.>",
            )
        )
    )


def kv_write(bucket: str) -> Permissions:
    """Read, watch and write (put, create, update, delete) a KV bucket's keys."""
    return kv_read(bucket) + Permissions(publish=(f"$KV.{bucket}.>",))


def object_store(bucket: str) -> Permissions:
    """Put, get and delete objects of an object store (and create it if it is missing).

    A get reads the chunks through an ordered consumer found by subject (`STREAM.NAMES`);
    a put or a delete purges the object's old chunks (`STREAM.PURGE`, by subject).
    """
    stream = f"OBJ_{bucket}"
    return (
        stream_info(stream)
        + consumer_create(stream)
        + Permissions(
            publish=(
                f"$O.{bucket}.>",
                f"{JS_API}.STREAM.NAMES",
                f"{JS_API}.STREAM.PURGE.{stream}",
                f"{JS_API}.DIRECT.GET.{stream}",
                f"{JS_API}.DIRECT.GET.{stream}.>",
                f"{JS_API}.STREAM.MSG.GET.{stream}",
                f"{JS_API}.CONSUMER.INFO.{stream}.*",
                f"{JS_API}.CONSUMER.DELETE.{stream}.*",
                f"$JS.FC.{stream}.>",
            )
        )
    )


def server_config(users: list[NatsUser]) -> str:
    """nats-server configuration (its parser reads JSON): these users, and no anonymous one."""
    entries = []
    for user in users:
        entry: dict[str, object] = {"user": user.name, "password": user.password}
        if user.permissions is not None:
            entry["permissions"] = {
                "publish": {"allow": list(user.permissions.publish)},
                "subscribe": {"allow": list(user.permissions.subscribe)},
            }
        entries.append(entry)
    return json.dumps({"authorization": {"users": entries}}, indent=1) + "\n"


def write_private(path: Path, text: str) -> None:
    """Write a file only this user can read (mode 0600), atomically.

    The file is created with its mode (never world-readable, not even for an instant), in a
    folder made 0700, and renamed into place so a reader never sees half of it.
    """
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(text)
    tmp.replace(path)
