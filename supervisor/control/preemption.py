"""A node that will go costs nothing: on its drain notice (cluster/drains.py), its work moves off at the next step
boundary, before the deadline. Pure: what moves, and why what cannot move stays until the node goes (then its
loss is repaired as it is without a notice).

- Each rank there, of every trained group (the actor's, a PPO job's critic's), hands its place to the holder of its
  memory copy of the step just completed (the memory tier's adoption: its group's warm spare, or a free spare or
  new process elsewhere that loads the copy from the peer holding it): nothing is trained again, no group is torn
  down, no retry is spent.
- Each engine there is replaced by a spare engine, or a new one elsewhere (Ray starts nothing new on a draining
  node), and every engine is resynced as after an engine repair.
- The warm spares there are retired (with the copies they hold); the pool refills elsewhere after the next step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from supervisor.config import RoleName
from supervisor.control.recovery_source import Choice, Source

# The least time before the deadline to begin a handoff: a rank's adoption and the resync take 1-2 s at the
# default size on CPU and under 1 s more at ~100M (docs/benchmarks.md); a handoff cut by the node's end is a node
# loss anyway, after the work of a handoff.
HANDOFF_SECS = 5.0


@dataclass(frozen=True)
class Handoff:
    node: str
    deadline: float | None              # seconds since the epoch; None: the notice has none
    ranks: dict[RoleName, tuple[int, ...]] = field(default_factory=dict)  # role -> its ranks that move
    engines: tuple[str, ...] = ()       # the engines replaced
    spares: tuple[str, ...] = ()        # the warm spares retired
    fallback: str | None = None         # why ranks (or everything) stay until the node goes

    @property
    def moves(self) -> bool:
        return bool(self.ranks or self.engines or self.spares)


def plan_handoff(*, node: str, deadline: float | None, now: float, rank_nodes: dict[RoleName, list[str | None]],
                 engine_nodes: dict[str, str | None], spare_nodes: dict[str, str | None], global_step: int,
                 memory: dict[RoleName, Choice], draining: set[str] = frozenset()) -> Handoff | None:
    """What moves off `node`, None when the job has nothing there. `rank_nodes`: role -> each of its ranks' node;
    `engine_nodes` and `spare_nodes` (every group's pool): name -> node; `global_step`: the step just completed;
    `memory`: role -> where a repair of its ranks there would load from (recovery_source, asked as if they were
    lost), for the roles with ranks there; `draining`: every node that drains now (a rank is not handed to a spare
    that goes too). The ranks of every group move together or stay together: they roll back as one step."""
    ranks = {role: tuple(r for r, n in enumerate(nodes) if n == node) for role, nodes in rank_nodes.items()}
    ranks = {role: rs for role, rs in ranks.items() if rs}
    engines = tuple(name for name, n in engine_nodes.items() if n == node)
    spares = tuple(name for name, n in spare_nodes.items() if n == node)
    if not (ranks or engines or spares):
        return None
    left = None if deadline is None else deadline - now
    if left is not None and left < HANDOFF_SECS:
        return Handoff(node, deadline, fallback=f"the deadline is {max(left, 0):.1f}s away, less than the "
                                                f"{HANDOFF_SECS:g}s a handoff needs: the node's work is repaired "
                                                f"when it goes")
    for role, moving in ranks.items():
        why, choice = None, memory.get(role)
        group = "" if RoleName(role) is RoleName.ACTOR else f"the {RoleName(role).value}'s "
        if choice is None or choice.source is not Source.MEMORY:
            why = choice.reason if choice is not None else "the memory tier does not serve this job"
        elif choice.step != global_step:
            why = f"the memory tier holds step {choice.step}, not step {global_step} just completed"
        elif any(spare_nodes.get(spare) in draining for spare in choice.adopters.values()):
            why = "a buddy holding their state is on a node that drains too"
        if why is not None:
            return Handoff(node, deadline, {}, engines, spares, fallback=f"{group}ranks {list(moving)} stay until "
                                                                         f"the node goes ({why}), then recover as "
                                                                         f"from its loss")
    return Handoff(node, deadline, ranks, engines, spares)
