"""The two worker groups the Supervisor drives: their Ray placement, their calls, and their clean removal.

Every call waits on all the actors' results at once and fails fast: the first failed call raises
`GroupError` naming the actor and its node; results still missing after the timeout raise one naming the
actors that hung. The calls left behind are kept and drained when their actors are removed, so Ray prints
no "unhandled error" for them. A group that fails to start removes what it started (actors, placement
group). Nothing here decides what to do about a fault (classify.py and policy.py do).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from supervisor.cluster.blame import Call, Outcome, blame, dead_nodes, group_error, outcome_of
from supervisor.cluster.drains import draining_nodes, room_per_node
from supervisor.cluster.errors import CapacityError, Group, GroupError
from supervisor.cluster.spare_placement import choose_nodes, engine_resources, take_spares
from supervisor.cluster.weights import WeightStream
from supervisor.config import Config, RoleName
from workers.rollout_worker import RolloutWorker, merge_rollouts
from workers.train_worker import TrainWorker

SETTLE_SECS = 10.0  # how long the peers of an actor that raised may take to finish the same call
PROBE_TIMEOUT_SECS = 15.0  # how long a surviving engine may take to finish a call left behind by a fault
KILL_WAIT_SECS = 10.0  # how long killed actors may take to be gone (a SIGSTOPped one takes about 5 s)
WRITE_POLL_SECS = 1.0  # how often the ranks are asked whether a background write is done, while waiting for it


@dataclass
class Member:
    handle: ray.actor.ActorHandle
    name: str
    node_id: str | None = None
    pid: int | None = None


def drain(refs: list[ray.ObjectRef], timeout: float) -> tuple[list[ray.ObjectRef], dict]:
    """Retrieve the results of calls nobody waits for any more, so Ray reports no unhandled error for them.
    Returns the calls still running, and the errors of those that failed (by ref)."""
    if not refs:
        return [], {}
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout, fetch_local=False)
    errors = {}
    for ref in ready:
        try:
            ray.get(ref)
        except Exception as e:  # noqa: BLE001 - a failed call of a removed actor: retrieved so Ray stays quiet
            errors[ref] = e
    return pending, errors


def kill(handles: list[ray.actor.ActorHandle], waited: list[ray.ObjectRef]) -> list[ray.ObjectRef]:
    """Kill the actors and wait (a bounded while) until they are gone (a fresh call on each fails), and for
    the calls in `waited`; returns those still running. Nothing a killed actor did outlives it, and its
    resources are free for what replaces it."""
    for h in handles:
        try:
            ray.kill(h, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
    return drain(waited + [h.where.remote() for h in handles], KILL_WAIT_SECS)[0]


def wait_for_write(poll: Callable[[], list], bound: float, sleep: Callable[[float], None] = time.sleep,
                   clock: Callable[[], float] = time.monotonic) -> list:
    """Poll a background write until every rank's answer is not None (each poll is a call with the step's
    bound, so a dead or frozen rank is seen as usual), for at most `bound` seconds: a slow, healthy write on
    shared storage is no hang. Returns the answers; TimeoutError with the indices of the ranks still writing."""
    start = clock()
    while True:
        answers = poll()
        if all(a is not None for a in answers):
            return answers
        if clock() - start >= bound:
            raise TimeoutError([i for i, a in enumerate(answers) if a is None])
        sleep(WRITE_POLL_SECS)


class _Members:
    """Calls on a list of actors, gathered together."""

    group: Group

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.members: list[Member] = []
        self.orphans: list[ray.ObjectRef] = []  # calls left behind by a fault

    def gather(self, refs: list[ray.ObjectRef], timeout: float | None = None,
               members: list[Member] | None = None) -> list:
        """Every call's result, or GroupError naming who is to blame (cluster/blame.py). A death ends the wait;
        after a call raised, its peers get SETTLE_SECS to finish too (or to show a death: a survivor's
        collective error often arrives before Ray's death notice); otherwise the wait lasts `timeout`."""
        members = self.members if members is None else members
        timeout = self.timeout if timeout is None else timeout
        start = time.monotonic()
        deadline, pending, errors = start + timeout, list(refs), {}
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                break
            try:
                ray.get(ready[0])
            except Exception as e:  # noqa: BLE001 - every failure is classified by the controller
                errors[ready[0]] = e
                if outcome_of(e) is Outcome.DIED:
                    break
                deadline = min(deadline, time.monotonic() + SETTLE_SECS)
        calls = [Call(outcome_of(errors[r]) if r in errors else Outcome.PENDING if r in pending else Outcome.OK,
                      order=list(errors).index(r) if r in errors else 0) for r in refs]
        verdict = blame(calls)
        if verdict is None:
            return ray.get(list(refs))
        self.orphans += [r for r in refs if r not in errors]
        error = group_error(verdict, self.group, {i: errors[r] for i, r in enumerate(refs) if r in errors}, members,
                            round(time.monotonic() - start, 3))
        raise error from error.error

    def call_all(self, method: str, *args, timeout: float | None = None) -> list:
        return self.gather([getattr(m.handle, method).remote(*args) for m in self.members], timeout)

    @property
    def nodes(self) -> list[str | None]:
        return [m.node_id for m in self.members]

    def describe(self) -> list[dict]:
        return [{"name": m.name, "node": m.node_id, "pid": m.pid} for m in self.members]

    def _kill(self, members: list[Member]) -> None:
        self.orphans = kill([m.handle for m in members], self.orphans)


def rank_name(role: RoleName, rank: int) -> str:
    """A rank's name in events, logs and `ray list actors`: `TrainWorker[rank r]`, a critic's
    `TrainWorker[critic rank r]`."""
    return f"TrainWorker[rank {rank}]" if role is RoleName.ACTOR else f"TrainWorker[{role} rank {rank}]"


def placement_group_name(config: Config, role: RoleName = RoleName.ACTOR) -> str:
    """The actor's group's placement group ends in /train (as it always has), another role's in its name."""
    return f"relaunch/{config.experiment_name}/{config.trial_name}/{'train' if role is RoleName.ACTOR else role}"


def remove_leftover_placement_groups(config: Config) -> int:
    """Remove this trial's TrainGroup placement groups (of every role) left by a Supervisor that died: Ray keeps
    them while it restarts the actor that made them."""
    names, removed = {placement_group_name(config, role) for role in config.trained}, 0
    for pg_id, info in placement_group_table().items():
        if info.get("name") in names and info.get("state") != "REMOVED":
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
            removed += 1
    return removed


class TrainGroup(_Members):
    """A placement group plus N TrainWorker ranks sharing one torch.distributed process group.

    Ranks come first from `spares` (a SparePool: warm processes, already placed, so they need no bundle),
    the rest start cold in a placement group of one bundle each. A group started this way is all new; after a
    rank's death, `rejoin` keeps the survivors' actors and puts the dead ranks' buddies in their places (the
    memory tier: supervisor/cluster/memory_copies.py), and `regroup` keeps them for a repair from disk."""

    def __init__(self, config: Config, world_size: int, timeout: float, spares=None,
                 role: RoleName = RoleName.ACTOR):
        """`role`: the trained group it is (Config.trained): the actor's ranks are `TrainWorker[rank r]`, a
        critic's `TrainWorker[critic rank r]`, each group in a placement group of its own."""
        super().__init__(timeout)
        self.config, self.world_size, self.role = config, world_size, RoleName(role)
        self.group = Group.TRAIN if self.role is RoleName.ACTOR else Group.CRITIC
        cluster = config.cluster
        bundle = {"CPU": cluster.cpus_per_worker}
        if cluster.gpus_per_worker:
            bundle["GPU"] = cluster.gpus_per_worker
        self.timings: dict[str, float] = {}  # seconds spent in each part of the start, for the recovery breakdown
        self.steps = 0  # optimizer steps this group took (the weight stream checks its writes whole after the first)
        started = time.monotonic()
        taken = spares.take(world_size) if spares is not None else []
        self.from_spares, cold = len(taken), world_size - len(taken)
        self.bundles = {r: r - len(taken) for r in range(len(taken), world_size)}  # rank -> its bundle of self.pg
        self.free: list[int] = []  # bundles of self.pg whose rank a spare took over: a later lost rank starts there
        self.members = [Member(handle, "") for handle, _ in taken]
        self.pg = None
        try:
            if cold:
                self.pg = placement_group([dict(bundle) for _ in range(cold)], strategy="PACK",
                                          name=placement_group_name(config, self.role))
            if self.pg is not None and not self.pg.wait(config.recover.capacity_timeout_secs):
                raise CapacityError(
                    f"the cluster did not offer {cold} x {bundle} for the TrainGroup within "
                    f"recover.capacity_timeout_secs={config.recover.capacity_timeout_secs:g}s "
                    f"(available now: {ray.available_resources()})")
            self.members += [Member(self._cold(b), "") for b in range(cold)]
            for r, m in enumerate(self.members):
                m.name = rank_name(self.role, r)
            # Start-up (imports, model build, rendezvous) is not a step: it gets a bound of its own.
            setup_timeout = config.recover.start_timeout_secs
            self.timings["scheduling"] = time.monotonic() - started
            where = self.gather([m.handle.where.remote(r) for r, m in enumerate(self.members)], setup_timeout)
            for m, w in zip(self.members, where):
                m.node_id, m.pid = w["node_id"], w["pid"]
            self.timings["process_start"] = time.monotonic() - started - self.timings["scheduling"]
            self.gather([m.handle.setup.remote(where[0]["ip"], where[0]["port"], r, world_size)
                         for r, m in enumerate(self.members)], setup_timeout)
            self.timings["rendezvous"] = time.monotonic() - started - sum(self.timings.values())
        except BaseException:
            self.shutdown()  # a failed start leaves no actor and no placement group behind
            raise

    def _cold(self, bundle: int) -> ray.actor.ActorHandle:
        """A new TrainWorker process in `bundle` of the group's placement group."""
        cluster = self.config.cluster
        return TrainWorker.options(
            num_cpus=cluster.cpus_per_worker, num_gpus=cluster.gpus_per_worker, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle),
        ).remote(self.config, self.role)

    def train(self, shards: list[dict], global_step: int) -> list[dict]:
        results = self.gather([m.handle.train.remote(s, global_step) for m, s in zip(self.members, shards)])
        self.steps += 1
        return results

    def values(self, shards: list[dict], global_step: int) -> list:
        """A critic's group: each rank's values of its shard's states, before the step's updates (for GAE)."""
        return self.gather([m.handle.values.remote(s, global_step) for m, s in zip(self.members, shards)])

    def logprobs(self, shards: list[dict], global_step: int) -> list[dict]:
        """The actor's group: each rank's token log-probabilities of its shard and the reference's, before the
        step's updates (for the KL penalty in PPO's rewards, `critic.kl_in_reward`)."""
        return self.gather([m.handle.logprobs.remote(s, global_step) for m, s in zip(self.members, shards)])

    def save_recover(self, staging: str, global_step: int) -> dict:
        files = {}
        for part in self.call_all("save_recover", staging, global_step):
            files.update(part)
        return files

    def begin_save(self, staging: str, global_step: int) -> None:
        """The first half of a background save: each rank writes its part that needs no peer, alone (a storage
        error there fails the call with every peer settled, so the save is skipped on every rank)."""
        self.call_all("begin_save", staging, global_step)

    def start_upload(self, global_step: int) -> None:
        """The second half, once every rank's first half succeeded: all start the upload of their shards."""
        self.call_all("start_upload", global_step)

    def save_result(self, global_step: int, block: bool) -> dict | None:
        """Every rank's files of the background save once all are durable, else None (see TrainWorker); with
        `block`, waits for them up to recover.write_timeout_secs."""
        poll = lambda: self.call_all("save_result", global_step)  # noqa: E731
        parts = self._wait_for_write(poll, f"the recover save of step {global_step}") if block else poll()
        if any(p is None for p in parts):
            return None
        return {name: entry for part in parts for name, entry in part.items()}

    def _wait_for_write(self, poll: Callable[[], list], what: str) -> list:
        bound = self.config.recover.write_timeout_secs
        try:
            return wait_for_write(poll, bound)
        except TimeoutError as e:
            stuck = [self.members[i] for i in e.args[0]]
            raise GroupError(self.group, GetTimeoutError(f"{what} still not written after {bound:.0f}s "
                                                         f"(recover.write_timeout_secs)"),
                             tuple(m.name for m in stuck), stuck[0].node_id, bound) from None

    def answering(self, timeout: float) -> set[int]:
        """The ranks that answer a probe within `timeout`: alive, and back from the call a fault interrupted
        (a rank still stuck in a collective, or on a lost node, does not answer)."""
        probes = [m.handle.where.remote(r) for r, m in enumerate(self.members)]
        running, errors = drain(probes, timeout)
        self.orphans += running
        return {r for r, ref in enumerate(probes) if ref not in running and ref not in errors}

    def progress(self, timeout: float) -> dict[int, dict | None]:
        """Every rank's answer to `progress` (served beside the method it runs: its phase and collective sequence
        number), None for a rank that did not answer within `timeout` or is dead."""
        refs = [m.handle.progress.remote() for m in self.members]
        running, errors = drain(refs, timeout)
        self.orphans += running
        return {r: None if ref in running or ref in errors else ray.get(ref) for r, ref in enumerate(refs)}

    def kill_ranks(self, ranks: set[int]) -> None:
        """Kill these ranks' actors (the culprits of a hang): their peers' collectives then fail at once."""
        self._kill([self.members[r] for r in sorted(ranks)])

    def rejoin(self, adopters: dict[int, str], givers: dict[int, ray.actor.ActorHandle], global_step: int,
               spares=None, bundled: frozenset[int] = frozenset()) -> set[int]:
        """Restart only the dead: the ranks a warm spare held take that spare (`adopters`: rank -> its name in
        `spares`), the ranks a peer held (`givers`: rank -> that peer) a free spare from `spares`, a new process
        in their own bundle (`bundled`: their node is alive) or in a free one, which loads the peer's copy; every
        rank joins a new process group at a new rendezvous, the survivors rolling back in place to
        `global_step`, the others loading it. The actors of the survivors stay: no new placement group, no
        process but the lost ones' started, no model built again. RuntimeError before anything is killed or
        started (the spares given back to the pool) when a rank finds no place. Returns the ranks that hold a
        copy of `global_step` of their own now (TrainWorker.rejoin restores it after a second fault)."""
        started = time.monotonic()
        claimed = spares.claim(list(adopters.values())) if adopters else {}
        taken = [handle for handle, _ in spares.take(len(givers))] if spares is not None and givers else []
        warm = sorted(givers, key=lambda r: r in bundled)[:len(taken)]  # the ranks without a bundle first
        homes, free = {}, list(self.free)
        for r in (r for r in sorted(givers) if r not in warm):
            homes[r] = self.bundles[r] if r in bundled else free.pop(0) if free else None
        if None in homes.values():
            if spares is not None:
                spares.give_back([*claimed.values(), *taken])
            raise RuntimeError(f"rank {min(r for r, b in homes.items() if b is None)} has no bundle to start again "
                               f"in and no warm spare is free")
        lost = sorted(adopters | givers)
        # the peers' copies, asked for before any rank enters the rendezvous (asked for as the new rank joined, a
        # survivor hosting the rendezvous never gave its copy in a test: it waited there for the new rank, which
        # waited for the copy); they reach Ray's object store while the new processes start
        copies = {r: holder.held_copy.remote(r, global_step) for r, holder in givers.items()}  # (bytes, meta)
        self._kill([self.members[r] for r in lost])
        self._free_bundles([*adopters, *warm])
        for r, handle in [*((r, claimed[name]) for r, name in adopters.items()), *zip(warm, taken)]:
            self.members[r] = Member(handle, rank_name(self.role, r))
        for r, bundle in homes.items():
            if bundle != self.bundles.get(r):  # its own bundle was on a node that is gone: a free one instead
                self.bundles[r] = bundle
                self.free.remove(bundle)
            self.members[r] = Member(self._cold(bundle), rank_name(self.role, r))
        self._release_unused()
        self.timings = {"teardown": time.monotonic() - started}
        bound = self.config.recover.start_timeout_secs
        where = self.gather([m.handle.where.remote(r) for r, m in enumerate(self.members)], bound)
        for m, w in zip(self.members, where):
            m.node_id, m.pid = w["node_id"], w["pid"]
        ray.get([meta for _, meta in copies.values()], timeout=bound)  # raises where a peer died or lacks the copy
        self.timings["process_start"] = time.monotonic() - started - self.timings["teardown"]
        ip, port = where[0]["ip"], where[0]["port"]

        def join(r: int, m: Member) -> ray.ObjectRef:
            if r in adopters:
                return m.handle.adopt.remote(ip, port, r, self.world_size, global_step)
            if r in givers:  # the peer's copy, carried by Ray to the new process's node before its call runs
                return m.handle.adopt_copy.remote(ip, port, r, self.world_size, global_step, *copies[r])
            return m.handle.rejoin.remote(ip, port, r, self.world_size, global_step)

        kept = self.gather([join(r, m) for r, m in enumerate(self.members)], bound)  # adopt's and adopt_copy's answer
        self.timings["rendezvous"] = time.monotonic() - started - sum(self.timings.values())
        # as a new group's: its weight stream checks them whole
        self.from_spares, self.steps = len(adopters) + len(taken), 0
        return {r for r in range(self.world_size) if r not in lost or kept[r]}  # the survivors rolled back from theirs

    def shard_digests(self) -> list[str]:
        """Every rank's digest of its part of the weights (TrainWorker.shard_digest), in rank order."""
        return self.gather([m.handle.shard_digest.remote() for m in self.members])

    def _free_bundles(self, ranks: list[int]) -> None:
        """These ranks' places go to spares: their bundles are free for a later lost rank, but for those on a
        node Ray has dead (Ray places such a bundle again only when the cluster has room) or draining (it starts
        nothing new there). Before the members are replaced: a member's node is its bundle's."""
        dead = dead_nodes() | set(draining_nodes() or ()) if any(r in self.bundles for r in ranks) else set()
        for r in ranks:
            if r in self.bundles:
                bundle = self.bundles.pop(r)
                if self.members[r].node_id not in dead:
                    self.free.append(bundle)

    def _release_unused(self) -> None:
        """The placement group goes back to the cluster once no rank holds a bundle of it (Ray cannot give back
        one bundle)."""
        if self.pg is not None and not self.bundles:
            remove_placement_group(self.pg)
            self.pg, self.free = None, []

    def placeable(self, lost: set[int], spares: int) -> set[int]:
        """The lost ranks that a repair from disk can start again: those holding a bundle, and as many of the
        others as `spares` (the pool's size) and the free bundles can take."""
        unbundled = sorted(r for r in lost if r not in self.bundles)
        return (lost - set(unbundled)) | set(unbundled[:spares + len(self.free)])

    def regroup(self, lost: list[int], spares=None) -> None:
        """A repair from disk that keeps the processes of the ranks that still answer: the `lost` ranks' actors are
        killed and replaced, by warm spares where `spares` has them (first for the ranks without a bundle), else
        by new processes in their bundles or in free ones; every rank joins a new process group, the survivors
        with their built models (`TrainWorker.regroup`). Each rank's state is then the checkpoint's:
        `load_recover` follows, on every rank. RuntimeError, nothing started and the spares it took given back to
        the pool, when a lost rank finds no place."""
        started = time.monotonic()
        self._kill([self.members[r] for r in lost])
        self.timings = {"teardown": time.monotonic() - started}
        taken = [handle for handle, _ in spares.take(len(lost))] if spares is not None else []
        order = sorted(lost, key=lambda r: r in self.bundles)
        warm, cold = order[:len(taken)], order[len(taken):]
        homeless = [r for r in cold if r not in self.bundles]
        if len(homeless) > len(self.free) + len([r for r in warm if r in self.bundles]):
            if taken:
                spares.give_back(taken)
            raise RuntimeError(f"rank {homeless[0]} has no bundle to start again in and no warm spare is free")
        self._free_bundles(warm)
        for r, handle in zip(warm, taken):
            self.members[r] = Member(handle, rank_name(self.role, r))
        for r in cold:
            if r not in self.bundles:
                self.bundles[r] = self.free.pop(0)
            self.members[r] = Member(self._cold(self.bundles[r]), rank_name(self.role, r))
        self._release_unused()
        self.from_spares, self.steps = len(taken), 0  # a new group's first steps: its weight stream checks them whole
        self.timings["scheduling"] = time.monotonic() - started - self.timings["teardown"]
        bound = self.config.recover.start_timeout_secs
        where = self.gather([m.handle.where.remote(r) for r, m in enumerate(self.members)], bound)
        for m, w in zip(self.members, where):
            m.node_id, m.pid = w["node_id"], w["pid"]
        self.timings["process_start"] = time.monotonic() - started - sum(self.timings.values())
        ip, port = where[0]["ip"], where[0]["port"]
        self.gather([m.handle.setup.remote(ip, port, r, self.world_size) if r in lost else
                     m.handle.regroup.remote(ip, port, r, self.world_size)
                     for r, m in enumerate(self.members)], bound)
        self.timings["rendezvous"] = time.monotonic() - started - sum(self.timings.values())

    def load_recover(self, step_dir: str, saved_world_size: int) -> list[str]:
        return self.call_all("load_recover", step_dir, saved_world_size)[0]

    def export_hf(self, directory: str, global_step: int) -> None:
        self.call_all("export_hf", directory, global_step)

    def begin_export(self, directory: str, global_step: int) -> None:
        self.call_all("begin_export", directory, global_step)

    def export_result(self, global_step: int, block: bool) -> bool:
        """Whether the background export is written; with `block`, waits up to recover.write_timeout_secs."""
        poll = lambda: [done or None for done in self.call_all("export_result", global_step)]  # noqa: E731
        return all(self._wait_for_write(poll, f"the HF export of step {global_step}") if block else poll())

    def shutdown(self) -> None:
        """Kill every rank (survivors may be stuck in a collective with a dead one) and free the bundles."""
        self._kill(self.members)
        if self.pg is not None:
            remove_placement_group(self.pg)
        self.orphans = []


