"""`shoal dlq list|show|replay|purge`: the dead-letter queue (broker/dlq.py).

    shoal dlq list [--json]              the entries: sequence, model, deliveries, last error
    shoal dlq show SEQ [--json]          one entry with its headers and request bodies
    shoal dlq replay SEQ... | --all      put entries back on their work queues
    shoal dlq purge SEQ... | --all       delete entries

A work message lands here after `max_deliver` deliveries that none of its workers answered
(each crashed, was killed or hung on it); its clients were already told (a 502
`dead_lettered` error). Replaying gives each request a fresh deadline; its results reach no
one, and if it fails again it comes back here.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import TYPE_CHECKING

from shoal.cluster_file import add_nats_arguments, nats_auth_from_args, resolve_nats

if TYPE_CHECKING:
    from shoal.broker.dlq import DeadLetter

# NATS is imported when a `dlq` command runs, not when `shoal` starts.

CONNECT_TIMEOUT_S = 10.0


class _CommandError(Exception):
    pass


def add_dlq_parser(commands: argparse._SubParsersAction) -> None:
    """Add `dlq` and its subcommands to `shoal`'s subparsers."""
    dlq = commands.add_parser("dlq", help="the dead-letter queue: poison work messages")
    actions = dlq.add_subparsers(dest="dlq_command", required=True)

    listing = actions.add_parser("list", help="the dead letters, oldest first")
    listing.add_argument("--json", action="store_true", help="one JSON document")

    show = actions.add_parser("show", help="one dead letter with its request bodies")
    show.add_argument("seq", type=int)
    show.add_argument("--json", action="store_true", help="one JSON document")

    replay = actions.add_parser("replay", help="put dead letters back on their work queues")
    replay.add_argument("seq", type=int, nargs="*")
    replay.add_argument("--all", action="store_true", help="every dead letter")
    replay.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds each replayed request may take (default: its original budget)",
    )

    purge = actions.add_parser("purge", help="delete dead letters")
    purge.add_argument("seq", type=int, nargs="*")
    purge.add_argument("--all", action="store_true", help="every dead letter")

    for parser in (listing, show, replay, purge):
        add_nats_arguments(parser)


def run_dlq(args: argparse.Namespace) -> int:
    """Run `shoal dlq ...`; returns the exit status."""
    from shoal.broker.dlq import DeadLetterError

    if args.dlq_command in ("replay", "purge") and bool(args.seq) == bool(args.all):
        print(f"shoal dlq {args.dlq_command}: give sequence numbers or --all", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_run(args))
    except (DeadLetterError, _CommandError) as err:
        print(f"shoal dlq {args.dlq_command}: {err}", file=sys.stderr)
        return 1


async def _run(args: argparse.Namespace) -> int:
    from shoal.broker import dlq
    from shoal.broker.connection import connect
    from shoal.protocol import encode_json

    url, auth = resolve_nats(args.nats, nats_auth_from_args(args), "admin")
    try:
        # connect() waits for a server forever (right for a service); a command says so.
        nc = await asyncio.wait_for(
            connect(url, name=f"shoal-dlq-{args.dlq_command}", auth=auth),
            CONNECT_TIMEOUT_S,
        )
    except TimeoutError:
        from shoal.cli import nats_unreachable  # imported here: shoal.cli imports this module

        raise _CommandError(nats_unreachable(url, CONNECT_TIMEOUT_S)) from None
    try:
        js = nc.jetstream()
        command = args.dlq_command
        if command == "list":
            entries = await dlq.list_dead_letters(js)
            if args.json:
                print(encode_json(entries).decode())
            else:
                _print_list(entries)
        elif command == "show":
            entry = await dlq.get_dead_letter(js, args.seq)
            print(encode_json(entry).decode() if args.json else _describe(entry))
        elif command == "replay":
            seqs = args.seq or [e.seq for e in await dlq.list_dead_letters(js, limit=1 << 30)]
            for seq in seqs:
                work_seq = await dlq.replay(js, seq, args.timeout)
                print(f"replayed {seq} (work message {work_seq})")
        else:
            if args.all:
                print(f"purged {await dlq.purge(js)}")
            else:
                for seq in args.seq:
                    await dlq.purge(js, seq)
                print(f"purged {len(args.seq)}")
    finally:
        await nc.close()
    return 0


def _print_list(entries: list[DeadLetter]) -> None:
    if not entries:
        print("no dead letters")
        return
    print(f"{'SEQ':>6}  {'WHEN':<19}  {'MODEL':<24} {'REQS':>4} {'TRIES':>5}  LAST ERROR")
    for e in entries:
        error = e.last_error if len(e.last_error) <= 80 else e.last_error[:77] + "..."
        print(
            f"{e.seq:>6}  {_when(e.dead_lettered_ms):<19}  {e.model:<24} "
            f"{len(e.requests):>4} {e.deliveries:>5}  {error}"
        )


def _describe(entry: DeadLetter) -> str:
    lines = [
        f"dead letter {entry.seq}",
        f"  model         {entry.model}",
        f"  queue         {entry.work_subject} (was message {entry.work_seq})",
        f"  deliveries    {entry.deliveries}",
        f"  last error    {entry.last_error}",
        f"  dead-lettered {_when(entry.dead_lettered_ms)}",
        f"  replays       {entry.replays}",
        f"  reply to      {entry.reply_to}",
        f"  bytes         {entry.bytes}",
        "  headers",
        *(f"    {name}: {value}" for name, value in sorted(entry.headers.items())),
        f"  requests      {len(entry.requests)}",
    ]
    for request in entry.requests:
        lines.append(f"    {request.request_id} {request.endpoint} ({request.body_bytes} bytes)")
        lines.append(f"      {request.body}")
    return "\n".join(lines)


def _when(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000)) if ms else "-"
