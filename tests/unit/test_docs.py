"""The config reference stays true: every key the config accepts has its row in docs/config.md."""
from __future__ import annotations

from pathlib import Path
from typing import get_args

from pydantic import BaseModel

from supervisor.config import Config

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every key path; an optional section (`critic`) has its own row and every key of it has one too."""
    out = []
    for name, field in model.model_fields.items():
        section = next((a for a in (field.annotation, *get_args(field.annotation))
                        if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if section is not None and section is not field.annotation:
            out.append(prefix + name)
        out += keys(section, f"{prefix}{name}.") if section is not None else [prefix + name]
    return out


def test_every_config_key_has_a_row_in_the_config_reference():
    rows = {line.split("|")[1].strip().strip("`") for line in DOC.read_text().splitlines() if line.startswith("| `")}
    assert not [k for k in keys(Config) if k not in rows]


def test_nothing_in_the_repository_points_at_the_design_notes_outside_it():
    """The project's contract lives in docs/ (on-disk.md's guarantees, cli.md's exit codes and states); a
    reader of a clone has nothing else."""
    root = DOC.parents[1]
    files = [p for pattern in ("*.md", "*.py", "*.yaml", "*.sh", "*.toml") for p in root.rglob(pattern)
             if not p.relative_to(root).parts[0].startswith(".") and p != Path(__file__).resolve()]
    assert [str(p.relative_to(root)) for p in files if "DESIGN.md" in p.read_text(errors="replace")] == []