class RolloutGroup(_Members):
    """M independent inference engines; each can be replaced alone, by a warm spare engine when one is ready
    (rollout.spare_engines: started ahead, holding no version, so refitted by the resync like a new engine)."""

    group = Group.ROLLOUT

    def __init__(self, config: Config, timeout: float):
        super().__init__(timeout)
        self.config = config
        self._where: dict[int, ray.ObjectRef] = {}
        self.members = [self._spawn(i) for i in range(config.cluster.n_rollout_workers)]
        self.spares: list[tuple[Member, ray.ObjectRef]] = []  # each with its start's `where` call
        self.from_spares = 0  # how many engines the last `replace` took from the spares

    def _start(self, index: int, **options) -> tuple[ray.actor.ActorHandle, ray.ObjectRef]:
        """A new engine (`index` sets the cores it binds), and its `where` call, done once it is up."""
        cluster = self.config.cluster
        handle = RolloutWorker.options(num_cpus=cluster.cpus_per_worker, num_gpus=cluster.gpus_per_engine,
                                       max_restarts=0, **options).remote(self.config, index)
        return handle, handle.where.remote()

    def _spawn(self, i: int) -> Member:
        # Not waited for: the engine starts while the TrainGroup does; its first call gets the start-up bound.
        handle, where = self._start(i)
        self._where[i] = where
        return Member(handle, f"RolloutWorker[{i}]")

    def refill(self) -> int:
        """Start spare engines up to rollout.spare_engines on nodes with room, away from the engines' nodes where
        possible (a node's loss then takes no spare with its engines); not waited for. Returns how many."""
        missing = self.config.rollout.spare_engines - len(self.spares)
        nodes = choose_nodes(room_per_node(), {n for n in self.nodes if n},
                             engine_resources(self.config.cluster), missing)
        for node in nodes:
            index = len(self.members) + len(self.spares)
            handle, where = self._start(index, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=True))
            self.spares.append((Member(handle, f"RolloutWorker[spare {index}]"), where))
        return len(nodes)

    def warm_spares(self) -> int:
        """How many spare engines are up, without waiting."""
        starts = [where for _, where in self.spares]
        return len(ray.wait(starts, num_returns=len(starts), timeout=0)[0]) if starts else 0

    def live_spares(self) -> int:
        """How many spare engines can serve, without waiting: those still starting, and the started ones on a
        node Ray does not have dead (a spare lost with its node frees no CPU for a replacement)."""
        if not self.spares:
            return 0
        up = set(ray.wait([w for _, w in self.spares], num_returns=len(self.spares), timeout=0)[0])
        dead = dead_nodes()
        usable = 0
        for _, where in self.spares:
            try:
                usable += where not in up or ray.get(where)["node_id"] not in dead
            except Exception:  # noqa: BLE001 - its start failed: it serves nothing
                pass
        return usable

    def wait_started(self, only: list[int] | None = None) -> None:
        """Wait (with the start-up bound) until the engines still starting, of those in `only`, are up."""
        starting = [i for i in self._where if only is None or i in only]
        if not starting:
            return
        refs = [self._where.pop(i) for i in starting]  # if the wait fails, it keeps them as orphans
        where = self.gather(refs, self.config.recover.start_timeout_secs, [self.members[i] for i in starting])
        for i, w in zip(starting, where):
            self.members[i].node_id, self.members[i].pid = w["node_id"], w["pid"]

    def _call(self, method: str, args_of, only: list[int] | None = None) -> list:
        """Call `method` on every engine (or those in `only`), once those still starting are up."""
        only = list(range(len(self.members))) if only is None else only
        self.wait_started(only)
        members = [self.members[i] for i in only]
        return self.gather([getattr(m.handle, method).remote(*args_of(i)) for i, m in zip(only, members)],
                           members=members)

    def generate(self, prompts: list[str], global_step: int, version: int, greedy: bool = False) -> dict:
        """Split the samples into contiguous chunks, one per engine, and merge the results in order.
        Every engine must hold weights `version`, or it refuses."""
        n = len(self.members)
        bounds = [len(prompts) * i // n for i in range(n + 1)]
        chunks = self._call("generate", lambda i: (
            prompts[bounds[i]:bounds[i + 1]], list(range(bounds[i], bounds[i + 1])), global_step, version, greedy))
        return merge_rollouts(chunks)

    def connect(self, trainers: TrainGroup) -> WeightStream:
        """A new weights-update group of the TrainGroup's rank 0 and these engines."""
        return WeightStream(trainers, self, self.config)

    def weight_status(self) -> list[tuple[int | None, str]]:
        return self._call("weight_status", lambda i: ())

    def replace(self, faulty: tuple[str, ...]) -> list[str]:
        """Replace the faulty engines, and any other engine that is dead or cannot finish the call a fault
        left behind within PROBE_TIMEOUT_SECS, by spare engines where there are (spare_placement.take_spares:
        those that answer the same probe first), else by new ones; returns the names of those replaced."""
        self._kill([m for m in self.members if m.name in faulty])
        # engines still starting are left alone: their first call has the start-up bound
        survivors = [m for i, m in enumerate(self.members) if m.name not in faulty and i not in self._where]
        up = set(ray.wait([w for _, w in self.spares], num_returns=len(self.spares), timeout=0)[0]) \
            if self.spares else set()
        probes = {m.name: m.handle.where.remote() for m in survivors + [m for m, w in self.spares if w in up]}
        running, errors = drain(list(probes.values()), PROBE_TIMEOUT_SECS)
        answered = {name: ray.get(ref) for name, ref in probes.items() if ref not in running and ref not in errors}
        broken = set(faulty) | {m.name for m in survivors if m.name not in answered}
        self.orphans += running
        spares = {m.name: (m, w) for m, w in self.spares}
        lost_spares = {m.name for m, w in self.spares if w in up and m.name not in answered}
        self._kill([m for m in self.members if m.name in broken and m.name not in faulty] +
                   [spares.pop(name)[0] for name in lost_spares])
        slots = [i for i, m in enumerate(self.members) if m.name in broken]
        taken = take_spares(slots, [m.name for m, w in self.spares if m.name in answered],
                            [m.name for m, w in self.spares if w not in up])
        for i in slots:
            if i in self._where:
                self.orphans.append(self._where.pop(i))
            if i not in taken:
                self.members[i] = self._spawn(i)
                continue
            spare, where = spares.pop(taken[i])
            self.members[i] = Member(spare.handle, f"RolloutWorker[{i}]")
            self.orphans.append(spare.handle.take_place.remote(i))  # before any call that serves as engine i
            if spare.name in answered:
                self.members[i].node_id, self.members[i].pid = (answered[spare.name][k] for k in ("node_id", "pid"))
            else:  # still starting: its first call waits for it, with the start-up bound
                self._where[i] = where
        self.spares = list(spares.values())
        self.from_spares = len(taken)
        return sorted(broken)

    def shutdown(self) -> None:
        self.orphans += list(self._where.values()) + [w for _, w in self.spares]
        self._kill(self.members + [m for m, _ in self.spares])
        self.orphans, self._where, self.spares = [], {}, []
