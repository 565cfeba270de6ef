"""Which warm spare holds which rank's copy of the memory tier. Pure.

Each rank's recover state is copied, every step, into a buddy that does not die with it: a warm spare on
another node (spare_placement.py already puts spares away from the ranks). The buddy is also the process that
takes the rank's place when it dies, with the state already in its memory, so a spare holds as few ranks as
the pool allows: each rank goes to the least loaded spare on another node.
"""
from __future__ import annotations


def buddy_plan(rank_nodes: list[str | None], spare_nodes: dict[str, str | None],
               held: dict[int, str] | None = None) -> dict[int, str]:
    """rank -> the name of the spare that holds its copies. `spare_nodes` are the warm spares (name -> node);
    `held` the plan in force, kept where its spare is still warm and on another node, so that a working link
    is not torn down. A rank gets no buddy when every spare shares its node."""
    held = held or {}
    plan = {r: s for r, s in held.items()
            if r < len(rank_nodes) and s in spare_nodes and not _same_node(spare_nodes[s], rank_nodes[r])}
    load = {s: sum(1 for held_by in plan.values() if held_by == s) for s in spare_nodes}
    for rank, node in enumerate(rank_nodes):
        if rank in plan:
            continue
        choices = [s for s in spare_nodes if not _same_node(spare_nodes[s], node)]
        if choices:
            spare = min(choices, key=lambda s: (load[s], list(spare_nodes).index(s)))
            plan[rank] = spare
            load[spare] += 1
    return dict(sorted(plan.items()))


def _same_node(a: str | None, b: str | None) -> bool:
    """An unknown node counts as the same: the copy must not be thought safe when it might not be."""
    return a is None or b is None or a == b


def link_steps(plan: dict[int, str], linked: dict[int, str], preparing: dict[int, str], ready: dict[int, str],
               known_slots: set[int]) -> tuple[list[int], list[int]]:
    """What linking does for `plan` this step: the ranks whose planned holder is ready (`ready`: rank -> the
    holder prepared for it) link now, before their copy; the planned ranks not linked to their holder, not being
    prepared for it, and whose slots are known, have it prepared (beside the next step). A holder prepared for a
    rank that the plan moved elsewhere is left unused."""
    now = sorted(r for r, holder in ready.items() if plan.get(r) == holder)
    prepare = sorted(r for r, holder in plan.items()
                     if linked.get(r) != holder and r not in now and preparing.get(r) != holder and r in known_slots)
    return now, prepare
