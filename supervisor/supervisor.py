"""The Supervisor actor: the single controller of a run and the only writer of its recovery state.

It drives every step (batch -> rollouts -> rewards -> advantages -> update -> weight push -> saves ->
stats), turns worker failures into faults, asks the restart policy what to do, and applies the answer:
restart the whole TrainGroup from the last valid checkpoint (rolling its own state back to the same
step), or only the dead inference engines. No rollout runs until every engine has passed the resync gate.
"""
from __future__ import annotations

import enum
import os
import shutil
import signal
import time
import traceback
from dataclasses import dataclass, field

import ray
import torch
from ray.exceptions import RayTaskError

from supervisor import faults
from supervisor.events import EventLog, StatsLog, read_jsonl
from supervisor.config import SaveErrorAction
from supervisor.groups import CapacityError, RolloutGroup, TrainGroup, WorkerFault
from supervisor.layout import TMP_PREFIX, TrialLayout
from supervisor.policy import Action, Fault, FaultKind, RestartPolicy, train_group_sizes
from supervisor.recovery import (
    REFERENCE_PREFIX, RUN_CONFIG, Checkpoint, CheckpointError, RecoverStore, compatibility_error,
)
from supervisor.run_state import IncompatibleCheckpoint, RunState
from supervisor.step_info import StepInfo
from supervisor.durable import file_digest, publish_dir, tmp_name
from workers.data import PromptLoader, read_prompts
from workers.engines.reference import reference_file, reference_step
from workers.grpo import group_advantages
from workers.rewards import UserCodeError, load_reward_fn, score

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


class StorageError(RuntimeError):
    """A save failed on storage and recover.on_save_error is `stop`."""


class Phase(str, enum.Enum):
    STARTING = "starting"
    ROLLOUT = "rollout"
    TRAIN = "train"
    SYNC = "sync"
    SAVING = "saving"
    RESTARTING = "restarting"
    RESYNCING = "resyncing"
    FINISHED = "finished"
    FAILED = "failed"


@dataclass
class Weights:
    ref: ray.ObjectRef
    version: int
    checksum: str


@dataclass
class JobResult:
    exit_code: int
    message: str
    global_step: int = -1
    reward: float | None = None
    details: str = ""
    extra: dict = field(default_factory=dict)


