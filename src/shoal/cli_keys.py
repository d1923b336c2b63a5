"""`shoal keys create|list|revoke`: the API keys of the inference routes (state/keys.py).

    shoal keys create --name NAME [--model M ...]   prints the secret, once: it is not stored
    shoal keys list [--json]                        id, name, created, revoked, models
    shoal keys revoke ID                            every gateway refuses it within a second

No secret is ever taken from the command line (where the process list would show it): a
command here prints a new secret, and otherwise handles only key ids, which are not secret.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import TYPE_CHECKING

from shoal.cluster_file import add_nats_arguments, nats_auth_from_args, resolve_nats

if TYPE_CHECKING:
    from shoal.state.keys import ApiKey

# NATS and the state modules are imported when a `keys` command runs, not when `shoal` starts.

CONNECT_TIMEOUT_S = 10.0


def add_keys_parser(commands: argparse._SubParsersAction) -> None:
    """Add `keys` and its subcommands to `shoal`'s subparsers."""
    keys = commands.add_parser("keys", help="API keys for the inference routes")
    actions = keys.add_subparsers(dest="keys_command", required=True)

    create = actions.add_parser("create", help="make a key and print its secret once")
    create.add_argument("--name", required=True, help="who or what the key is for")
    create.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="MODEL",
        help="a deployment the key may use, repeatable (default: every model)",
    )
    create.add_argument("--json", action="store_true", help="the key and its secret as JSON")

    listing = actions.add_parser("list", help="the keys (never their secrets)")
    listing.add_argument("--json", action="store_true", help="one JSON document")

    revoke = actions.add_parser("revoke", help="revoke a key by id (see `shoal keys list`)")
    revoke.add_argument("id")

    for parser in (create, listing, revoke):
        add_nats_arguments(parser)


def run_keys(args: argparse.Namespace) -> int:
    """Run `shoal keys ...`; returns the exit status."""
    from shoal.state.keys import ApiKeyError

    try:
        return asyncio.run(_run(args))
    except ApiKeyError as err:
        print(f"shoal keys {args.keys_command}: {err}", file=sys.stderr)
        return 1


async def _run(args: argparse.Namespace) -> int:
    from shoal.broker.connection import connect
    from shoal.state.keys import ApiKeyError, create_key, list_keys, revoke_key

    url, auth = resolve_nats(args.nats, nats_auth_from_args(args), "admin")
    try:
        # connect() waits for a server forever (right for a service); a command says so.
        nc = await asyncio.wait_for(
            connect(url, name=f"shoal-keys-{args.keys_command}", auth=auth),
            CONNECT_TIMEOUT_S,
        )
    except TimeoutError:
        from shoal.cli import nats_unreachable  # imported here: shoal.cli imports this module

        raise ApiKeyError(nats_unreachable(url, CONNECT_TIMEOUT_S)) from None
    try:
        js = nc.jetstream()
        if args.keys_command == "create":
            record, secret = await create_key(js, args.name, args.model)
            _print_created(record, secret, args.json)
        elif args.keys_command == "list":
            _print_list(await list_keys(js), args.json)
        else:
            record = await revoke_key(js, args.id)
            print(f"revoked {record.id} ({record.name})")
    finally:
        await nc.close()
    return 0


def _print_created(record: ApiKey, secret: str, as_json: bool) -> None:
    from shoal.protocol import encode_json

    if as_json:
        print(encode_json({**_public(record), "secret": secret}).decode())
        return
    models = ", ".join(record.models) or "every model"
    print(f"created key {record.id} ({record.name}) for {models}")
    print(secret)
    print("Keep this secret now: it is shown only once and is not stored.", file=sys.stderr)


def _print_list(keys: list[ApiKey], as_json: bool) -> None:
    from shoal.protocol import encode_json

    if as_json:
        print(encode_json([_public(k) for k in keys]).decode())
        return
    print(f"{'ID':<12}  {'NAME':<24} {'CREATED':<20} {'STATE':<8} MODELS")
    for k in keys:
        state = "revoked" if k.revoked else "active"
        models = ",".join(k.models) or "*"
        print(f"{k.id:<12}  {k.name:<24} {_when(k.created_ms):<20} {state:<8} {models}")


def _public(record: ApiKey) -> dict[str, object]:
    """A key as shown to operators: everything but its hash (of no use to anyone)."""
    return {
        "id": record.id,
        "name": record.name,
        "created_ms": record.created_ms,
        "revoked": record.revoked,
        "revoked_ms": record.revoked_ms,
        "models": list(record.models),
    }


def _when(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000))
