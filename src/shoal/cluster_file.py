"""Where a running local cluster says where it is, so other `shoal` commands find it.

`shoal up` and `shoal nats` write `<state dir>/cluster.json`; the state directory is
`$SHOAL_STATE_DIR`, else `~/.local/state/shoal`. A file whose process is gone is ignored.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path


def state_dir() -> Path:
    configured = os.environ.get("SHOAL_STATE_DIR")
    return Path(configured) if configured else Path.home() / ".local" / "state" / "shoal"


@dataclass(frozen=True)
class ClusterInfo:
    nats_url: str
    gateway_url: str
    pid: int


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


def resolve_nats_url(flag: str | None) -> str:
    """`--nats`, else `SHOAL_NATS`, else the local cluster's; a clear exit when none."""
    url = flag or os.environ.get("SHOAL_NATS")
    if url:
        return url
    info = read_cluster_info()
    if info is not None:
        return info.nats_url
    raise SystemExit(
        "no NATS server given and no local cluster running: start one with `shoal up` "
        "(or `shoal nats`), or pass --nats URL / set SHOAL_NATS"
    )
