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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable, Optional

from supervisor.checkpoint.store import Checkpoint, CheckpointError
from supervisor.cluster.errors import CapacityError, Group
from supervisor.control.classify import Fault, FaultKind, classify
from supervisor.control.coordinator import CheckpointCoordinator
from supervisor.control.events import EventLog, StatsLog
from supervisor.control.policy import Action, Decision, RestartPolicy, train_group_sizes
from supervisor.control.run_state import IncompatibleCheckpoint, RunState
from supervisor.control.step import Phase, StepRunner

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


class State(str, enum.Enum):
    STARTING = "starting"    # load the last valid checkpoint, start both groups, resync the engines
    RUNNING = "running"      # one step (or what the last committed step still owes) per transition
    REPAIRING = "repairing"  # apply a repair decision: restart the TrainGroup, the engines, or skip a save
    FINISHED = "finished"
    FAILED = "failed"


class Outcome(str, enum.Enum):
    OK = "ok"
    DONE = "done"      # every step trained and settled
    FAULT = "fault"    # a repairable fault; the decision says how
    FATAL = "fatal"    # stop: the decision (or a bad checkpoint, missing capacity) says why


@dataclass(frozen=True)
class Result:
    outcome: Outcome
    decision: Optional[Decision] = None
    fault: Optional[Fault] = None
    exit_code: int = EXIT_OK
    message: str = ""
    details: str = ""


