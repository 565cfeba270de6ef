"""The memory tier on the Supervisor's side: which holder (a warm spare, else a peer rank) keeps which rank's
copies (buddies.py), the copy begun on every rank after each optimizer step, and what each holder says it holds.

A rank stages its state into one of its two slots (workers/memory_tier.py) and streams it to its buddy in the
background, over a gloo link of their own, during the next step's rollout; the next update waits until it has
landed. A repair asks the buddies what they hold, and recovery_source.py takes the newest step every lost rank's
buddy holds whole (all ranks or none). A spare holds copies from its start, while it still warms (its holder's
methods run on a thread of their own), so a rank is linked as soon as a spare away from it has started: at the job's
start the pool starts with the TrainGroup, and the first step's copy is held. Links are kept while the spare stays
in the pool; one that takes a dead rank's place before it finished warming finishes first, then loads the copy.
A job without spares (recover.spare_workers: 0, or a GPU job's auto) has its ranks hold each other's copies: a
peer's holder methods run beside its steps the same way, and a dead rank's new process loads the copy from it.

Linking never falls on a step: after a repair, or when the pool refilled, a holder allocates its slots for a rank
(seconds at ~100M) and starts a side link's store on the Supervisor's linker thread while the job trains on, and
the rank's own part (mapping those slots, or joining the side link: one short call) runs just before its next
copy, which already goes to the holder. The steps between are covered by what the ranks hold themselves and,
after a repair from memory, by what the holders still hold of the step it restored (`unlinked`): a second fault
there can roll back to that step again.
"""
from __future__ import annotations

import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Callable

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from supervisor.cluster.buddies import Holder, buddy_plan, link_steps
from supervisor.cluster.blame import Outcome, outcome_of
from supervisor.cluster.errors import GroupError, first_line
from supervisor.cluster.groups import TrainGroup, drain, wait_for_write
from supervisor.cluster.spares import SparePool
from workers.memory_tier import NoRoom, peer_name

LINK_SECS = 30.0     # a link's set-up: a gloo pair and its store
HOLDERS_SECS = 60.0  # at the job's start, how long the first link waits for the pool's spares to start
HOLDING_SECS = 2.0   # a buddy that does not say what it holds within this long counts as lost
LANDED_POLL_SECS = 0.05  # how often the ranks are asked whether their copy landed, while the next update waits


class HolderFailed(Exception):
    """A holder died or did not answer while a rank was being linked to it; `unanswered`: its call, collected
    later so that Ray stays quiet about it."""

    def __init__(self, cause: BaseException, unanswered: ray.ObjectRef | None = None):
        super().__init__(str(cause))
        self.cause, self.unanswered = cause, unanswered


def ask_holder(ref: ray.ObjectRef):
    """A holder's answer, on the linker's thread; HolderFailed when it died or stalled (none within LINK_SECS)."""
    try:
        return ray.get(ref, timeout=LINK_SECS)
    except GetTimeoutError as e:  # frozen, or its node unreachable
        raise HolderFailed(e, ref) from e
    except RayActorError as e:  # dead
        raise HolderFailed(e) from e


def node_ip(node_id: str | None) -> str | None:
    return next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id), None)


@dataclass
class Candidate:
    """A process that can hold ranks' copies: a started spare, or a rank of the group (a peer)."""

    handle: ray.actor.ActorHandle
    holder: Holder


@dataclass
class Prepared:
    """A holder ready for a rank: its slots for the rank allocated (`held`, `hold`'s answer) and, for a rank on
    another host, its side link's store listening at `ip`:`port` under `key`. What is left is the rank's own
    call, which the next copy of the rank's state follows: `memory_attach` (its host), else `memory_link`."""

    holder: str
    held: dict
    ip: str | None = None
    port: int | None = None
    key: str | None = None

    def rank_call(self, member: ray.actor.ActorHandle) -> ray.ObjectRef:
        if self.port is None:
            return member.memory_attach.remote(self.held)
        return member.memory_link.remote(self.ip, self.port, self.key)


