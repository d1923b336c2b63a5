"""Child-process hygiene shared by everything that starts processes."""

from __future__ import annotations

import ctypes
import signal
import sys

_PR_SET_PDEATHSIG = 1


def child_preexec() -> None:
    """Runs in a child before exec: the child gets SIGTERM if its parent dies.

    So a supervisor killed with SIGKILL still leaves no nats-server, gateway or worker behind.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