@ray.remote(num_cpus=0, max_concurrency=4)
class Supervisor:
    def __init__(self, config, job_id: str):
        self.config, self.job_id = config, job_id
        self.layout = TrialLayout.from_config(config)
        prior = [e for e in read_jsonl(self.layout.events_log) if e.get("job") == job_id]
        self.attempt = sum(e["event"] == "start" for e in prior)
        self.events = EventLog(self.layout.events_log, attempt=self.attempt)
        self.stats = StatsLog(self.layout.stats_log)
        self.recover_on = config.recover.mode.enabled
        self.store = RecoverStore(self.layout, config.recover.keep_last) if self.recover_on else None
        self.policy = RestartPolicy.from_config(config)
        self.policy.restarts = sum(e["event"] == "restart" for e in prior)
        self.loader = PromptLoader(read_prompts(config.data.path), config.data.batch_size, config.seed,
                                   config.data.shuffle)
        self.total_steps = self.loader.steps_per_epoch * config.total_train_epochs
        self.timeout = config.recover.step_timeout_secs
        self.phase = Phase.STARTING
        self.state = RunState.fresh(config, self.loader.steps_per_epoch)
        self.train_group: TrainGroup | None = None
        self.rollout_group: RolloutGroup | None = None
        self.weights: Weights | None = None
        self.last_reward: float | None = None

    # ---- queries (served concurrently with run) -------------------------------------------------
    def progress(self) -> dict:
        return {
            "phase": self.phase.value, "global_step": self.state.step.global_step, "total_steps": self.total_steps,
            "reward": self.last_reward, "restarts": self.policy.restarts, "attempt": self.attempt,
            "weights_version": self.weights.version if self.weights else None,
            "train_nodes": self.train_group.nodes if self.train_group else [],
            "rollout_nodes": self.rollout_group.nodes if self.rollout_group else [],
        }

    # ---- the run --------------------------------------------------------------------------------
    def run(self) -> dict:
        try:
            result = self._run()
        except Exception as e:  # noqa: BLE001 - a bug in relaunch itself: report it, never hang the driver
            result = JobResult(EXIT_FAILED, f"relaunch internal error: {type(e).__name__}: {e}",
                               details=traceback.format_exc())
            self.events.emit("failed", job=self.job_id, reason=result.message)
        finally:
            self._shutdown()
        self.phase = Phase.FINISHED if result.exit_code == EXIT_OK else Phase.FAILED
        return result.__dict__

    def _run(self) -> JobResult:
        self.events.emit("start", job=self.job_id, experiment=self.config.experiment_name,
                         trial=self.config.trial_name, total_steps=self.total_steps,
                         n_train_workers=self.config.cluster.n_train_workers,
                         n_rollout_workers=self.config.cluster.n_rollout_workers)
        try:
            checkpoint = self._load_checkpoint()
            if self.attempt > 0:
                self._restore(checkpoint)  # so the failure is reported at the step it interrupted
                self._on_fault(Fault(FaultKind.WORKER_DIED, "the Supervisor actor died and was restarted by Ray",
                                     actor="Supervisor"), count_only=True)
        except CheckpointError as e:
            self.events.emit("failed", job=self.job_id, reason=str(e))
            return JobResult(EXIT_BAD_INPUT, str(e))
        if checkpoint is not None and checkpoint.global_step + 1 >= self.total_steps:
            self._restore(checkpoint)
            msg = f"already complete at global step {checkpoint.global_step}; nothing to train"
            self.events.emit("done", job=self.job_id, global_step=checkpoint.global_step, message=msg)
            return JobResult(EXIT_OK, msg, checkpoint.global_step)
        try:
            reward_fn = load_reward_fn(self.config.reward.fn)
        except UserCodeError as e:
            return JobResult(EXIT_BAD_INPUT, str(e))
        return self._train_with_restarts(reward_fn)

    def _train_with_restarts(self, reward_fn) -> JobResult:
        """Train to the last step; every fault goes to the policy, whose decision is applied here."""
        action = Action.RESTART_TRAIN_GROUP  # the first start is a (re)start from the last checkpoint
        while True:
            details = ""
            try:
                if self.rollout_group is None:
                    self.rollout_group = RolloutGroup(self.config, self.timeout)
                if action is Action.RESTART_TRAIN_GROUP:
                    self._start_train_group()
                elif action is Action.RESTART_ENGINES:
                    self._restart_engines()
                while self.state.step.global_step + 1 < self.total_steps:
                    self._step(self.state.step.next(), reward_fn)
                break
            except WorkerFault as e:
                fault = e.fault
            except UserCodeError as e:
                fault = Fault(FaultKind.USER_ERROR, str(e))
                details = "".join(traceback.format_exception(e.__cause__ or e))
            except CheckpointError as e:  # every checkpoint damaged, or one that cannot fit this run
                self.events.emit("failed", job=self.job_id, reason=str(e))
                return JobResult(EXIT_BAD_INPUT, str(e), self.state.step.global_step)
            except (CapacityError, StorageError) as e:
                self.events.emit("gave_up", job=self.job_id, reason=str(e))
                return JobResult(EXIT_FAILED, str(e), self.state.step.global_step)
            decision = self._on_fault(fault)
            if decision.action is Action.FAIL:
                kind = "failed" if fault.kind is FaultKind.USER_ERROR else "gave_up"
                self.events.emit(kind, job=self.job_id, reason=decision.reason)
                return JobResult(EXIT_FAILED, decision.reason, self.state.step.global_step, details=details)
            time.sleep(decision.delay_secs)
            action = decision.action
        if self.recover_on and self.store.committed_step() != self.state.step.global_step:
            self._save_recover_or_report(self.state.step)
        self.events.emit("done", job=self.job_id, global_step=self.state.step.global_step, reward=self.last_reward)
        return JobResult(EXIT_OK, f"finished {self.total_steps} steps", self.state.step.global_step, self.last_reward)

    def _on_fault(self, fault: Fault, count_only: bool = False):
        self.events.emit("failure", job=self.job_id, cause=fault.kind.value, message=fault.message,
                         actor=fault.actor, node=fault.node, detect_secs=fault.detect_secs,
                         global_step=self.state.step.global_step + 1)
        if count_only:
            self.policy.restarts += 1
            self.events.emit("restart", job=self.job_id, n=self.policy.restarts, limit=self.policy.retries,
                             what="supervisor")
            return None
        decision = self.policy.decide(fault)
        print(f"[relaunch] {fault.kind.value}: {fault.message} -> {decision.reason}", flush=True)
        if decision.action is not Action.FAIL:
            self.phase = Phase.RESTARTING
            self.events.emit("restart", job=self.job_id, n=self.policy.restarts, limit=self.policy.retries,
                             what=decision.action.value, delay_secs=decision.delay_secs)
        return decision

    # ---- recovery -------------------------------------------------------------------------------
    def _load_checkpoint(self) -> Checkpoint | None:
        """The last valid checkpoint (falling back past damaged ones), after cleaning up interrupted saves."""
        if not self.recover_on:
            return None
        self.store.wait_for_pruning()
        result = self.store.load_latest()
        for reason in result.fallbacks:
            self.events.emit("fallback", job=self.job_id, reason=reason)
        ckpt = result.checkpoint
        if ckpt is not None:
            problem = compatibility_error(ckpt.manifest, self.config.actor.backend.value,
                                          self.config.cluster.n_train_workers)
            if problem:
                raise CheckpointError(f"{ckpt.path}: {problem}")
        removed = self.store.remove_leftovers(ckpt.global_step if ckpt else None)
        if removed:
            self.events.emit("cleanup", job=self.job_id, removed=[str(p) for p in removed])
        if ckpt is not None:
            self.store.restore_mirror(ckpt)
            if ckpt.manifest.get("config_hash") != self.config.resume_hash():
                self.events.emit("warning", job=self.job_id,
                                 message="the config that matters for resume changed since this checkpoint")
        return ckpt

    def _restore(self, ckpt: Checkpoint | None) -> None:
        """Roll the Supervisor's own state back to the checkpoint's step (or to the start)."""
        if ckpt is None:
            self.state = RunState.fresh(self.config, self.loader.steps_per_epoch)
        else:
            try:
                self.state, warnings = RunState.from_infos(ckpt.infos, self.config, self.loader.steps_per_epoch)
            except IncompatibleCheckpoint as e:
                raise CheckpointError(f"{ckpt.path}: {e}; run `relaunch clean-restart CONFIG` to start fresh") from e
            for w in warnings:
                self.events.emit("warning", job=self.job_id, message=w)
                print(f"[relaunch] warning: {w}", flush=True)
        self.stats.truncate_after(self.state.step.global_step)

    def _start_train_group(self) -> None:
        self.phase = Phase.RESTARTING
        if self.train_group is not None:
            self.train_group.shutdown()  # survivors may be stuck in a collective with the dead rank
            self.train_group = None
        ckpt = self._load_checkpoint()
        started = time.monotonic()
        self.train_group = self._new_train_group()
        missing = []
        if ckpt is not None:
            missing = self.train_group.load_recover(str(ckpt.path), ckpt.world_size)
        self._restore(ckpt)
        self.events.emit("loaded", job=self.job_id, global_step=self.state.step.global_step,
                         path=str(ckpt.path) if ckpt else None, nodes=self.train_group.nodes,
                         missing_state=missing, secs=round(time.monotonic() - started, 3))
        if missing:
            self.events.emit("warning", job=self.job_id, message=f"the checkpoint lacks {', '.join(missing)}; "
                                                                  f"that state starts fresh")
        self._sync_weights(pull=True)

    def _new_train_group(self) -> TrainGroup:
        """All of cluster.n_train_workers ranks or, when the cluster cannot offer them and
        recover.min_train_workers allows it, as many as fit (elastic resume)."""
        cfg = self.config
        sizes = train_group_sizes(cfg.cluster.n_train_workers, cfg.recover.min_train_workers,
                                  cfg.data.batch_size * cfg.data.group_size)
        for size in sizes:
            try:
                group = TrainGroup(cfg, size, self.timeout)
            except CapacityError as e:
                if size == sizes[-1]:
                    raise
                self.events.emit("warning", job=self.job_id, message=f"{e}; trying {size - 1} ranks or fewer")
                continue
            if size != cfg.cluster.n_train_workers:
                self.events.emit("shrink", job=self.job_id, world_size=size, wanted=cfg.cluster.n_train_workers)
            return group

    def _restart_engines(self) -> None:
        self.phase = Phase.RESTARTING
        replaced = self.rollout_group.restart_dead()
        self.events.emit("engines_restarted", job=self.job_id, replaced=replaced)
        self._sync_weights(pull=False)

    def _sync_weights(self, pull: bool) -> None:
        """Push the trainer's weights to every engine, then the resync gate: versions and checksums agree."""
        self.phase = Phase.RESYNCING
        if pull or self.weights is None:
            ref, checksum = self.train_group.weights()
            self.weights = Weights(ref, self.state.step.global_step + 1, checksum)
        for _ in range(2):
            self.rollout_group.push(self.weights.ref, self.weights.version)
            status = self.rollout_group.weight_status()
            if all(s == (self.weights.version, self.weights.checksum) for s in status):
                self.events.emit("resync", job=self.job_id, version=self.weights.version,
                                 checksum=self.weights.checksum, engines=len(status))
                return
        raise WorkerFault(Fault(FaultKind.ENGINE_DIED, f"engines disagree with the trainer after resync: {status} "
                                                      f"!= {(self.weights.version, self.weights.checksum)}"))

    # ---- one step -------------------------------------------------------------------------------
    def _step(self, s: StepInfo, reward_fn) -> None:
        cfg, t0 = self.config, time.monotonic()
        self._fault_point("supervisor_step", s)
        self.phase = Phase.ROLLOUT
        rows = [r for r in self.loader.batch(s.epoch, s.epoch_step) for _ in range(cfg.data.group_size)]
        rollout = self.rollout_group.generate([r["prompt"] for r in rows], s.global_step)
        rewards = torch.tensor(score(reward_fn, rows, rollout["completions"]))
        advantages = group_advantages(rewards, cfg.data.group_size)
        self._fault_point("after_rollout", s)
        t_rollout = time.monotonic()
        self.phase = Phase.TRAIN
        n = self.train_group.world_size
        keys = ("input_ids", "attention_mask", "response_mask")
        shards = [dict({k: rollout[k].chunk(n)[r] for k in keys}, advantages=advantages.chunk(n)[r])
                  for r in range(n)]
        metrics = self.train_group.train(shards, s.global_step)[0]
        t_train = time.monotonic()
        self.phase = Phase.SYNC
        ref, checksum = self.train_group.weights()
        self.weights = Weights(ref, s.global_step + 1, checksum)
        self.rollout_group.push(ref, self.weights.version)
        self.state.step = s
        self.last_reward = float(rewards.mean())
        row = {"global_step": s.global_step, "epoch": s.epoch, "epoch_step": s.epoch_step,
               "reward": self.last_reward, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
               "lr": metrics["lr"], "weights_version": self.weights.version,
               "time/rollout": t_rollout - t0, "time/train": t_train - t_rollout}
        if "kl" in metrics:  # with actor.kl_coef: GRPO's KL to the reference policy (rank 0's shard)
            row["kl"] = metrics["kl"]
        self.phase = Phase.SAVING
        elapsed = time.monotonic() - t0
        t_save = time.monotonic()
        if self.state.saver.check(s.is_epoch_end, elapsed):
            self._export_hf(s)
        if self.state.evaluator.check(s.is_epoch_end, elapsed):
            row["eval/reward"] = self._evaluate(s, reward_fn)
        row["time/saving"] = time.monotonic() - t_save
        if self.recover_on and self.state.recover.check(s.is_epoch_end, elapsed):
            self._save_recover_or_report(s, row, t0)  # the row, with the save's figures, once shards are written
            self._fault_point("after_save", s)
        else:
            self._append_row(row, t0)

    def _append_row(self, row: dict, t0: float) -> None:
        row["time/step"] = time.monotonic() - t0
        self.stats.append(row)

    def _fault_point(self, point: str, s: StepInfo) -> None:
        """Test instrumentation: besides the usual actions, `kill_trainer` SIGKILLs the last rank."""
        action = faults.armed(point, step=s.global_step)
        if action == "kill_trainer":
            os.kill(self.train_group.members[-1].pid, signal.SIGKILL)
        else:
            faults.apply(action, point)

    def _evaluate(self, s: StepInfo, reward_fn) -> float:
        """Greedy reward over every prompt of the dataset."""
        rows = self.loader.rows
        out = self.rollout_group.generate([r["prompt"] for r in rows], s.global_step, greedy=True)
        return float(torch.tensor(score(reward_fn, rows, out["completions"])).mean())

    def _export_hf(self, s: StepInfo) -> None:
        """A HuggingFace directory for this step, appearing complete or not at all."""
        final = self.layout.export_dir(s.epoch, s.epoch_step, s.global_step)
        if final.exists():
            return  # the same step trained again after a rollback: identical weights, already exported
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = tmp_name(final)
        self.train_group.export_hf(str(tmp), s.global_step)
        publish_dir(tmp, final)
        self.events.emit("export", job=self.job_id, global_step=s.global_step, path=str(final))
        keep = self.config.saver.keep_last
        if keep:
            exports = sorted((p for p in final.parent.iterdir()
                              if p.is_dir() and p.name.startswith("epoch") and not p.name.startswith(TMP_PREFIX)),
                             key=lambda p: int(p.name.rsplit("globalstep", 1)[1]))
            for old in exports[:-keep]:
                shutil.rmtree(old, ignore_errors=True)

    def _save_recover_or_report(self, s: StepInfo, row: dict | None = None, t0: float = 0.0) -> None:
        """A storage fault (disk full, permissions) never touches the last valid checkpoint: report it, then
        skip this save or stop, as recover.on_save_error says."""
        try:
            self._save_recover(s, row, t0)
        except (OSError, RayTaskError) as e:
            cause = e.cause if isinstance(e, RayTaskError) else e
            if not isinstance(cause, OSError):
                raise
            if row is not None and "time/step" not in row:
                self._append_row(row, t0)
            self.store.remove_leftovers(self.store.committed_step())
            action = self.config.recover.on_save_error
            self.events.emit("save_failed", job=self.job_id, global_step=s.global_step, error=str(cause),
                             action=action.value)
            print(f"[relaunch] recover checkpoint of step {s.global_step} failed: {cause} ({action.value})", flush=True)
            if action is SaveErrorAction.STOP:
                raise StorageError(f"recover checkpoint of step {s.global_step} failed: {cause}") from e

    def _save_recover(self, s: StepInfo, row: dict | None = None, t0: float = 0.0) -> None:
        """Ranks write their shards, then (with `row`) the step's stats row gets the save's time, bytes and
        bandwidth and is appended, then the commit. A crash before the commit replays the step and cuts
        the row back; the row is always in stats.jsonl before its step can be the last valid one."""
        started = time.monotonic()
        staging = self.store.staging_dir(s.global_step)
        nxt = s.next()
        loader_state = self.loader.state_dict(nxt.epoch, nxt.epoch_step)
        files = self.train_group.save_recover(str(staging), s.global_step,
                                              {"dataloader": loader_state, "global_step": s.global_step})
        actor = self.config.actor
        ref_step = reference_step(s.global_step, actor.ref_update_steps) if actor.kl_coef else None
        if ref_step is not None:
            ref = reference_file(staging.parent, ref_step)
            files[REFERENCE_PREFIX + ref.name] = {"size": ref.stat().st_size, "sha256": file_digest(ref)}
        (staging / RUN_CONFIG).write_text(self.config.model_dump_json(indent=1))
        files[RUN_CONFIG] = {"size": (staging / RUN_CONFIG).stat().st_size, "sha256": file_digest(staging / RUN_CONFIG)}
        # bytes this save wrote: a reference file written on an earlier step is only named, not rewritten
        nbytes = sum(f["size"] for name, f in files.items()
                     if not name.startswith(REFERENCE_PREFIX) or ref_step == s.global_step)
        if row is not None:
            secs = time.monotonic() - started
            row.update({"time/saving": row["time/saving"] + secs, "ckpt/bytes": nbytes,
                        "ckpt/MBps": round(nbytes / max(secs, 1e-9) / 1e6, 3)})
            self._append_row(row, t0)
        infos = self.state.to_infos(loader_state)
        path = self.store.commit(staging, s.global_step, self.train_group.world_size,
                                 self.config.resume_hash(), files, infos, engine=actor.backend.value)
        secs = time.monotonic() - started
        self.events.emit("commit", job=self.job_id, global_step=s.global_step, path=str(path),
                         world_size=self.train_group.world_size, weights_checksum=self.weights.checksum,
                         bytes=nbytes, secs=round(secs, 3), mbps=round(nbytes / max(secs, 1e-9) / 1e6, 3))

    def _shutdown(self) -> None:
        for group in (self.train_group, self.rollout_group):
            if group is not None:
                try:
                    group.shutdown()
                except Exception:  # noqa: BLE001 - best effort at the end of the run
                    pass
        self.train_group = self.rollout_group = None
