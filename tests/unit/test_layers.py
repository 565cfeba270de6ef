"""Imports run one way: entry points -> tools -> control -> cluster, checkpoint -> testing (fault points) and
config; workers/ import only the on-disk format and the fault points, never the control layer."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENTRY = {"supervisor.cli", "supervisor.launch", "supervisor.progress", "supervisor.submit", "supervisor.demo",
         "supervisor.__main__"}
BASE = ("supervisor.config", "supervisor.exit_codes")  # importable from every layer but workers/
# what each layer may import from this repo (beside itself, BASE and workers/)
MAY_IMPORT = {
    "supervisor.tools": ("supervisor.control", "supervisor.cluster", "supervisor.checkpoint", "supervisor.testing"),
    "supervisor.control": ("supervisor.cluster", "supervisor.checkpoint", "supervisor.testing"),
    "supervisor.cluster": ("supervisor.checkpoint", "supervisor.testing"),
    "supervisor.checkpoint": ("supervisor.testing",),
    "supervisor.testing": (),
    "workers": ("supervisor.config", "supervisor.checkpoint", "supervisor.testing"),
}


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m.split(".")[0] in ("supervisor", "workers")}


MODULES = sorted(p for d in ("supervisor", "workers") for p in (REPO / d).rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_import_runs_back_up(path: Path):
    name = module_name(path)
    if name in ENTRY or name in BASE or name == "supervisor":
        return
    layer = next(layer for layer in MAY_IMPORT if name == layer or name.startswith(layer + "."))
    allowed = (layer, *BASE, "workers", *MAY_IMPORT[layer])
    if layer == "workers":
        allowed = ("workers", *MAY_IMPORT[layer])
    bad = [m for m in imports(path)
           if not any(m == a or m.startswith(a + ".") for a in allowed) and m not in ("supervisor", "workers")]
    assert not bad, f"{name} ({layer}) imports {bad}"
