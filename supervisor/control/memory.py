"""The stats row's memory fields: each actor kind's peak, from what the step's calls already returned.

Ranks and engines return their peak with every train and generate call, warm spares with their warm-up (a
spare sits idle after it: that is its size), the Supervisor reads its own. Each kind's figure is its largest
process's peak so far (GB, 1e9 bytes): `mem/{train,engine,spare,supervisor}_peak_gb` (peak RSS) and, where
CUDA is in use, `mem/{kind}_cuda_peak_gb` (peak allocated on the device). A kind with no process is absent.
"""
from __future__ import annotations

from workers.memory import peak_memory


def largest(peaks: list[dict]) -> dict | None:
    """Per field, the largest of several processes' peaks; None when there are none."""
    return {k: max(p[k] for p in peaks if k in p) for k in {k for p in peaks for k in p}} if peaks else None


def memory_fields(train: list[dict], engines: dict | None, spares: list[dict]) -> dict[str, float]:
    fields = {}
    for kind, peak in (("train", largest(train)), ("engine", engines), ("spare", largest(spares)),
                       ("supervisor", peak_memory())):
        if peak:
            fields[f"mem/{kind}_peak_gb"] = peak["rss_gb"]
            if "cuda_gb" in peak:
                fields[f"mem/{kind}_cuda_peak_gb"] = peak["cuda_gb"]
    return fields
