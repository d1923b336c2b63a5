"""The folder layout is the architecture: no module imports from a layer above its own.

docs/architecture.md ("Parts") lists the layers; this test reads every module's imports
(at module level and inside functions) and fails on one that reaches upwards.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "shoal"

# What each part may import, besides itself. A part not listed may import anything.
ALLOWED: dict[str, set[str]] = {
    "protocol": set(),
    "config": {"protocol"},
    "api": {"protocol", "runtimes.base"},
    "runtimes": {"protocol", "process"},  # engines start children (process.py)
    "broker": {"protocol", "config", "process"},
    "state": {"protocol", "config", "broker", "runtimes.registry", "runtimes.gguf_lora"},
    "observability": {"protocol"},
    "worker": {"protocol", "config", "api", "runtimes", "broker", "state", "observability"},
    "gateway": {
        "protocol",
        "config",
        "api",
        "broker",
        "state",
        "observability",
        "catalog",
        "runtimes.registry",
        "process",  # the serving processes' garbage-collector setting
    },
}


def _part(module: str) -> str:
    return module.split(".")[0]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shoal."):
            found.add(node.module.removeprefix("shoal."))
        elif isinstance(node, ast.Import):
            found.update(
                a.name.removeprefix("shoal.") for a in node.names if a.name.startswith("shoal.")
            )
    return found


def _allowed(part: str, target: str) -> bool:
    if _part(target) == part:
        return True
    return any(target == a or target.startswith(a + ".") for a in ALLOWED[part])


def test_no_module_imports_from_a_layer_above_it():
    violations = []
    for path in SRC.rglob("*.py"):
        module = ".".join(path.relative_to(SRC).with_suffix("").parts)
        part = _part(module)
        if part not in ALLOWED:
            continue
        for target in _imports(path):
            if not _allowed(part, target):
                violations.append(f"{module} imports shoal.{target}")
    assert not violations, "\n".join(sorted(violations))


def test_the_gateway_imports_no_runtime_and_no_numpy():
    code = (
        "import sys, shoal.gateway.app, shoal.gateway.server\n"
        "bad = [m for m in sys.modules if m == 'numpy' or m.startswith('shoal.runtimes.')\n"
        "       and m != 'shoal.runtimes.registry']\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _documented_modules(doc: str) -> set[str]:
    """The modules docs/architecture.md's module table names. A cell may list several of one
    folder, the folder given once: `runtimes/a.py`, `b.py`."""
    names: set[str] = set()
    for line in doc.splitlines():
        if not line.startswith("| `"):
            continue
        folder = ""
        for name in line.split("|")[1].replace("`", "").split(","):
            name = name.strip()
            if not name.endswith(".py"):
                continue
            if "/" in name:
                folder = name.rpartition("/")[0] + "/"
                names.add(name)
            else:
                names.add(folder + name)
    return names


def test_the_module_table_lists_every_module():
    doc = (SRC.parent.parent / "docs" / "architecture.md").read_text()
    modules = {
        str(path.relative_to(SRC))
        for path in SRC.rglob("*.py")
        if path.name not in ("__init__.py", "__main__.py")
    }
    documented = _documented_modules(doc)
    missing, gone = sorted(modules - documented), sorted(documented - modules)
    assert not missing, f"modules missing from docs/architecture.md's table: {missing}"
    assert not gone, f"docs/architecture.md's table names modules that are gone: {gone}"
