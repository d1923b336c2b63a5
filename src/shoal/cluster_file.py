"""Where a running local cluster says where it is, so other `shoal` commands find it.

`shoal up` and `shoal nats` write `<state dir>/cluster.json`; the state directory is
`$SHOAL_STATE_DIR`, else `~/.local/state/shoal`. A file whose process is gone is ignored.
The file names the folder of the cluster's NATS credentials (`cluster_auth.py`), so a command
run by the same user connects as the role it needs without being given a password.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from shoal.config import NatsAuth


def state_dir() -> Path:
    configured = os.environ.get("SHOAL_STATE_DIR")
    return Path(configured) if configured else Path.home() / ".local" / "state" / "shoal"


@dataclass(frozen=True)
class ClusterInfo:
    nats_url: str
    gateway_url: str
    pid: int
    # The folder of the embedded server's credentials; empty for a cluster on another NATS.
    nats_auth_dir: str = ""


def _path() -> Path:
    return state_dir() / "cluster.json"


def write_cluster_info(info: ClusterInfo) -> None:
    path = _path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(info)))
    tmp.replace(path)


def remove_cluster_info(pid: int) -> None:
    info = read_cluster_info()
    if info is not None and info.pid == pid:
        _path().unlink(missing_ok=True)


def read_cluster_info() -> ClusterInfo | None:
    """The running local cluster, or None when there is none (or its process is gone)."""
    try:
        info = ClusterInfo(**json.loads(_path().read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return info if _alive(info.pid) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def add_nats_arguments(parser: argparse.ArgumentParser) -> None:
    """`--nats URL` and how to authenticate to it (each flag also reads a `SHOAL_*` variable).

    No flag takes a secret: a password comes from a file or the environment, never argv.
    """
    parser.add_argument(
        "--nats",
        default=None,
        help="NATS URL of an existing cluster (env SHOAL_NATS); default: the local cluster",
    )
    parser.add_argument(
        "--nats-creds",
        default=None,
        metavar="PATH",
        help="NATS .creds file (JWT + NKey seed) of an operator-run cluster (env SHOAL_NATS_CREDS)",
    )
    parser.add_argument(
        "--nats-user",
        default=None,
        help="NATS user (env SHOAL_NATS_USER); default: the local "
        "cluster's credentials for this command's role",
    )
    parser.add_argument(
        "--nats-password-file",
        default=None,
        metavar="PATH",
        help="file whose first line is the NATS password (env SHOAL_NATS_PASSWORD_FILE, or the "
        "password itself in SHOAL_NATS_PASSWORD)",
    )
    parser.add_argument(
        "--nats-tls-ca",
        default=None,
        metavar="PATH",
        help="CA file to verify a TLS NATS server"
        " (env SHOAL_NATS_TLS_CA); a tls:// URL uses TLS with the system's CAs",
    )
    parser.add_argument(
        "--nats-tls-cert",
        default=None,
        metavar="PATH",
        help="client certificate for mutual TLS (env SHOAL_NATS_TLS_CERT)",
    )
    parser.add_argument(
        "--nats-tls-key",
        default=None,
        metavar="PATH",
        help="the client certificate's key (env SHOAL_NATS_TLS_KEY)",
    )


def nats_auth_from_args(args: argparse.Namespace) -> NatsAuth:
    """The credentials the flags of `add_nats_arguments` (else the environment) give."""
    return NatsAuth.read(
        user=args.nats_user,
        password_file=args.nats_password_file,
        creds_file=args.nats_creds,
        tls_ca=args.nats_tls_ca,
        tls_cert=args.nats_tls_cert,
        tls_key=args.nats_tls_key,
    )


def resolve_nats(flag: str | None, auth: NatsAuth, role: str) -> tuple[str, NatsAuth]:
    """The NATS URL and credentials to use.

    The URL is `--nats`, else `SHOAL_NATS`, else the local cluster's (a clear exit when there
    is none). Credentials given by flags or the environment win; else, on the local cluster
    (no URL given, or the local cluster's URL), the credentials of `role` (`cluster_auth`
    roles: admin, gateway, worker) from its state directory; else none.
    """
    url = flag or os.environ.get("SHOAL_NATS") or ""
    info = read_cluster_info()
    if not url:
        if info is None:
            raise SystemExit(
                "no NATS server given and no local cluster running: start one with `shoal up` "
                "(or `shoal nats`), or pass --nats URL / set SHOAL_NATS"
            )
        url = info.nats_url
    if auth.given or info is None or url != info.nats_url or not info.nats_auth_dir:
        return url, auth
    from shoal.cluster_auth import ClusterCredentials  # imports NATS: only when connecting

    return url, ClusterCredentials(Path(info.nats_auth_dir)).auth(role)