def transition(state: State, result: Result) -> State:
    """The next state. Pure: the whole state machine is this function."""
    if result.outcome is Outcome.FATAL:
        return State.FAILED
    if result.outcome is Outcome.FAULT:
        return State.REPAIRING
    if result.outcome is Outcome.DONE:
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
    def __init__(self, config, runner: StepRunner, checkpoints: CheckpointCoordinator, policy: RestartPolicy,
                 events: EventLog, stats: StatsLog, make_train_group: Callable, make_rollout_group: Callable,
                 sleep: Callable[[float], None] = time.sleep, supervisor_restarted: bool = False, spares=None):
        self.config, self.runner, self.checkpoints, self.policy = config, runner, checkpoints, policy
        self.events, self.stats, self.sleep = events, stats, sleep
        self.make_train_group, self.make_rollout_group = make_train_group, make_rollout_group
        self.supervisor_restarted = supervisor_restarted
        self.state = State.STARTING
        self.pending: Result | None = None  # the decision REPAIRING applies
        self.recovery: dict | None = None   # where the time of the repair in progress went, in seconds
        self.spares = spares                # the warm spare pool (supervisor/cluster/spares.py), or None
        self.refill_due = False             # refill the pool once the new TrainGroup has completed a step

    # ---- the loop -------------------------------------------------------------------------------------
    def run(self) -> JobResult:
        try:
            while self.state not in (State.FINISHED, State.FAILED):
                result = self._work()
                self._enter(transition(self.state, result), result)
        finally:
            self._shutdown()
        r = self.pending
        if self.state is State.FINISHED:
            self.events.emit("done", global_step=self.runner.state.step.global_step, reward=self.runner.last_reward,
                             message=r.message if r else "")
            return JobResult(EXIT_OK, r.message if r and r.message else f"finished {self.runner.total_steps} steps",
                             self.runner.state.step.global_step, self.runner.last_reward)
        kind = "failed" if r.fault is None or r.fault.kind in (FaultKind.USER_ERROR, FaultKind.INTERNAL_ERROR) \
            else "gave_up"
        self.events.emit(kind, reason=r.message)
        return JobResult(r.exit_code, r.message, self.runner.state.step.global_step, details=r.details)

    def _enter(self, new: State, result: Result) -> None:
        """The one place a transition is applied and logged."""
        if new is not self.state:
            self.events.emit("state", previous=self.state.value, state=new.value,
                             global_step=self.runner.state.step.global_step)
        self.state = new
        self.pending = result if new in (State.REPAIRING, State.FAILED, State.FINISHED) else None

    def _work(self) -> Result:
        """The current state's work; every error it raises becomes a classified, decided fault."""
        try:
            if self.state is State.STARTING:
                return self._start()
            if self.state is State.RUNNING:
                if not self.runner.finished:
                    self.runner.advance()
                    self._recovered()
                    self._refill_spares()
                return Result(Outcome.DONE if self.runner.finished else Outcome.OK)
            return self._repair(self.pending)
        except CheckpointError as e:  # every checkpoint damaged, or one that cannot fit this run
            return Result(Outcome.FATAL, exit_code=EXIT_BAD_INPUT, message=str(e))
        except CapacityError as e:
            return Result(Outcome.FATAL, exit_code=EXIT_FAILED, message=str(e))
        except Exception as e:  # noqa: BLE001 - classified below: only a bug in relaunch is an internal error
            return self._on_fault(classify(e), e)

    # ---- faults ---------------------------------------------------------------------------------------
    def _on_fault(self, fault: Fault, error: BaseException | None = None) -> Result:
        saving = self.state is State.RUNNING and self.runner.phase in (Phase.EXPORT, Phase.SAVE)
        fault = replace(fault, in_save=saving)
        step = self.runner.state.step.global_step + (0 if self.runner.owed else 1)
        failed = self.runner.failed_background()
        if failed is not None:  # the background save or export of an earlier step failed
            step = failed[1]
        self.events.emit("failure", cause=fault.kind.value, message=fault.message, group=fault.group.value,
                         actor=fault.actor, actors=list(fault.actors), node=fault.node,
                         detect_secs=fault.detect_secs, global_step=step, phase=self.phase)
        decision = self.policy.decide(fault, now=time.time())
        where = f" on node {fault.node[:8]}" if fault.node else ""
        print(f"[relaunch] step {step} ({self.phase}): {fault.kind.value}: {fault.message}{where} -> "
              f"{decision.reason}", flush=True)
        if fault.kind is FaultKind.STORAGE_ERROR and saving:
            # every rank came back from the failed save (else the TrainGroup restart cleans up after its kill)
            live = self.runner.background_in_flight()
            removed = self.checkpoints.discard_failed_save(in_flight=live) if fault.settled else []
            self.events.emit("save_failed", global_step=step, error=fault.message,
                             what=failed[0] if failed else self.runner.phase.value,
                             action=self.config.recover.on_save_error.value, removed=[str(p) for p in removed])
        if decision.action is Action.FAIL:
            details = ""
            if error is not None and fault.kind in (FaultKind.USER_ERROR, FaultKind.INTERNAL_ERROR):
                details = "".join(traceback.format_exception(error.__cause__ or error))
            return Result(Outcome.FATAL, decision, fault, EXIT_FAILED, decision.reason, details)
        if decision.action is not Action.SKIP_SAVE:
            if self.recovery is None:  # a fault during a repair adds to the repair in progress
                self.recovery = {"cause": fault.kind.value, "what": decision.action.value, "seen": time.time(),
                                 "detection": fault.detect_secs or 0.0}
            self.events.emit("restart", n=self.policy.restarts, limit=self.policy.retries, what=decision.action.value,
                             cause=fault.kind.value, delay_secs=decision.delay_secs)
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
            self._roll_back_to(ckpt)
            msg = f"already complete at global step {ckpt.global_step}; nothing to train"
            return Result(Outcome.DONE, message=msg)
        if self.supervisor_restarted:
            self.supervisor_restarted = False
            if ckpt is not None:  # so the failure is reported at the step it interrupted; stats stay until decided
                self.runner.state = self._state_of(ckpt)
            return self._on_fault(Fault(FaultKind.SUPERVISOR_DIED, "the Supervisor actor died and was restarted "
                                        "by Ray; rebuilding from disk", Group.SUPERVISOR, ("Supervisor",)))
        self._restart_train_group()
        return Result(Outcome.OK)

    def _recovered(self) -> None:
        """After the first step that completes after a repair: log where the repair's time went."""
        if self.recovery is None:
            return
        rec, self.recovery = self.recovery, None
        seen, resynced = rec.pop("seen"), rec.pop("resynced", None)
        parts = {k: round(v, 3) for k, v in rec.items() if isinstance(v, float)}
        parts["total"] = round(time.time() - seen + rec["detection"], 3)
        parts["first_step"] = round(time.time() - (resynced or seen), 3)
        self.events.emit("recovery", cause=rec["cause"], what=rec["what"], **parts)

    def _refill_spares(self) -> None:
        """After the first step of a new TrainGroup: start spares up to the pool's size, away from its ranks.
        Not earlier, so that warming them never competes with the restart for the CPUs; tried again after
        every step while the cluster has no room for them."""
        if not self.refill_due or self.spares is None or self.runner.finished:
            return
        if len(self.spares) < self.spares.size:
            nodes = self.spares.refill(self.runner.trainers.nodes)
            if nodes:
                self.events.emit("spares", action="refilled", started=len(nodes), nodes=nodes,
                                 pool=len(self.spares), size=self.spares.size)
        self.refill_due = len(self.spares) < self.spares.size

    def _time(self, part: str, since: float) -> float:
        """Add the seconds since `since` to the recovery breakdown's `part`; returns now."""
        now = time.monotonic()
        if self.recovery is not None:
            self.recovery[part] = self.recovery.get(part, 0.0) + now - since
        return now

    def _repair(self, pending: Result) -> Result:
        decision, fault = pending.decision, pending.fault
        if decision.delay_secs:
            t = time.monotonic()
            self.sleep(decision.delay_secs)
            self._time("backoff", t)
        if decision.action is Action.RESTART_TRAIN_GROUP:
            self._restart_train_group()
        elif decision.action is Action.RESTART_ENGINES:
            self._restart_engines(fault)
        elif decision.action is Action.SKIP_SAVE and self.runner.skip_failed_save() is None:
            return Result(Outcome.FATAL, decision, fault, EXIT_FAILED, f"{fault.message} (not in a save)")
        # REPLAY_STEP: nothing advanced before the commit; the next transition runs the step again
        return Result(Outcome.OK)

    def _restart_train_group(self) -> None:
        """Kill every rank, start a new group that loads the last valid checkpoint, roll the Supervisor back to
        its step, replace dead engines, and resync every engine to the checkpoint's weights."""
        r, t = self.runner, time.monotonic()
        if r.trainers is not None:
            r.trainers.shutdown()  # survivors may be stuck in a collective, or still writing a save
            r.trainers = None
        r.owed, r.digest = None, None  # the new group's weights are the checkpoint's
        r.close_stream()
        r.in_flight, r.exporting, r.failed = None, None, None  # background writes die unpublished with the ranks
        t = self._time("teardown", t)
        if r.engines is None:
            r.engines = self.make_rollout_group()  # starts while the TrainGroup does
        started = t
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="validate") as pool:
            # the checkpoint is validated (hashed, unless this Supervisor committed it) while the new group
            # starts; it cleans up interrupted saves, which is safe: no rank of either group writes now
            validated = pool.submit(self._validate)
            r.trainers = self._new_train_group()
            ckpt, secs = validated.result()
        if self.spares is not None:
            taken = r.trainers.from_spares
            self.events.emit("spares", action="taken", taken=taken, cold=len(r.trainers.nodes) - taken,
                             pool=len(self.spares), size=self.spares.size)
            self.refill_due = True
        for part, secs in [*r.trainers.timings.items(), ("validate", secs)]:
            if self.recovery is not None:
                self.recovery[part] = self.recovery.get(part, 0.0) + secs
        t = time.monotonic()
        missing = r.trainers.load_recover(str(ckpt.path), ckpt.world_size) if ckpt is not None else []
        t = self._time("load", t)
        self._roll_back_to(ckpt)
        self.events.emit("loaded", global_step=r.state.step.global_step, path=str(ckpt.path) if ckpt else None,
                         nodes=r.trainers.nodes, missing_state=missing, secs=round(time.monotonic() - started, 3))
        if missing:
            self.events.emit("warning", message=f"the checkpoint lacks {', '.join(missing)}; that state starts fresh")
        replaced = r.engines.replace(())
        if replaced:
            self.events.emit("engines_restarted", replaced=replaced)
        r.phase = None
        r.sync_engines(gate=True)
        self._time("resync", t)
        if self.recovery is not None:
            self.recovery["resynced"] = time.time()

    def _validate(self) -> tuple[Checkpoint | None, float]:
        t = time.monotonic()
        return self.checkpoints.load_last_valid(), time.monotonic() - t

    def _restart_engines(self, fault: Fault) -> None:
        """Replace the faulty engines (and any found dead), then resync; training state is not rolled back."""
        r, t = self.runner, time.monotonic()
        faulty = fault.actors if fault.kind in (FaultKind.ENGINE_DIED, FaultKind.HANG) else ()
        if self.spares is not None and self.spares.make_room(len(faulty)):
            self.events.emit("spares", action="released", pool=len(self.spares), size=self.spares.size)
            self.refill_due = True
        replaced = r.engines.replace(faulty)
        self.events.emit("engines_restarted", replaced=replaced)
        t = self._time("teardown", t)
        r.sync_engines(gate=True)  # a new engine starts in its sync
        self._time("resync", t)
        if self.recovery is not None:
            self.recovery["resynced"] = time.time()

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
                self.events.emit("warning", message=f"{e}; trying {size - 1} ranks or fewer")
                continue
            if size != cfg.cluster.n_train_workers:
                self.events.emit("shrink", world_size=size, wanted=cfg.cluster.n_train_workers)
            return group

    def _roll_back_to(self, ckpt: Checkpoint | None) -> None:
        """The Supervisor's own state (step, frequency controls) back to the checkpoint's step, or the start."""
        r = self.runner
        r.state = self._state_of(ckpt, warn=True)
        r.owed = None
        self.stats.truncate_after(r.state.step.global_step)

    def _state_of(self, ckpt: Checkpoint | None, warn: bool = False) -> RunState:
        steps_per_epoch = self.runner.loader.steps_per_epoch
        if ckpt is None:
            return RunState.fresh(self.config, steps_per_epoch)
        try:
            state, warnings = RunState.from_infos(ckpt.infos, self.config, steps_per_epoch)
        except IncompatibleCheckpoint as e:
            raise CheckpointError(f"{ckpt.path}: {e}; run `relaunch clean-restart CONFIG` to start fresh") from e
        for w in warnings if warn else ():
            self.events.emit("warning", message=w)
            print(f"[relaunch] warning: {w}", flush=True)
        return state

    def _shutdown(self) -> None:
        for group in (self.runner.trainers, self.runner.engines, self.spares):
            if group is not None:
                try:
                    group.shutdown()
                except Exception:  # noqa: BLE001 - best effort at the end of the run
                    pass
        self.runner.trainers = self.runner.engines = None
