"""What every benchmark shares: its command line (`--quick`, `--json`, and `--address` for those that run jobs)
and its report (an aligned table on stdout, the figures as JSON on request)."""
from __future__ import annotations

import argparse
import json


def arguments(doc: str, quick: str, cluster: bool = True) -> argparse.ArgumentParser:
    """A parser with the options every benchmark has; `quick` says what --quick does (CI runs it)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=quick)
    if cluster:
        parser.add_argument("--address", help="an existing Ray cluster (default: start a local 3-node one)")
    parser.add_argument("--json", help="also write the figures to this file")
    return parser


def report(rows: list[tuple[str, ...]], figures: dict, json_path: str | None) -> None:
    """Print rows of (label, value, ...) as a table, values right-aligned in columns; write `figures` as JSON."""
    width = max(len(r[0]) for r in rows)
    cell = max((len(c) for r in rows for c in r[1:]), default=0)
    for label, *cells in rows:
        print(f"{label:<{width}}  " + "  ".join(f"{c:>{cell}}" if len(cells) > 1 else c for c in cells))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(figures, f, indent=1)
