"""What every torch runtime does before it loads a model: offline hub, threads, device."""

from __future__ import annotations

import os
from typing import Any


def import_torch(options: dict[str, Any]) -> tuple[Any, str]:
    """torch, set up from a deployment's options; and the device to run on.

    Weights never come from a hub, so the Hugging Face libraries are told so before they are
    imported. `threads` (the worker passes its thread setting) caps torch's thread pool:
    several workers on one machine would otherwise each take every core.
    `device`: cuda when available, else cpu.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    threads = int(options.get("threads") or 0)
    if threads > 0:
        torch.set_num_threads(threads)
    device = str(options.get("device", "cuda" if torch.cuda.is_available() else "cpu"))
    return torch, device
