"""Which holder keeps which rank's copy of the memory tier, and what a link does next. Pure.

Each rank's recover state is copied, every step, into a holder that does not die with it. A holder is a warm
spare (it then also takes the rank's place when it dies, with the state already in its memory) or, where no spare
serves, a peer rank (a new process, or a free spare, takes the dead rank's place and loads the copy from the
peer's memory). A rank's holder is the first of these that exists, so that it covers as much as it can:

1. a spare on another node: a node loss, and the place taken by the process that holds the state;
2. a peer on another node: the state outlives a node loss (the rank then needs a free spare or bundle);
3. a spare on the rank's node: a process death, its place taken warm;
4. a peer on the rank's node: a process death (ranks sharing one machine, the common single-node job).

Within a class each rank goes to the least loaded holder, so that a spare takes as few places as it can.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Holder:
    node: str | None      # None: not known yet (it never counts as another node)
    rank: int | None = None  # a peer: the rank it is (it never holds its own copies); None: a warm spare


def buddy_plan(rank_nodes: list[str | None], holders: dict[str, Holder],
               held: dict[int, str] | None = None) -> dict[int, str]:
    """rank -> the name of the holder of its copies, from `holders` (name -> Holder: the spares that have
    started, then the ranks). `held` is the plan in force: a rank keeps its holder while that holder is in
    the best class open to it, so that a working link is not torn down for an equal one."""
    held = held or {}
    classes = {rank: {name: _class(h, rank, node) for name, h in holders.items() if h.rank != rank}
               for rank, node in enumerate(rank_nodes)}
    plan = {r: name for r, name in held.items()
            if r < len(rank_nodes) and name in classes[r] and classes[r][name] == min(classes[r].values())}
    load = {name: sum(1 for h in plan.values() if h == name) for name in holders}
    order = list(holders)
    for rank in range(len(rank_nodes)):
        if rank in plan or not classes[rank]:
            continue
        name = min(classes[rank], key=lambda n: (classes[rank][n], load[n], order.index(n)))
        plan[rank] = name
        load[name] += 1
    return dict(sorted(plan.items()))


def _class(holder: Holder, rank: int, node: str | None) -> int:
    """The module docstring's order, 0 best."""
    return 2 * _same_node(holder.node, node) + (holder.rank is not None)


def _same_node(a: str | None, b: str | None) -> bool:
    """An unknown node counts as the same: the copy must not be thought safe from a node loss when it might not be."""
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
