"""The controller: the run as a few named states, one transition function, one place that applies it.

    STARTING --ok--> RUNNING --ok--> RUNNING ... --done--> FINISHED
        |               |
        +----fault------+--> REPAIRING(decision) --ok--> RUNNING
                                   |  (a fault while repairing: REPAIRING again, or FAILED)
    any state --fatal (bad checkpoint, no capacity, retries spent)--> FAILED

Each state's work (`_work`) is an effect on the groups and the disk; whatever it raises is classified
(classify.py) and decided on (policy.py) in `_on_fault`, and `transition` turns the outcome into the next
state. The groups are made by factories the Supervisor actor passes in, so tests drive this file without
Ray, with stand-in groups.
"""
from __future__ import annotations

import enum
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable, Optional

from supervisor.checkpoint.store import Checkpoint, CheckpointError
from supervisor.checkpoint.trial_lock import LockLost
from supervisor.cluster.blame import dead_nodes
from supervisor.cluster.drains import draining_nodes
from supervisor.cluster.errors import CapacityError, Group, first_line
from supervisor.config import MEMORY_TIER_BACKENDS, Config, RoleName
from supervisor.control.classify import Fault, FaultKind, classify
from supervisor.control.coordinator import CheckpointCoordinator
from supervisor.control.events import Event, EventLog, StatsLog, group_of, read_jsonl
from supervisor.control.log import run_log
from supervisor.control.policy import Action, Decision, RestartPolicy, engines_to_replace, train_group_sizes
from supervisor.control.preemption import HANDOFF_SECS, Handoff, plan_handoff
from supervisor.control.recovery_source import (MEMORY_FAULTS, Choice, Source, can_keep, hang_culprits,
                                                keep_survivors, recovery_source)
from supervisor.control.repair_clock import RepairClock, steady_steps
from supervisor.control.run_state import IncompatibleCheckpoint, RunState
from supervisor.control.step import Phase, StepRunner
from supervisor.exit_codes import ExitCode

ANSWER_SECS = 5.0  # how long a rank may take to answer after a fault before it counts as lost
PROGRESS_SECS = 2.0  # how long a hung rank's progress probe may take (a live one answers in milliseconds)
WRITE_POLL_SECS = 0.05  # how often a handoff asks whether the background writes it waits for are published


class State(str, enum.Enum):
    STARTING = "starting"    # load the last valid checkpoint, start both groups, resync the engines
    RUNNING = "running"      # one step (or what the last committed step still owes) per transition
    REPAIRING = "repairing"  # apply a repair decision: restart the TrainGroup, the engines, or skip a save
    FINISHED = "finished"
    FAILED = "failed"
    TERMINATED = "terminated"  # SIGTERM to the driver: stopped at a step boundary, saved there; the same command resumes

    @property
    def terminal(self) -> bool:
        return self in (State.FINISHED, State.FAILED, State.TERMINATED)


class Outcome(str, enum.Enum):
    OK = "ok"
    DONE = "done"      # every step trained and settled
    FAULT = "fault"    # a repairable fault; the decision says how
    FATAL = "fatal"    # stop: the decision (or a bad checkpoint, missing capacity) says why
    TERMINATED = "terminated"  # a stop was asked for (SIGTERM): the run ends at a step boundary, resumable


@dataclass(frozen=True)
class Result:
    outcome: Outcome
    decision: Optional[Decision] = None
    fault: Optional[Fault] = None
    exit_code: int = ExitCode.OK
    message: str = ""
    details: str = ""


@dataclass(frozen=True)
class Current:
    """The controller's state and its payload: REPAIRING carries the decision to apply, the terminal states the
    result that ended the run."""
    state: State
    result: Optional[Result] = None


class UnexpectedState(RuntimeError):
    """A transition that the state machine does not have: a bug in relaunch."""


def transition(current: State, result: Result) -> State:
    """The next state. Pure: the whole state machine is this function."""
    if current.terminal:
        raise UnexpectedState(f"no transition out of {current.value}")
    if result.outcome is Outcome.FATAL:
        return State.FAILED
    if result.outcome is Outcome.TERMINATED:
        return State.TERMINATED
    if result.outcome is Outcome.FAULT:
        return State.REPAIRING
    if result.outcome is Outcome.DONE:
        if current is State.REPAIRING:
            raise UnexpectedState("a repair cannot finish the run")
        return State.FINISHED
    return State.RUNNING  # OK: started, stepped or repaired


@dataclass
class JobResult:
    exit_code: int
    message: str
    global_step: int = -1
    reward: float | None = None
    details: str = ""