class MemoryCopies:
    def __init__(self, spares: SparePool | None, warn: Callable[[str], None], linked: Callable[[dict[int, str]], None]):
        self.spares, self.warn, self.linked = spares, warn, linked  # the job's events: a warning, the new links
        self.buddies: dict[int, str] = {}  # rank -> the holder of its copies (linked): a spare's or peer's name
        # rank -> the holder that still holds its copies from before the last repair from memory, until the rank
        # is linked again: a second fault in between recovers from them, not from disk
        self.unlinked: dict[int, str] = {}
        self.staged: list[int] = []        # the steps every rank holds in its own two slots
        self.own: dict[int, list[int]] = {}  # rank -> the steps its own two slots hold (a survivor rolls back to one)
        self.restored: int | None = None   # the step the last repair from memory rolled back to (`unlinked` hold it)
        self.slots: dict[int, dict] = {}   # rank -> what one of its slots holds, once it has its two
        self.off: str | None = None        # why the tier was turned off for the run (a node without room)
        self.orphans: list[ray.ObjectRef] = []
        # the links in the making, each prepared on the holder beside the steps (its slots allocated there, a
        # side link's store started) on a thread of its own, so that no allocation falls on a step
        self.linker = ThreadPoolExecutor(max_workers=4, thread_name_prefix="memory-linker")
        self.preparing: dict[int, tuple[str, Future]] = {}  # rank -> (its holder, the preparation: a Prepared)
        self.allocating: dict[int, ray.ObjectRef] = {}  # rank -> its memory_slots call, begun after a copy
        self.abandoned: list[Future] = []  # preparations of a group or a tier that is gone, collected when done
        self.resting: dict[int, float] = {}  # rank -> when its holder may be prepared again, after an error
        # rank -> the holder whose slots were last allocated for it: given back (`unhold`) once it is held
        # elsewhere, so a holder keeps no copy that nobody plans (kept across repairs: a survivor's holding)
        self.held_by: dict[int, str] = {}

    def begin(self, trainers: TrainGroup, global_step: int) -> None:
        """After `global_step`'s optimizer step on every rank: every rank stages its state (its slot of two steps
        back is overwritten) and sends it to its buddy if linked. The ranks whose holder got ready since the last
        step are linked first (one short call each), so this copy already goes to it; whatever a link still
        needs (a holder's slots, a rank's own) is begun after the copy, beside the next step."""
        linking = self._link(trainers)
        if self.off is not None:
            return
        self.staged = [s for s in self.staged if s == global_step - 1]
        # the slot of two steps back is overwritten now
        self.own = {rank: [s for s in steps if s == global_step - 1] for rank, steps in self.own.items()}
        try:
            staged = trainers.call_all("begin_memory_copy", global_step)
        except GroupError:
            self.orphans += [ref for _, ref in linking.values()]  # collected later, so Ray stays quiet
            raise
        self._linked_now(trainers, linking)
        if all(staged):
            self.staged.append(global_step)
        for rank, ok in enumerate(staged):
            # a rank without slots yet (started cold, or an adopter whose held slots were still written) still
            # holds what it held: a new process that took a dead rank's place, the peer's copy it loaded
            self.own[rank] = self.own.get(rank, []) + ([global_step] if ok else [])
            if not ok:
                self.slots.pop(rank, None)
        self._allocate(trainers)

    def link_first(self, trainers: TrainGroup) -> None:
        """At the job's start, before its first step: wait (at most HOLDERS_SECS) until the pool's spares, started
        beside the TrainGroup, have started (not warmed), so that the plan can prefer them to peers, then give
        every rank its slots and link it, waiting for each link, so that the first step's copy is held and
        nothing of this falls on a step."""
        awaited = self.spares.spares if self.spares is not None else []
        deadline = time.monotonic() + HOLDERS_SECS
        while awaited and time.monotonic() < deadline:
            self.spares.holders()  # notes where each spare that answered runs ("" where it died)
            if all(s.node is not None for s in awaited):
                break
            time.sleep(LANDED_POLL_SECS)
        self._allocate(trainers)
        deadline = time.monotonic() + 2 * LINK_SECS  # a holder that fails costs one LINK_SECS, its rank another
        while self.off is None:
            if self.allocating:
                ray.wait(list(self.allocating.values()), num_returns=len(self.allocating), timeout=LINK_SECS)
            wait_futures([f for _, f in self.preparing.values()], timeout=LINK_SECS)
            linking = self._link(trainers)
            self._linked_now(trainers, linking)
            if not (linking or self.preparing or self.allocating) or time.monotonic() > deadline:
                return

    def _allocate(self, trainers: TrainGroup) -> None:
        """Ask the ranks without known slots for them (`memory_slots`: allocated and touched there, on the
        rank's thread, after its copy and before the step's weight push), unless asked already. Only a rank
        started cold lacks them: at the job's start (before its first step) and after a restart from disk."""
        for rank, m in enumerate(trainers.members):
            if rank not in self.slots and rank not in self.allocating:
                self.allocating[rank] = m.handle.memory_slots.remote()

    def _link(self, trainers: TrainGroup) -> dict[int, tuple[Prepared, ray.ObjectRef]]:
        """Without waiting: note the ranks' slots and the holders that got ready, drop the holders that failed,
        plan each rank's buddy (buddies.py), begin the preparation of the planned holders not yet ready, and
        send the rank's own call to every rank whose holder is ready. Returns those calls, rank -> (what was
        prepared, the call): they run before the rank's next copy (an actor's calls keep their order)."""
        if self.off is not None:
            return {}
        before = self.buddies
        holders = self.candidates(trainers)
        try:
            self._note_slots()
            ready, failed = self._note_prepared(trainers.world_size, holders)
        except NoRoom as e:
            self.turn_off(trainers, f"a node has no room for the memory tier's copies: {getattr(e, 'cause', e)}",
                          holders)
            return {}
        if failed:
            self._drop_holders(failed)
            holders = self.candidates(trainers)
        preparing = {rank: name for rank, (name, _) in self.preparing.items()}
        plan = buddy_plan(trainers.nodes, {name: c.holder for name, c in holders.items()},
                          {**self.buddies, **preparing, **{rank: p.holder for rank, p in ready.items()}})
        # a rank keeps its buddy until it is linked to the one the plan moved it to: its copies still go there
        self.buddies = {rank: name for rank, name in self.buddies.items()
                        if name in holders and rank < trainers.world_size}
        if self.buddies != before:
            self._announce(holders)
        resting = {rank for rank, until in self.resting.items() if time.monotonic() < until}
        now, prepare = link_steps(plan, self.buddies, preparing, {rank: p.holder for rank, p in ready.items()},
                                  set(self.slots) - resting)
        for rank in set(ready) - set(now):  # prepared for a holder the plan moved it from: its slots go back
            self._unhold(rank, ready[rank].holder, holders)
        for rank in prepare:
            name = plan[rank]
            keep = self.restored if self.unlinked.get(rank) == name else None  # it holds that step: kept
            self.preparing[rank] = (name, self.linker.submit(self._prepare, rank, self.slots[rank], name,
                                                             holders[name].handle, trainers.nodes[rank], keep))
        return {rank: (ready[rank], ready[rank].rank_call(trainers.members[rank].handle)) for rank in now}

    def _note_slots(self) -> None:
        """The ranks' slots asked for that have answered (NoRoom: the node has no room for them)."""
        done = set(ray.wait(list(self.allocating.values()), num_returns=len(self.allocating), timeout=0)[0]) \
            if self.allocating else set()
        for rank, ref in list(self.allocating.items()):
            if ref in done:
                del self.allocating[rank]
                try:
                    self.slots[rank] = ray.get(ref)
                except NoRoom:  # Ray's error is an instance of the worker's error class too
                    raise
                except Exception:  # noqa: BLE001 - a dead rank is the next group call's fault; asked again
                    pass

    def _note_prepared(self, world_size: int, holders: dict[str, "Candidate"]) -> \
            tuple[dict[int, Prepared], dict[str, BaseException]]:
        """The preparations that finished: the ready holders (rank -> Prepared) and the failed spares still in the
        pool (name -> cause); NoRoom raised (the holder's node has no room); any other error, or a peer that
        failed (a dead rank is the next group call's fault), is warned, and its rank's holder prepared again
        after LINK_SECS. One whose holder left meanwhile (a spare that took a dead rank's place, or was dropped;
        a rank replaced) is forgotten."""
        self._collect_abandoned()
        pool = set(holders)
        ready, failed = {}, {}
        for rank, (name, future) in list(self.preparing.items()):
            if not future.done():
                continue
            del self.preparing[rank]
            try:
                prepared = future.result()
            except HolderFailed as e:
                self.orphans += [e.unanswered] if e.unanswered is not None else []
                if name in pool and holders[name].holder.rank is None:
                    failed[name] = e.cause
                elif name in pool:
                    self.resting[rank] = time.monotonic() + LINK_SECS
                continue
            except NoRoom:
                raise
            except Exception as e:  # noqa: BLE001 - raised in the holder's code: it stays in the pool
                if name in pool:
                    self.resting[rank] = time.monotonic() + LINK_SECS
                    self.warn(f"preparing rank {rank}'s memory-tier buddy failed: {type(e).__name__}: "
                              f"{first_line(e)}; tried again in {LINK_SECS:.0f}s")
                continue
            if rank < world_size and name in pool:
                ready[rank] = prepared
        return ready, failed

    def _collect_abandoned(self) -> None:
        """Abandoned preparations that ended: a holder's call left unanswered is collected later, so that Ray
        stays quiet about it."""
        for future in [f for f in self.abandoned if f.done()]:
            self.abandoned.remove(future)
            error = future.exception()
            if isinstance(error, HolderFailed) and error.unanswered is not None:
                self.orphans.append(error.unanswered)

    def _abandon(self) -> None:
        self.abandoned += [future for _, future in self.preparing.values()]
        self.preparing = {}

    def _prepare(self, rank: int, slots: dict, name: str, holder: ray.actor.ActorHandle,
                 node: str | None, keep: int | None) -> Prepared:
        """On the linker's thread: the holder allocates `rank`'s two slots (`hold`: seconds at ~100M, beside the
        steps; or keeps those holding step `keep`) and, where the rank runs on another host, starts its side
        link's store. HolderFailed when the holder died or stalled (no answer within LINK_SECS)."""
        held = ask_holder(holder.hold.remote(rank, slots, name, keep))
        where = ask_holder(holder.located.remote())
        if where["ip"] == node_ip(node):  # its host: the rank maps the holder's slots (memory_attach)
            return Prepared(name, held)
        return self._listen(rank, Prepared(name, held), holder, where)

    def _linked_now(self, trainers: TrainGroup, linking: dict[int, tuple[Prepared, ray.ObjectRef]]) -> None:
        """The ranks' own calls of `_link` answered (they ran before the copy just begun): each rank that
        linked has its buddy; one that could not map a holder on its host is linked over a side link next."""
        if not linking:
            return
        before = dict(self.buddies)
        for rank, (prepared, ref) in linking.items():
            try:
                attached = ray.get(ref, timeout=LINK_SECS)
            except Exception as e:  # noqa: BLE001 - a dead rank is the group call's fault; a stuck link is left
                self.orphans.append(ref)
                self.warn(f"linking rank {rank} to its memory-tier buddy failed: {type(e).__name__}: "
                          f"{first_line(e)}; tried again at the next step")
                continue
            holders = self.candidates(trainers)
            if attached is False:  # memory_attach: the holder's slots cannot be mapped here (another host)
                holder = holders.get(prepared.holder)
                if holder is not None:
                    self.preparing[rank] = (prepared.holder,
                                            self.linker.submit(self._listen, rank, prepared, holder.handle))
                continue
            self.buddies[rank] = prepared.holder
            self.unlinked.pop(rank, None)
            old, self.held_by[rank] = self.held_by.get(rank), prepared.holder
            if old not in (None, prepared.holder):
                self._unhold(rank, old, holders)
        if self.buddies != before:
            self._announce(self.candidates(trainers))

    def _unhold(self, rank: int, name: str, holders: dict[str, Candidate]) -> None:
        """`name` gives back the slots it holds for `rank`, if it is still there (not waited for)."""
        if name in holders and self.held_by.get(rank) != name:
            self.orphans.append(holders[name].handle.unhold.remote(rank, name))

    def _listen(self, rank: int, prepared: Prepared, holder: ray.actor.ActorHandle,
                where: dict | None = None) -> Prepared:
        """On the linker's thread: a side link's store started on the holder (`where` it runs, when known), for a
        rank on another host or one that could not map the holder's slots."""
        where = where or ask_holder(holder.located.remote())
        key = uuid.uuid4().hex[:8]
        ask_holder(holder.listen.remote(rank, where["port"], key))
        return Prepared(prepared.holder, prepared.held, where["ip"], where["port"], key)

    def _drop_holders(self, failed: dict[str, BaseException]) -> None:
        """Holders that died or stalled while being prepared: dropped from the pool (it refills them after the
        next step), their ranks planned onto another; one LINK_SECS each on the linker's thread, and their kill
        (a bounded wait) at the next step."""
        self.spares.drop(list(failed))
        self.buddies = {rank: name for rank, name in self.buddies.items() if name not in failed}
        self.unlinked = {rank: name for rank, name in self.unlinked.items() if name not in failed}
        for name, cause in failed.items():
            self.warn(f"the memory-tier buddy {name.rsplit('/', 1)[-1]} failed while linking "
                      f"({type(cause).__name__}: {first_line(cause)}); dropped from the spare pool, its ranks "
                      f"linked to another at the next step")

    def retired(self, trainers: TrainGroup, names: tuple[str, ...]) -> None:
        """Holders taken out of the pool while alive (their node drains): their ranks are uncovered until they are
        linked to another holder, from the next step on."""
        self.unlinked = {rank: name for rank, name in self.unlinked.items() if name not in names}
        kept = {rank: name for rank, name in self.buddies.items() if name not in names}
        if kept != self.buddies:
            self.buddies = kept
            self._announce(self.candidates(trainers))

    def candidates(self, trainers: TrainGroup) -> dict[str, Candidate]:
        """Who can hold ranks' copies now, without waiting: the spares that have started, then the ranks."""
        spares = {name: Candidate(s.handle, Holder(s.node)) for name, s in self.spares.holders().items()} \
            if self.spares is not None else {}
        return spares | {peer_name(r, m.pid): Candidate(m.handle, Holder(m.node_id, r))
                         for r, m in enumerate(trainers.members) if m.pid is not None}

    def _announce(self, holders: dict[str, Candidate]) -> None:
        nodes = {name: c.holder.node for name, c in holders.items()}
        self.linked({rank: nodes.get(name) for rank, name in self.buddies.items()})

    def turn_off(self, trainers: TrainGroup, off: str, holders: dict[str, Candidate] | None = None) -> None:
        """The tier is off for the run (`off`: why; no room for the copies, or another group's tier is off): every
        rank and holder gives its slots back, recovery from disk from now on."""
        holders = self.candidates(trainers) if holders is None else holders
        self.off = off
        self.warn(f"{self.off}; recovery from disk for the rest of the run")
        refs = [m.handle.drop_memory.remote() for m in trainers.members] + \
               [s.handle.release.remote() for s in holders.values()]
        ray.wait(refs, num_returns=len(refs), timeout=LINK_SECS)
        self.buddies, self.staged, self.slots, self.own, self.unlinked, self.restored = {}, [], {}, {}, {}, None
        self._abandon()
        self._forget_allocating()
        self.linked({})

    def wait_landed(self, trainers: TrainGroup, global_step: int) -> None:
        """Before the next step trains: wait until every linked rank's copy of `global_step` has landed at its
        buddy (a send takes a fraction of the rollout that precedes this), so that a rank lost during training
        never costs a step trained again. A send that failed or is still running after LINK_SECS (a buddy
        died or stalled) unlinks every rank: recovery from disk until they are linked again at the next step."""
        ranks = sorted(self.buddies) if global_step in self.staged else []
        if not ranks:
            return
        members = [trainers.members[r] for r in ranks]
        poll = lambda: trainers.gather([m.handle.memory_result.remote(global_step) for m in members],  # noqa: E731
                                       members=members)
        try:
            wait_for_write(poll, LINK_SECS, sleep=lambda _: time.sleep(LANDED_POLL_SECS))
        except GroupError as e:
            if outcome_of(e.error) is Outcome.DIED:
                raise  # a rank died: the fault it is
            self.warn(f"the memory copy of step {global_step} did not land ({first_line(e.error)}); its ranks "
                      f"are linked again at the next step")
            self._unlink()
        except TimeoutError:
            self.warn(f"the memory copy of step {global_step} was still being sent after {LINK_SECS:.0f}s; its "
                      f"ranks are linked again at the next step")
            self._unlink()

    def covering(self) -> dict[int, str]:
        """rank -> the holder a repair asks for its copies: its buddy, or while it is not linked again after a
        repair from memory, the holder that still holds its copies from before (what each holds, `holding` says)."""
        return {**self.unlinked, **self.buddies}

    def staged_by(self, ranks: set[int]) -> list[int]:
        """The steps every one of `ranks` holds in its own slots (the survivors of a fault roll back to one)."""
        steps = [set(self.own.get(rank, [])) for rank in ranks]
        return sorted(set.intersection(*steps)) if steps else []

    def holding(self, trainers: TrainGroup) -> dict[str, dict[int, list[int]]]:
        """What each holder a repair would ask (`covering`) holds whole, rank -> steps; one that is dead or silent
        is absent."""
        names = set(self.covering().values())
        refs = {name: c.handle.holding.remote() for name, c in self.candidates(trainers).items() if name in names}
        ready, pending = ray.wait(list(refs.values()), num_returns=len(refs), timeout=HOLDING_SECS) if refs else ([], [])
        self.orphans = drain(self.orphans, 0)[0] + pending
        held = {}
        for name, ref in refs.items():
            if ref in ready:
                try:
                    held[name] = {int(rank): steps for rank, steps in ray.get(ref).items()}
                except Exception:  # noqa: BLE001 - a dead buddy holds nothing
                    pass
        for rank, name in self.unlinked.items():  # a step past the one restored is of a timeline rolled back
            if rank in held.get(name, {}):
                held[name][rank] = [s for s in held[name][rank] if s == self.restored]
        return held

    def adopted(self, global_step: int, lost: list[int], adopters: dict[int, str], givers: dict[int, str],
                own: set[int], gone: set[str]) -> None:
        """After a repair from memory to `global_step`: the buddies that took dead ranks' places (`adopters`) are
        ranks now, and the survivors left their links; every rank is linked again, its holder prepared beside the
        next steps. Every rank keeps its slots (an adopter's are those it held for its rank). Until its copy, no
        step is held by every rank's own slots; `own`'s ranks hold `global_step` as their own (the survivors in
        their slots, rolled back from them, the adopters that kept theirs, and a new process the peer's copy it
        loaded). Until then the holders that are still holders keep what they held of `global_step`: the
        survivors' holders, and the peers that gave the dead ranks their copies (`givers`), so that a second fault
        before the ranks are linked again can roll back to `global_step` from memory too, where what it needs is
        still held (a lost rank's copy by its holder, the step by the others' own). `gone`: the holders that are
        no more (the lost ranks' processes, the spares taken)."""
        ended = set(adopters.values()) | gone
        self.unlinked = {**{rank: name for rank, name in self.covering().items()
                            if rank not in lost and name not in ended}, **givers}
        self.restored = global_step
        self.own = {rank: [global_step] if rank in own else [] for rank in self.own.keys() | own}
        self._unlink()
        self.staged = []

    def reset(self) -> None:
        """A new TrainGroup: no link, no staged step and no slots survive it; its ranks get their slots again."""
        self._unlink()
        self.staged, self.slots, self.resting, self.own, self.unlinked, self.restored = [], {}, {}, {}, {}, None
        self._abandon()
        self._forget_allocating()

    def _forget_allocating(self) -> None:
        self.orphans += list(self.allocating.values())  # collected later, so Ray stays quiet
        self.allocating = {}

    def _unlink(self) -> None:
        """No rank is covered until the next link (the `buddies` event says so: status shows who holds what)."""
        if self.buddies:
            self.buddies = {}
            self.linked({})
