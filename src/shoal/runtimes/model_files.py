"""Where a runtime finds its weights: a local path or a package that ships them.

Weights never come from a hub at run time. A source is either a filesystem path or
`package:NAME`, a Python package that exposes `get_model_path()` (a ready directory or file)
or `assemble(path)` (writes the weights to `path`, as the GGUF chunk packages do). Assembled
files are written once into the cache directory and reused by every later start.
"""

from __future__ import annotations

import importlib
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path


def cache_dir() -> Path:
    """`$SHOAL_CACHE_DIR`, else `$XDG_CACHE_HOME/shoal`, else `~/.cache/shoal`."""
    explicit = os.environ.get("SHOAL_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "shoal"


def resolve_source(source: str, suffix: str = "") -> Path:
    """The local path of a model source (see the module docstring).

    `suffix` names the file type an `assemble()` package writes (".gguf").
    """
    if not source:
        raise ValueError("the deployment has no source (a path or package:NAME)")
    if source.startswith("package:"):
        return _from_package(source.removeprefix("package:"), suffix)
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model source {source!r} does not exist")
    return path


def _from_package(package: str, suffix: str) -> Path:
    try:
        module = importlib.import_module(package)
    except ImportError as err:
        raise FileNotFoundError(f"model package {package!r} is not installed: {err}") from err
    if hasattr(module, "get_model_path"):
        return Path(module.get_model_path())
    if hasattr(module, "assemble"):
        target = cache_dir() / "models" / f"{package}{suffix}"
        if not target.exists():
            write_once(target, lambda path: module.assemble(str(path)))
        return target
    raise FileNotFoundError(
        f"package {package!r} has neither get_model_path() nor assemble(): it ships no model"
    )


def write_once(target: Path, write: Callable[[Path], None]) -> None:
    """Make `target` (a file or a directory) with `write(path)`, safely against other writers.

    Several workers may make the same cache entry at once: each writes a private path and
    renames it into place, so a reader never sees a half-written one. The first rename wins.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    # A name no one uses, not yet created (assemble() refuses to overwrite an existing file).
    partial = target.parent / f".{target.name}.{os.getpid()}.{uuid.uuid4().hex}.part"
    try:
        write(partial)
        try:
            os.replace(partial, target)
        except OSError:
            if not target.exists():
                raise  # not the race with another writer: a real failure
    finally:
        if partial.is_dir():
            shutil.rmtree(partial, ignore_errors=True)
        else:
            partial.unlink(missing_ok=True)