class Controller:
    def __init__(self, config: Config, runner: StepRunner, checkpoints: CheckpointCoordinator, policy: RestartPolicy,
                 events: EventLog, stats: StatsLog, make_train_group: Callable, make_rollout_group: Callable,
                 sleep: Callable[[float], None] = time.sleep, supervisor_restarted: bool = False,
                 pools: dict | None = None, memory_off: str | None = None, drains=None):
        self.config, self.runner, self.checkpoints, self.policy = config, runner, checkpoints, policy
        self.fleet = runner.fleet  # the groups it replaces, the ones the runner steps on
        self.events, self.stats, self.sleep = events, stats, sleep
        self.make_train_group, self.make_rollout_group = make_train_group, make_rollout_group
        self.supervisor_restarted = supervisor_restarted
        self.current = Current(State.STARTING)
        self.log = run_log(events.attempt)
        self.clock = RepairClock()          # where the time of the repair in progress goes
        self.pools = pools or {}            # role -> its group's warm spare pool (cluster/spares.py), if it keeps one
        self.memory_off = memory_off        # why the memory tier does not serve this job (recover.memory), or None
        self.drains = drains                # Ray's drain notices not acted on yet (cluster/drains.py), or None
        self.stop_requested: str | None = None  # why the run is to stop at the next step boundary (SIGTERM)
        self.refill_due: set[RoleName] = set()  # the pools to refill once their new groups have completed a step
        self.transitioned = time.monotonic()  # when the last transition was applied (the driver's watchdog)

    @property
    def state(self) -> State:
        return self.current.state

    # ---- the loop -------------------------------------------------------------------------------------
    def run(self) -> JobResult:
        try:
            while not self.state.terminal:
                result = self._work()
                self._enter(transition(self.state, result), result)
        finally:
            self._shutdown()
        r, step = self.current.result, self.runner.state.step.global_step
        if self.state is State.FINISHED:
            self.events.emit(Event.DONE, global_step=step, reward=self.runner.last_reward, message=r.message)
            return JobResult(ExitCode.OK, r.message or f"finished {self.runner.total_steps} steps", step,
                             self.runner.last_reward)
        if self.state is State.TERMINATED:
            self.events.emit(Event.INTERRUPTED, global_step=self.checkpoints.last_commit, signal=self.stop_requested,
                             message=r.message)
            return JobResult(ExitCode.TERMINATED, r.message, step, self.runner.last_reward)
        kind = Event.FAILED if r.fault is None or r.fault.kind in (FaultKind.USER_ERROR, FaultKind.INTERNAL_ERROR,
                                                                   FaultKind.START_FAILED) \
            else Event.GAVE_UP
        self.events.emit(kind, reason=r.message)
        return JobResult(r.exit_code, r.message, step, details=r.details)

    def _enter(self, new: State, result: Result) -> None:
        """The one place a transition is applied and logged."""
        self.transitioned = time.monotonic()
        if new is not self.state:
            self.events.emit(Event.STATE, previous=self.state.value, state=new.value,
                             global_step=self.runner.state.step.global_step)
        self.current = Current(new, None if new is State.RUNNING else result)
        if new is State.RUNNING:
            self.policy.started = True

    def _work(self) -> Result:
        """The current state's work; every error it raises becomes a classified, decided fault."""
        try:
            if self.state is State.STARTING:
                return self._start()
            if self.state is State.RUNNING:
                return self._step()
            if self.state is State.REPAIRING:
                return self._repair(self.current.result)
            raise UnexpectedState(f"no work in state {self.state.value}")
        except CheckpointError as e:  # every checkpoint damaged, or one that cannot fit this run
            return Result(Outcome.FATAL, exit_code=ExitCode.BAD_INPUT, message=str(e))
        except (CapacityError, LockLost) as e:
            return Result(Outcome.FATAL, exit_code=ExitCode.FAILED, message=str(e))
        except UnexpectedState:
            raise
        except Exception as e:  # noqa: BLE001 - classified below: only a bug in relaunch is an internal error
            return self._on_fault(classify(e), e)

    def _step(self) -> Result:
        if not self.runner.finished:
            if self.stop_requested is not None and self.runner.owed is None and not self.runner.finished_training:
                return self._stop()  # (once every step is trained, the run ends as it would have)
            self._act_on_drains()
            completed = self.runner.advance()
            if completed is not None and self.clock.running:
                rows = read_jsonl(self.stats.path)
                recovery = self.clock.completed(completed, steady_steps(rows, completed))
                if recovery is not None:
                    self.events.emit(Event.RECOVERY, **recovery)
            self._refill_spares()
        return Result(Outcome.DONE if self.runner.finished else Outcome.OK)

    def _in_flight(self, fault: Fault) -> int:
        """The global step that was in flight when `fault` struck: the recovery clock's finish line. A restarted
        Supervisor learns it from the rows its predecessor wrote. After the last step, only its save can be in
        flight: the clock stops when that step, trained again, completes."""
        if fault.kind is FaultKind.SUPERVISOR_DIED:
            logged = [r["global_step"] for r in read_jsonl(self.stats.path) if "global_step" in r]
            step = max(logged, default=-1) + 1
        else:
            step = self.runner.state.step.global_step + (0 if self.runner.owed else 1)
        return min(step, self.runner.total_steps - 1)

    def _stop(self) -> Result:
        """A stop asked for (SIGTERM to the driver), at a step boundary: the background writes are committed and the
        step just completed is saved, so that the same command resumes after it with nothing trained again."""
        step = self.runner.state.step.global_step
        try:
            self.runner.save_now()
        except Exception as e:  # noqa: BLE001 - a failed save keeps the last commit; the driver ends the workers
            self.checkpoints.discard_failed_save()
            self.events.emit(Event.WARNING, message=f"the save before the stop failed: {type(e).__name__}: "
                                                    f"{first_line(e)}; the last checkpoint is kept")
        kept = self.checkpoints.last_commit
        where = f"saved at global step {step}" if kept == step else \
            "nothing saved: no checkpoint yet" if kept is None else f"the last checkpoint is global step {kept}"
        return Result(Outcome.TERMINATED, message=f"stopped by {self.stop_requested} after global step {step} ({where});"
                                               f" the same command resumes")

    # ---- drain notices: a node that will go -----------------------------------------------------------
    def _act_on_drains(self) -> None:
        """At a step boundary (the last step paid what it owed), the nodes Ray says will go: their work moves off
        now, before their deadlines (preemption.py)."""
        fleet = self.fleet
        if self.drains is None or self.runner.owed is not None or fleet.trainers is None or fleet.engines is None:
            return
        groups = [self.fleet.group(role) for role in self.config.trained]
        if None in groups:
            return
        pools = list(self.pools.values())
        used = {n for group in (*groups, fleet.engines) for n in group.nodes if n} | \
            {s.node for pool in pools for s in pool.holders().values()}
        notices = self.drains.new(used)
        for node, deadline in notices.items():
            self.drains.done(node)
            try:
                self._preempt(node, deadline, set(notices))
            except BaseException:  # a fault, repaired as one; the node's work is planned again after it
                self.drains.again(node)
                raise

    def _preempt(self, node: str, deadline: float | None, draining: set[str]) -> None:
        """Move the work off a node that will go: its ranks, of every trained group, to the holders of their copies
        of the step just completed, its engines to spare or new ones, its spares retired. No retry is spent; the
        `preemption` event says what moved where, and the `recovery` event what it cost, timed as a repair is."""
        r, fleet, started = self.runner, self.fleet, time.monotonic()
        engines, step = fleet.engines, r.state.step.global_step
        groups = {role: self.fleet.group(role) for role in self.config.trained}
        choices = {}
        for role, group in groups.items():
            lost = {rank for rank, n in enumerate(group.nodes) if n == node}
            if not lost:
                continue
            memory = self.runner.memories.get(role)
            if memory is not None and memory.off is None:
                memory.wait_landed(group, step)  # the copy of the step just completed, sent beside the step
            choices[role] = self._recovery_source(Fault(FaultKind.WORKER_DIED, "the node drains"),
                                                  set(range(group.world_size)) - lost, bundles=False, role=role)
        spares = {name: s.node for pool in self.pools.values()  # as they are now: an earlier handoff took some
                  for name, s in pool.holders().items()}
        handoff = plan_handoff(node=node, deadline=deadline, now=time.time(),
                               rank_nodes={role: group.nodes for role, group in groups.items()},
                               engine_nodes={m.name: m.node_id for m in engines.members}, spare_nodes=spares,
                               global_step=step, memory=choices,
                               draining=draining)
        if handoff is None:
            return
        moving = ", ".join(f"{role} ranks {list(ranks)}" for role, ranks in handoff.ranks.items()) or "ranks []"
        self.log.info(f"node {node[:8]} drains (deadline {_until(deadline)}): moving {moving}, "
                      f"engines {list(handoff.engines)}, spares {len(handoff.spares)}"
                      + (f"; {handoff.fallback}" if handoff.fallback else ""), extra={"step": step, "phase": self.phase})
        if handoff.moves:
            self._hand_off(handoff, {role: choices[role] for role in handoff.ranks}, step)
        moved = lambda role: list(handoff.ranks.get(role, ()))  # noqa: E731
        to = lambda role: [groups[role].nodes[rank] for rank in moved(role)]  # noqa: E731 - where they went
        self.events.emit(Event.PREEMPTION, node=node, deadline=deadline, global_step=step, ranks=moved(RoleName.ACTOR),
                         to=to(RoleName.ACTOR), engines=list(handoff.engines), spares=list(handoff.spares),
                         fallback=handoff.fallback, secs=round(time.monotonic() - started, 3),
                         **({"critic_ranks": moved(RoleName.CRITIC), "critic_to": to(RoleName.CRITIC)}
                            if RoleName.CRITIC in groups else {}))

    def _hand_off(self, handoff: Handoff, choices: dict[RoleName, Choice], step: int) -> None:
        """`choices`: where each group whose ranks move takes them from (the memory tier's adoption)."""
        fleet = self.fleet
        self.clock.start("preemption", "handoff", 0.0, step + 1)  # timed to the next step's completion
        held = None
        if choices:
            with self.clock.part("teardown"):
                self._finish_writes(handoff.deadline)
                held = fleet.trainers.shard_digests()  # what the ranks hold, checked once they moved
        for role in self.config.trained:  # the spares there: refilled elsewhere after the next step
            pool, memory = self.pools.get(role), self.runner.memories.get(role)
            retired = tuple(s.name for s in pool.spares if s.name in handoff.spares) if pool is not None else ()
            if retired:
                pool.drop(list(retired))
                if memory is not None:
                    memory.retired(self.fleet.group(role), retired)
        if handoff.engines:
            with self.clock.part("teardown"):
                # the spares the moving ranks take stay (ranks move only where the memory tier chose where to)
                keep = frozenset(name for c in choices.values() for name in c.adopters.values())
                self._make_room_for_engines(len(handoff.engines), keep, {role: len(c.givers)
                                                                         for role, c in choices.items()})
                replaced = fleet.engines.replace(handoff.engines)
            self.events.emit(Event.ENGINES_RESTARTED, replaced=replaced, from_spares=fleet.engines.from_spares)
        if choices:
            self._rejoin_from_memory(choices, held)  # resyncs every engine
            return
        with self.clock.part("resync"):
            fleet.sync_engines(self.runner.weights_version, gate=True)
        self.clock.resumed()

    def _finish_writes(self, deadline: float | None) -> None:
        """Before ranks hand their places off: the background save and export in flight are published (the ranks
        writing them are healthy; a handoff would drop them), as long as the deadline leaves a handoff's time."""
        trainers, in_flight = self.fleet.trainers, self.checkpoints.in_flight
        while not in_flight.idle and (deadline is None or time.time() < deadline - HANDOFF_SECS):
            self.checkpoints.collect(trainers, block=deadline is None)
            if not in_flight.idle:
                self.sleep(WRITE_POLL_SECS)

    # ---- faults ---------------------------------------------------------------------------------------
    def _on_fault(self, fault: Fault, error: BaseException | None = None) -> Result:
        in_flight = self.checkpoints.in_flight
        background = in_flight.failed  # a background save or export of an earlier step failed
        saving = background is not None or (self.state is State.RUNNING and
                                            self.runner.phase in (Phase.EXPORT, Phase.SAVE))
        fault = replace(fault, in_save=saving)
        step = in_flight.failed_step() if background else \
            self.runner.state.step.global_step + (0 if self.runner.owed else 1)
        self.events.emit(Event.FAILURE, cause=fault.kind.value, message=fault.message, group=fault.group.value,
                         actor=fault.actor, actors=list(fault.actors), node=fault.node, node_lost=fault.node_lost,
                         detect_secs=fault.detect_secs, global_step=step, phase=self.phase)
        decision = self.policy.decide(fault, now=time.time(), repairing=self.state is State.REPAIRING)
        where = f" on node {fault.node[:8]}" if fault.node else ""
        self.log.warning(f"{fault.kind.value}: {fault.message}{where} -> {decision.reason}",
                         extra={"step": step, "phase": self.phase})
        if fault.kind is FaultKind.STORAGE_ERROR and saving:
            # every rank came back from the failed save (else the TrainGroup restart cleans up after its kill)
            removed = self.checkpoints.discard_failed_save() if fault.settled else []
            self.events.emit(Event.SAVE_FAILED, global_step=step, error=fault.message,
                             what=f"background {background.value}" if background else self.runner.phase.value,
                             action=self.config.recover.on_save_error.value, removed=[str(p) for p in removed])
        if decision.action is Action.FAIL:
            details = ""
            if error is not None and fault.kind in (FaultKind.USER_ERROR, FaultKind.INTERNAL_ERROR,
                                                    FaultKind.START_FAILED):
                details = "".join(traceback.format_exception(error.__cause__ or error))
            return Result(Outcome.FATAL, decision, fault, ExitCode.FAILED, decision.reason, details)
        if decision.action is not Action.SKIP_SAVE:
            self.clock.start(fault.kind.value, decision.action.value, fault.detect_secs, self._in_flight(fault))
            self.events.emit(Event.RESTART if decision.counted else Event.REPAIR, n=self.policy.restarts,
                             limit=self.policy.retries, what=decision.action.value, cause=fault.kind.value,
                             delay_secs=decision.delay_secs)
        return Result(Outcome.FAULT, decision, fault)

    @property
    def phase(self) -> str:
        if self.state is State.RUNNING and self.runner.phase is not None:
            return self.runner.phase.value
        return self.state.value

    # ---- starting and repairing -----------------------------------------------------------------------
    def _start(self) -> Result:
        committed = self.checkpoints.committed_step()
        complete = committed is not None and committed + 1 >= self.runner.total_steps
        if not (complete or self.supervisor_restarted):
            self._restart_train_group()  # validates the checkpoint while the group starts
            return Result(Outcome.OK)
        ckpt = self.checkpoints.load_last_valid()
        if ckpt is not None and ckpt.global_step + 1 >= self.runner.total_steps:
            self.runner.roll_back(self._state_of(ckpt, warn=True))
            msg = f"already complete at global step {ckpt.global_step}; nothing to train"
            return Result(Outcome.DONE, message=msg)
        if self.supervisor_restarted:
            self.supervisor_restarted = False
            if ckpt is not None:  # so the failure is reported at the step it interrupted; stats stay until decided
                self.runner.state = self._state_of(ckpt)
            return self._on_fault(Fault(FaultKind.SUPERVISOR_DIED, "the Supervisor actor died (or hung) and was "
                                        "restarted by Ray; rebuilding from disk", Group.SUPERVISOR, ("Supervisor",)))
        self._restart_train_group()
        return Result(Outcome.OK)

    def _refill_spares(self) -> None:
        """Once the step that was in flight at the last fault has completed again: start spare engines up to
        rollout.spare_engines, and spares up to the pool's size, away from the ranks. Not earlier, so that building
        their models never competes for the CPUs with the repair or the steps it trains again; tried again after
        every step while the cluster has no room for them."""
        if self.runner.finished or self.clock.running:
            return
        engines = self.fleet.engines
        if len(engines.spares) < self.config.rollout.spare_engines:
            started = self._best_effort("starting spare engines", engines.refill)
            if started:
                self.events.emit(Event.SPARES, action="refilled", kind="engine", started=started,
                                 pool=len(engines.spares), size=self.config.rollout.spare_engines)
        placed: list[str] = []
        for role, pool in self.pools.items():  # also the holders the memory tier dropped (memory_copies.py)
            if self.fleet.group(role) is not None and (role in self.refill_due or pool.dropped):
                placed += self._refill_pool(role, placed)

    def _refill_pool(self, role: RoleName = RoleName.ACTOR, placed: list[str] = ()) -> list[str]:
        """Start spares up to `role`'s pool's size, away from its ranks (and counting the room the spares just
        `placed` by another pool take); due again while the cluster lacks the room. Returns their nodes."""
        spares, group = self.pools.get(role), self.fleet.group(role)
        nodes = []
        if len(spares) < spares.size:
            nodes = self._best_effort("refilling the spare pool", spares.refill, group.nodes, placed) or []
            if nodes:
                self.events.emit(Event.SPARES, action="refilled", started=len(nodes), nodes=nodes,
                                 pool=len(spares), size=spares.size,
                                 **group_of(role))
        if len(spares) < spares.size:
            self.refill_due.add(role)
        else:
            self.refill_due.discard(role)
        spares.dropped = 0
        return nodes

    def _best_effort(self, what: str, work: Callable, *args):
        """Optional work (the spare pool's upkeep): whatever it raises (a GCS error, ...) is a warning, never a
        fault that would roll back a completed step or fail the job; it is tried again later. None if it failed."""
        try:
            return work(*args)
        except Exception as e:  # noqa: BLE001 - nothing of the run depends on it
            self.events.emit(Event.WARNING, message=f"{what} failed: {type(e).__name__}: {first_line(e)}; "
                                                    f"tried again later")
            return None

    def _repair(self, pending: Result) -> Result:
        decision, fault = pending.decision, pending.fault
        if decision.delay_secs:
            with self.clock.part("backoff"):
                self.sleep(decision.delay_secs)
        if decision.action is Action.RESTART_TRAIN_GROUP:
            self._restart_ranks(fault)
        elif decision.action is Action.RESTART_ENGINES:
            self._restart_engines(fault)
        elif decision.action is Action.SKIP_SAVE and \
                (self.checkpoints.skip_failed_write() or self.runner.skip_owed_save()) is None:
            return Result(Outcome.FATAL, decision, fault, ExitCode.FAILED, f"{fault.message} (not in a save)")
        # REPLAY_STEP: nothing advanced before the commit; the next transition runs the step again
        return Result(Outcome.OK)

    def _restart_ranks(self, fault: Fault) -> None:
        """Recover the faulty group (the actor's, or a critic rank's: the critic's) from memory where the memory
        tier holds every lost rank's state and the other groups' own copies hold the same step, else (or if that
        fails on the way) from disk, the ranks that still answer keeping their processes where they can. Either
        way one repair: the retry was counted when it was decided."""
        role = RoleName.CRITIC if fault.group is Group.CRITIC else RoleName.ACTOR
        try:
            alive = self._answering(fault, role)
            choice = self._from_memory(fault, role, alive)
        except Exception as e:  # noqa: BLE001 - asking the ranks and buddies failed: disk needs none of them
            why = f"{type(e).__name__}: {first_line(e)}"
            alive, choice = None, Choice(Source.DISK, f"{self.memory_off}; asking the ranks failed: {why}"
                                         if self.memory_off else f"the memory tier could not be asked: {why}")
        choices, failed = choice if isinstance(choice, dict) else None, False
        reason = f"step {next(iter(choices.values())).step} from memory" if choices else choice.reason
        self.log.info(f"recovering from {'memory' if choices else 'disk'}: {reason}",
                      extra={"step": self.runner.state.step.global_step, "phase": self.phase})
        if choices:
            try:
                self._rejoin_from_memory(choices)
                return
            except Exception as e:  # noqa: BLE001 - whatever broke, the disk path kills every rank and reloads
                choice = Choice(Source.DISK, f"recovery from memory failed: {type(e).__name__}: {first_line(e)}")
                self.events.emit(Event.WARNING, message=f"{choice.reason}; recovering from disk")
                alive, failed = None, True  # every group may have left its process group: all start again
        self.clock.disk_because(choice.reason)
        if role is RoleName.CRITIC and not failed:
            self._restart_critics(fault, alive)
            return
        lost, why_not = self._kept(fault, alive)
        if why_not is None:
            try:
                ckpt, secs, started = self._regroup(lost)
            except CheckpointError:
                raise  # no valid checkpoint fits the run: fatal, as it is for a new group
            except Exception as e:  # noqa: BLE001 - whatever broke the new group, every rank starts again
                self.events.emit(Event.WARNING, message=f"keeping the ranks that answered failed: "
                                                        f"{type(e).__name__}: {first_line(e)}; every rank starts again")
            else:
                self._spares_taken(len(lost))
                self._load(ckpt, secs, started, kept=sorted(alive))
                return
        self._restart_train_group()

    def _answering(self, fault: Fault, role: RoleName = RoleName.ACTOR) -> set[int] | None:
        """The ranks of `role`'s group alive and settled after `fault` (a hang's culprits killed first), or None
        where no repair would keep them: no group running, or neither the memory tier nor a regroup could
        (recovery_source)."""
        group, memory = self.fleet.group(role), self.runner.memories.get(role)
        tier = memory is not None and memory.off is None
        if group is None or fault.kind not in MEMORY_FAULTS or not (tier or self._can_keep(fault, role) is None):
            return None
        if fault.kind is FaultKind.HANG:
            self._kill_hang_culprits(fault, group)
        return group.answering(ANSWER_SECS)

    def _can_keep(self, fault: Fault, role: RoleName = RoleName.ACTOR) -> str | None:
        """recovery_source.can_keep, for this job and `role`'s group (only the actor's holds a KL reference)."""
        cfg, group = self.config, self.fleet.group(role)
        return can_keep(rejoins=cfg.trained[role].backend in MEMORY_TIER_BACKENDS, kind=fault.kind,
                        committed=self.checkpoints.last_commit is not None,
                        reference=role is RoleName.ACTOR and cfg.actor.kl_coef > 0,
                        shrunk=group is not None and group.world_size < cfg.workers_of(role))

    def _from_memory(self, fault: Fault, role: RoleName, alive: set[int] | None) -> dict[RoleName, Choice] | Choice:
        """The repairs from memory of every group that lost ranks, all to one step (role -> its Choice), or the
        Choice of disk saying why not. `alive`: the ranks of `role`'s group (the faulty one) that answered; the
        other groups' ranks are asked now (a node's loss takes ranks of every group there), and where all of
        theirs answer, they roll back in place beside it."""
        answered = {role: alive}
        for other in self.config.trained:
            group = self.fleet.group(other)
            if other is not role:
                answered[other] = group.answering(ANSWER_SECS) if group is not None and alive is not None else None
        choices = {}
        for each, ranks in answered.items():
            group = self.fleet.group(each)
            if each is role or (group is not None and ranks is not None and len(ranks) < group.world_size):
                others = {other: answered[other] for other in answered if other is not each}
                choice = self._recovery_source(fault, ranks, role=each, others=others)
                if choice.source is not Source.MEMORY:
                    return choice if each is role else replace(choice, reason=f"the {each.value}'s lost ranks: "
                                                                              f"{choice.reason}")
                choices[each] = choice
        steps = {each.value: choice.step for each, choice in choices.items()}
        if len(set(steps.values())) > 1:
            return Choice(Source.DISK, f"the groups' lost ranks are held at different steps ({steps})")
        return choices

    def _recovery_source(self, fault: Fault, alive: set[int] | None, bundles: bool = True,
                         role: RoleName = RoleName.ACTOR, others: dict[RoleName, set[int] | None] | None = None) \
            -> Choice:
        """Memory or disk (recovery_source.py) for `role`'s group, from who still answers, what the buddies hold
        and the steps the other groups' ranks hold in their own slots. `bundles`: whether a lost rank may start
        again in its bundle (not when its node drains); `others`: the other groups whose ranks roll back in place
        beside it, each with its ranks that answered (None: asked of none), or None where none do (a handoff)."""
        r, group, memory, pool = self.runner, self.fleet.group(role), self.runner.memories.get(role), self.pools.get(role)
        off = next((m.off for m in r.memories.values() if m.off is not None), None)  # the tier serves every group or none
        if memory is None or off is not None:
            return Choice(Source.DISK, self.memory_off if memory is None else off)
        others = {other: (self.fleet.group(other), ranks) for other, ranks in (others or {}).items()}
        if group is None or any(g is None for g, _ in others.values()):  # a restarted Supervisor, or a failed start
            return recovery_source(enabled=None, kind=fault.kind, world_size=0, lost=set(), buddies={}, holding={},
                                   staged=[], snapshots=set())
        lost = set() if alive is None else set(range(group.world_size)) - alive
        peers = {name: c.holder.rank for name, c in memory.candidates(group).items() if c.holder.rank is not None}
        gone = dead_nodes() | set(draining_nodes() or ()) if lost else set()
        bundles = bundles and not fault.node_lost  # a node Ray has not marked dead yet may still hold a bundle
        bundled = {rank for rank in lost if bundles and rank in group.bundles and group.nodes[rank] not in gone}
        spares = [s for s in pool.spares if s.node not in gone] if pool is not None else []
        beside = {other.value: self.runner.memories.get(other).staged_by(set(range(g.world_size)) if ranks is None else ranks)
                  for other, (g, ranks) in others.items()}  # the steps their ranks that answered hold
        return recovery_source(enabled=None, kind=fault.kind, world_size=group.world_size, lost=lost,
                               buddies=memory.covering(), holding=memory.holding(group),
                               staged=memory.staged_by(set(range(group.world_size)) - lost),
                               snapshots=set(r.snapshots), peers=peers, bundled=bundled,
                               spares=frozenset(s.name for s in spares),
                               free_bundles=len(group.free) if bundles else 0, beside=beside)

    def _kept(self, fault: Fault, alive: set[int] | None, role: RoleName = RoleName.ACTOR) -> tuple[list[int],
                                                                                                     str | None]:
        """For a repair from disk of `role`'s group: its lost ranks, and None when the others keep their processes
        (recovery_source.keep_survivors), else why every rank of it starts again."""
        group, spares = self.fleet.group(role), self.pools.get(role)
        if group is None or alive is None:
            return [], "no rank was asked whether it still answers"
        lost = set(range(group.world_size)) - alive
        gone = fault.node_lost or bool({group.nodes[r] for r in lost} & dead_nodes())
        placeable = group.placeable(lost, len(spares) if spares is not None else 0)
        return sorted(lost), self._can_keep(fault, role) or keep_survivors(
            kind=fault.kind, world_size=group.world_size, lost=lost, placeable=placeable, node_lost=gone)

    def _kill_hang_culprits(self, fault: Fault, group) -> None:
        """Turn a hang into deaths: kill the ranks of `group` the others wait on (recovery_source.hang_culprits),
        so that the others' collectives fail and they can roll back in place. Gloo cannot abort a collective; a
        killed peer ends it within a tenth of a second (measured). Nothing is killed when no culprit can be named."""
        pending = {rank for rank, m in enumerate(group.members) if m.name in fault.actors}
        culprits = hang_culprits(pending, group.progress(PROGRESS_SECS))
        if culprits and len(culprits) < group.world_size:
            self.log.info(f"killing the hung ranks {sorted(culprits)} the others wait on",
                          extra={"step": self.runner.state.step.global_step, "phase": self.phase})
            group.kill_ranks(culprits)

    def _rejoin_from_memory(self, choices: dict[RoleName, Choice], held: list[str] | None = None) -> None:
        """Restart only the dead: in each group of `choices` (role -> its repair from memory, all to one step), the
        holders of the lost ranks' copies take their places with their state and the other ranks roll back in
        place from their own copies; after a fault (not a handoff, `held`), so does every rank of the other
        groups (PPO: the critic's beside an actor's fault, the actor's beside a critic's), the groups' rendezvous
        running together; the Supervisor rolls back to the same step from its own memory; engines that already
        hold that step's weights are not resynced. Nothing is read from disk. The restored weights are checked
        whole at the resync (gathered and hashed), but after a handoff, where every rank's digest of its part from
        before it moved (`held`) is matched instead: a handoff moves ranks at a step boundary, where the other
        groups are at the step already and stay as they are."""
        r, fleet, started = self.runner, self.fleet, time.monotonic()
        step, = {c.step for c in choices.values()}
        if held is None:
            in_place = Choice(Source.MEMORY, "rolled back in place", step)
            choices = {role: choices.get(role, in_place) for role in self.config.trained}
        with self.clock.part("teardown"):
            fleet.close_stream()
            self.checkpoints.drop_in_flight(keep_export=RoleName.ACTOR not in choices or
                                            0 not in choices[RoleName.ACTOR].lost)
        holders = {role: self.runner.memories.get(role).candidates(self.fleet.group(role)) for role in choices}
        with ThreadPoolExecutor(max_workers=len(choices), thread_name_prefix="rejoin") as pool:
            rejoins = {role: pool.submit(self.fleet.group(role).rejoin, c.adopters,
                                         {rank: holders[role][name].handle for rank, name in c.givers.items()},
                                         step, self.pools.get(role), c.bundled) for role, c in choices.items()}
            own = {role: rejoined.result() for role, rejoined in rejoins.items()}
        rejoined = time.monotonic() - started
        for role, c in choices.items():  # gone: the lost ranks' processes, the spares taken
            group, memory = self.fleet.group(role), self.runner.memories.get(role)
            memory.adopted(step, c.lost, c.adopters, c.givers, own[role],
                           gone=set(holders[role]) - set(memory.candidates(group)))
        repaired = [self.fleet.group(role) for role, c in choices.items() if c.lost] or [fleet.trainers]
        parts = {part: max(group.timings.get(part, 0.0) for group in repaired)  # the groups rejoined together
                 for part in {part for group in repaired for part in group.timings}}
        # a group rolled back in place beside them that took longer: its wait is the rendezvous'
        parts["rendezvous"] = parts.get("rendezvous", 0.0) + max(0.0, rejoined - sum(parts.values()))
        for part, secs in parts.items():
            self.clock.add(part, secs)
        for role, c in choices.items():
            spares = self.pools.get(role)
            if c.lost and spares is not None:
                taken = self.fleet.group(role).from_spares
                self.events.emit(Event.SPARES, action="taken", taken=taken, cold=len(c.lost) - taken,
                                 pool=len(spares), size=spares.size,
                                 **group_of(role))
        self.refill_due |= {role for role, c in choices.items() if c.lost}
        r.restore(step)
        trainers, critics = fleet.trainers, fleet.critics
        with self.clock.part("resync"):
            proven = held is not None and trainers.shard_digests() == held
        if held is not None:
            self.log.info("the moved ranks hold what they held: every rank's digest of its part matches; engines "
                          "already holding these weights keep them" if proven else "a moved rank's part of the "
                          "weights differs from before it moved: the weights are checked whole at the resync",
                          extra={"step": step, "phase": self.phase})
        if not proven:
            self.fleet.restored_from_memory(r.weights_version)  # checked at the resync: a mismatch goes to disk
        self.clock.loaded(step, Source.MEMORY)
        kept = lambda role: [rank for rank in range(self.fleet.group(role).world_size)  # noqa: E731
                             if role not in choices or rank not in choices[role].lost]
        self.events.emit(Event.LOADED, global_step=step, path=None, source=Source.MEMORY.value,
                         nodes=trainers.nodes, kept=kept(RoleName.ACTOR), missing_state=[],
                         secs=round(sum(parts.values()), 3),
                         **({} if critics is None else {"critic_kept": kept(RoleName.CRITIC),
                                                        "critic_nodes": critics.nodes}))
        self._resync()

    def _restart_train_group(self) -> None:
        """Kill every rank (the critic's too), start new groups that load the last valid checkpoint, roll the
        Supervisor back to its step, replace dead engines, and resync every engine to the checkpoint's weights."""
        r, fleet = self.runner, self.fleet
        with self.clock.part("teardown"):
            r.drop_group()
            fleet.drop_critics()
        if fleet.engines is None:
            fleet.engines = self.make_rollout_group()  # starts while the TrainGroup does
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="validate") as pool:
            # the checkpoint is validated (hashed, unless this Supervisor committed it) while the new groups
            # start; it cleans up interrupted saves, which is safe: no rank of any group writes now
            validated = pool.submit(self._validate)
            critics = pool.submit(self._new_critic_group)
            try:
                fleet.trainers = self._new_train_group()
            except BaseException:
                _shut_down(critics)  # its placement group would hold the room the next start asks for
                raise
            fleet.critics = critics.result()
            ckpt, secs = validated.result()
        self._spares_taken(len(fleet.trainers.nodes))
        if fleet.critics is not None:
            self._spares_taken(fleet.critics.world_size, RoleName.CRITIC)
        if r.memories and all(m.off is None for m in r.memories.values()) and not self.clock.running:
            # the job's start, no repair: the pools start now, so that the memory tier holds the first steps'
            # copies (their spares hold them before they are warm)
            placed: list[str] = []
            for role in self.pools:
                placed += self._refill_pool(role, placed)
        self._load(ckpt, secs, started, critic_kept=[])
        if not self.clock.running:  # the job's start: its first step's copy is held
            for memory, group in r.memories_of_groups():
                self._best_effort("linking the ranks to their memory-tier buddies", memory.link_first, group)

    def _restart_critics(self, fault: Fault, alive: set[int] | None) -> None:
        """A critic rank died or hung and the memory tier could not serve: its group is repaired from the last
        valid checkpoint like the actor's from disk (the ranks that still answer, `alive`, keep their processes,
        the lost ones start again from the critic's warm spares or cold, `_kept`), or else starts again whole; the
        actor's ranks keep their processes and load the same step in place (either group may have taken the step's
        update before the other faulted), where they can (recovery_source.can_keep: a checkpoint to load, an engine
        that loads in place, no KL reference, the group whole); else every group starts again. Dead engines are
        replaced and every engine resyncs."""
        fleet = self.fleet
        why_not = "the actor's group did not start" if fleet.trainers is None else self._can_keep(fault)
        if why_not is None:  # a node's loss may have taken an actor rank with the critic's
            try:
                if len(fleet.trainers.answering(ANSWER_SECS)) < fleet.trainers.world_size:
                    why_not = "an actor rank was lost too"
            except Exception as e:  # noqa: BLE001 - asking failed: nothing is kept
                why_not = f"asking the actor's ranks failed: {type(e).__name__}: {first_line(e)}"
        if why_not is not None:
            self.log.info(f"the actor's ranks start again too: {why_not}",
                          extra={"step": self.runner.state.step.global_step, "phase": self.phase})
            self._restart_train_group()
            return
        # the kept ranks' background HF export is published first: the validation below removes temporaries
        self._best_effort("finishing the policy's background export", self.checkpoints.collect_export,
                          fleet.trainers, True)
        kept = list(range(fleet.trainers.world_size))
        lost, why_not = self._kept(fault, alive, RoleName.CRITIC)
        if why_not is None:
            try:
                ckpt, secs, started = self._regroup(lost, RoleName.CRITIC)
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - whatever broke the critic's group, it starts again whole
                self.events.emit(Event.WARNING, message=f"keeping the critic's ranks that answered failed: "
                                                        f"{type(e).__name__}: {first_line(e)}; its every rank "
                                                        f"starts again")
            else:
                self._spares_taken(len(lost), RoleName.CRITIC)
                self._load(ckpt, secs, started, kept=kept, started_group=fleet.critics, critic_kept=sorted(alive))
                return
        with self.clock.part("teardown"):
            fleet.drop_critics()
            self.runner.drop_group(keep=True)
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="validate") as pool:
            validated = pool.submit(self._validate)
            fleet.critics = self._new_critic_group()
            ckpt, secs = validated.result()
        self._spares_taken(fleet.critics.world_size, RoleName.CRITIC)
        self._load(ckpt, secs, started, kept=kept, started_group=fleet.critics, critic_kept=[])

    def _regroup(self, lost: list[int], role: RoleName = RoleName.ACTOR) -> tuple[Checkpoint, float, float]:
        """A repair from disk that keeps the survivors' processes: only `role`'s `lost` ranks start again (from
        its warm spares, or cold in their bundles) and every rank of its group re-forms the group; returns the
        last valid checkpoint for all to load (`_load`), the seconds its validation took, and when the regroup
        began. Raises if the new group does not form, or if no checkpoint is valid any more (a survivor holds no
        initial weights)."""
        with self.clock.part("teardown"):
            self.runner.drop_group(keep=True)
        started = time.monotonic()
        self.fleet.group(role).regroup(lost, self.pools.get(role))
        ckpt, secs = self._validate()  # after: it cleans up interrupted saves, which the survivors have left now
        if ckpt is None:
            raise CheckpointError("no valid checkpoint is left to load")
        return ckpt, secs, started

    def _spares_taken(self, started: int, role: RoleName = RoleName.ACTOR) -> None:
        """The `spares` event of a (re)started group of `role`: of the `started` ranks, how many its pool gave."""
        spares = self.pools.get(role)
        if spares is not None:
            taken = self.fleet.group(role).from_spares
            self.events.emit(Event.SPARES, action="taken", taken=taken, cold=started - taken, pool=len(spares),
                             size=spares.size, **group_of(role))
            self.refill_due.add(role)

    def _load(self, ckpt: Checkpoint | None, validate_secs: float, started: float, kept: list[int] = (),
              started_group=None, critic_kept: list[int] | None = None) -> None:
        """Every rank of the new group loads `ckpt` (or starts fresh), the Supervisor rolls back to its step, and
        the engines are resynced to its weights. `kept`: the ranks that kept their processes (a regroup);
        `started_group`: the group whose start the repair waited for (the actor's by default); `critic_kept`:
        the critic's ranks that kept theirs (default: all, loading in place)."""
        r, fleet = self.runner, self.fleet
        started_group = started_group or fleet.trainers
        for part, part_secs in [*started_group.timings.items(), ("validate", validate_secs)]:
            self.clock.add(part, part_secs)
        with self.clock.part("load"):
            missing = fleet.trainers.load_recover(str(ckpt.path), ckpt.world_size) if ckpt is not None else []
            if fleet.critics is not None and ckpt is not None:
                missing += [f"the critic's {part}" for part in fleet.critics.load_recover(
                    str(ckpt.role_path(RoleName.CRITIC)), ckpt.role_world_size(RoleName.CRITIC))]
        r.roll_back(self._state_of(ckpt, warn=True))
        self.clock.loaded(r.state.step.global_step, Source.DISK)
        self.events.emit(Event.LOADED, global_step=r.state.step.global_step, path=str(ckpt.path) if ckpt else None,
                         source=Source.DISK.value, nodes=fleet.trainers.nodes, kept=list(kept), missing_state=missing,
                         secs=round(time.monotonic() - started, 3),
                         **({} if fleet.critics is None else {"critic_kept": list(
                             range(fleet.critics.world_size) if critic_kept is None else critic_kept),
                             "critic_nodes": fleet.critics.nodes}))
        if missing:
            self.events.emit(Event.WARNING,
                             message=f"the checkpoint lacks {', '.join(missing)}; that state starts fresh")
        self._resync()

    def _resync(self) -> None:
        """After the TrainGroup's repair: replace the engines found dead, and bring every engine to the trainer's
        weights (those that hold them already are not pushed to); the repair is over."""
        with self.clock.part("resync"):
            replaced = self.fleet.engines.replace(())
            if replaced:
                self.events.emit(Event.ENGINES_RESTARTED, replaced=replaced,
                                 from_spares=self.fleet.engines.from_spares)
            self.fleet.sync_engines(self.runner.weights_version, gate=True)
        self.clock.resumed()

    def _validate(self) -> tuple[Checkpoint | None, float]:
        t = time.monotonic()
        return self.checkpoints.load_last_valid(), time.monotonic() - t

    def _restart_engines(self, fault: Fault) -> None:
        """Replace the faulty engines (and any found dead), then resync; training state is not rolled back."""
        engines = self.fleet.engines
        with self.clock.part("teardown"):
            faulty = engines_to_replace(fault)
            self._make_room_for_engines(len(faulty))
            replaced = engines.replace(faulty)
            self.events.emit(Event.ENGINES_RESTARTED, replaced=replaced, from_spares=engines.from_spares)
        with self.clock.part("resync"):
            self.fleet.sync_engines(self.runner.weights_version, gate=True)  # a new engine starts in its sync
        self.clock.resumed()

    def _make_room_for_engines(self, n: int, keep: frozenset[str] = frozenset(),
                               reserve: dict[RoleName, int] | None = None) -> None:
        """Replacements of `n` engines must not wait behind warm spares: spares go until the cluster has room, but
        for a handoff's (`keep`: its adopters; `reserve`: role -> as many free spares of its pool as its ranks
        without one will take), and those holding ranks' memory copies (a rank lost with the engine's node
        recovers from one) only once no other spare of any pool is left."""
        n -= self.fleet.engines.live_spares()
        pools = [(role, pool, self.runner.memories.get(role)) for role, pool in self.pools.items()]
        failed, released = set(), {}  # a pool whose upkeep failed is left alone (tried again later)
        for holders_too in (False, True):
            for role, spares, memory in pools:
                freed = sum(released.values())  # by the kills before, which Ray may not show yet
                if role in failed or (holders_too and n <= freed):
                    continue
                holders = frozenset(memory.covering().values()) if memory is not None else frozenset()
                spared = keep if holders_too else keep | holders
                killed = self._best_effort("making room for the engines", lambda: spares.make_room(
                    n, spared, (reserve or {}).get(role, 0), last=holders, freed=freed))
                if killed is None:
                    failed.add(role)
                released[role] = released.get(role, 0) + (killed or 0)
        for role, spares, _ in pools:
            if released.get(role):
                self.events.emit(Event.SPARES, action="released", pool=len(spares), size=spares.size,
                                 **group_of(role))
                self.refill_due.add(role)

    def _new_train_group(self):
        """All of cluster.n_train_workers ranks or, when the cluster cannot offer them and
        recover.min_train_workers allows it, as many as fit (elastic resume)."""
        cfg = self.config
        sizes = train_group_sizes(cfg.cluster.n_train_workers, cfg.recover.min_train_workers,
                                  cfg.data.batch_size * cfg.data.group_size)
        for size in sizes:
            try:
                group = self.make_train_group(size)
            except CapacityError as e:
                if size == sizes[-1]:
                    raise
                self.events.emit(Event.WARNING, message=f"{e}; trying {size - 1} ranks or fewer")
                continue
            if size != cfg.cluster.n_train_workers:
                self.events.emit(Event.SHRINK, world_size=size, wanted=cfg.cluster.n_train_workers)
            return group

    def _new_critic_group(self):
        """The critic's group of critic.n_workers ranks (PPO), or None in a GRPO job. It does not shrink."""
        cfg = self.config
        return self.make_train_group(cfg.workers_of(RoleName.CRITIC), RoleName.CRITIC) if cfg.critic else None

    def _state_of(self, ckpt: Checkpoint | None, warn: bool = False) -> RunState:
        """The run's state at the checkpoint's step (or the start)."""
        steps_per_epoch = self.runner.loader.steps_per_epoch
        if ckpt is None:
            return RunState.fresh(self.config, steps_per_epoch)
        try:
            state, warnings = RunState.from_infos(ckpt.infos, self.config, steps_per_epoch)
        except IncompatibleCheckpoint as e:
            raise CheckpointError(f"{ckpt.path}: {e}; run `relaunch clean-restart CONFIG` to start fresh") from e
        for w in warnings if warn else ():
            self.events.emit(Event.WARNING, message=w)
            self.log.warning(f"warning: {w}", extra={"step": ckpt.global_step, "phase": self.phase})
        return state

    def _shutdown(self) -> None:
        self.fleet.shutdown()
        for spares in self.pools.values():
            try:
                spares.shutdown()
            except Exception:  # noqa: BLE001 - best effort at the end of the run
                pass


def _shut_down(start: Future) -> None:
    """End the group a start in the background gave, once it is done, whatever became of it."""
    try:
        group = start.result()
        if group is not None:
            group.shutdown()
    except Exception:  # noqa: BLE001 - the start's own error, or a failed shutdown: the actor's error is reported
        pass


def _until(deadline: float | None) -> str:
    return "none" if deadline is None else f"in {max(deadline - time.time(), 0):.0f}s"
