"""One step as a transaction, whose one commit point is the TrainGroup's optimizer step.

Before the commit (rollouts, rewards, the update itself) nothing of the Supervisor's state changes, so a
fault there replays the step from its start. At the commit the step's frequency controls are checked once
and what the step still owes is written down (`Owed`): the weight sync to the engines (version G + 1),
the HF export, the evaluation, the stats row and the recover save. A fault after the commit never replays
the update: once the faulty group is repaired, `settle` pays what is still owed, each item exactly once.
A fault that restarts the TrainGroup rolls back to the last valid checkpoint instead, which drops `owed`.

A recover save written in the background (`recover.write_mode`) is paid when its state is staged; it is
committed, with the recover_info captured at its step, at the first step boundary after every rank's part
is durable (and after its step's export, also written in the background, is published). One of each is in
flight at a time; a fault that restarts the TrainGroup drops them unpublished, so the run falls back to the
previous committed step.

With the memory tier (recover.memory), every rank also copies its state after the commit into its own memory
and its buddy's (supervisor/cluster/memory_copies.py), and the Supervisor keeps its own state of the newest
steps (`snapshots`): a repair from memory rolls back to one of them (`restore`), keeping what that step still
owed, so that no step that completed is trained again.
"""
from __future__ import annotations

import copy
import enum
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from supervisor.config import Config
from supervisor.control.coordinator import CheckpointCoordinator, Staged
from supervisor.control.events import Event, EventLog, StatsLog, read_jsonl
from supervisor.control.fleet import Fleet
from supervisor.control.interval import AutoInterval
from supervisor.control.memory import memory_fields
from supervisor.control.run_state import RunState
from supervisor.control.step_info import StepInfo
from workers.data import PromptLoader
from workers.grpo import group_advantages
from workers.ppo import gae, token_rewards
from workers.rewards import Rewards


def split(batch: dict, ranks: int) -> list[dict]:
    """Each rank's shard of the step's batch: its contiguous part of every tensor, rows in order."""
    return [{k: v.chunk(ranks)[r] for k, v in batch.items()} for r in range(ranks)]


class Phase(str, enum.Enum):
    ROLLOUT = "rollout"
    TRAIN = "train"
    PUSH = "push"
    EXPORT = "export"
    EVALUATE = "evaluate"
    LOG = "log"
    SAVE = "save"


@dataclass
class Owed:
    """What a committed step still owes, decided once at its commit; each flag is cleared when paid."""
    step: StepInfo
    row: dict
    started: float
    export: bool
    evaluate: bool
    save: bool
    logged: bool = False
    staged: Staged | None = None  # the recover save's files, written (or begun) before the row, committed after it
    paid_secs: dict = field(default_factory=dict)


class StepRunner:
    """Drives steps on the groups the controller gives it; holds the run's state between steps."""

    def __init__(self, config: Config, loader: PromptLoader, rewards: Rewards, stats: StatsLog, events: EventLog,
                 checkpoints: CheckpointCoordinator, fault_point: Callable[[str, StepInfo], None], fleet: Fleet,
                 pools: dict | None = None, memories: dict | None = None):
        self.config, self.loader, self.rewards = config, loader, rewards
        self.fleet = fleet  # the groups it steps on, and the weights between them (the controller replaces them)
        self.pools = pools or {}  # role -> its warm spare pool (cluster/spares.py): only asked for their peak memory
        # role -> its group's memory-tier copies (cluster/memory_copies.py), every trained group's or none: empty,
        # the tier does not serve the job (recovery from disk)
        self.memories = memories or {}
        self.snapshots: dict[int, RunState] = {}  # global step -> the run's state at its commit (memory tier)
        self.stats, self.events, self.checkpoints, self.fault_point = stats, events, checkpoints, fault_point
        self.total_steps = loader.steps_per_epoch * config.total_train_epochs
        self.state = RunState.fresh(config, loader.steps_per_epoch)
        self.owed: Owed | None = None
        self.phase: Phase | None = None
        self.last_reward: float | None = None
        self.logged: tuple | None = None  # (when, TrainGroup) of the last row written: the time between steps
        self.interval = None  # recover.freq_secs: auto; it sees the trial's past and every new event
        if config.recover.secs_auto:
            self.interval = AutoInterval.from_history(read_jsonl(events.path))
            events.listeners.append(self.interval.observe)

    @property
    def weights_version(self) -> int:
        """The version of the trainer's weights: the number of updates they have taken."""
        return self.state.step.global_step + 1

    def memories_of_groups(self) -> list[tuple]:
        """(its memory copies, the group) of every trained group the tier holds."""
        return [(m, self.fleet.group(role)) for role, m in self.memories.items()]

    @property
    def finished(self) -> bool:
        return self.finished_training and self.checkpoints.in_flight.idle

    def advance(self) -> int | None:
        """Pay what the last committed step owes, or run the next step to its commit and then pay; publish
        background writes once they are durable (after the last step, wait for them). Returns the global step
        completed, or None (only background writes were waited for)."""
        completed = None
        self.checkpoints.collect(self.fleet.trainers, block=False)
        if self.owed is None and not self.finished_training:
            self._until_commit(self.state.step.next())
        if self.owed is not None:
            self._settle(self.owed)
            completed, self.owed = self.owed.step.global_step, None
        if self.finished_training:
            self.checkpoints.collect(self.fleet.trainers, block=True)
        return completed

    def drop_group(self, keep: bool = False) -> None:
        """Kill the TrainGroup (survivors may be stuck in a collective, or still writing a save), or with `keep`
        leave its actors to `TrainGroup.regroup`: what it held is dropped, its weights stream to the engines and
        the background writes, unpublished."""
        self.fleet.drop_trainers(keep)
        for memory in self.memories.values():  # every group loads the checkpoint: the critic's too
            memory.reset()
        self.owed = None  # the new group's weights are the checkpoint's
        self.checkpoints.drop_in_flight()

    def roll_back(self, state: RunState) -> None:
        """The run's state (step, counters, frequency controls) back to a checkpoint's, stats cut back to it."""
        self.state, self.owed, self.phase = state, None, None
        self.stats.truncate_after(state.step.global_step)
        self.snapshots = {}

    def restore(self, global_step: int) -> None:
        """After a repair from memory: the run's state back to `global_step`'s commit. If that step still owes
        something, it still does (a recover save it had not finished is written again: some of the ranks that
        wrote it are gone); a step after it is dropped and trained again."""
        owed = self.owed if self.owed is not None and self.owed.step.global_step == global_step else None
        snapshots = {s: st for s, st in self.snapshots.items() if s <= global_step}
        self.roll_back(copy.deepcopy(snapshots[global_step]))
        self.snapshots, self.logged = snapshots, None  # the next row's gap was a repair
        if owed is not None and owed.save:
            owed.staged = None
        self.owed = owed

    @property
    def finished_training(self) -> bool:
        return self.owed is None and self.state.step.global_step + 1 >= self.total_steps

    # ---- before the commit: a fault here replays the step -------------------------------------------
    def _until_commit(self, s: StepInfo) -> None:
        cfg, t0 = self.config, time.monotonic()
        self.fault_point("step.begin", s)
        self.phase = Phase.ROLLOUT
        rows = [r for r in self.loader.batch(s.epoch, s.epoch_step) for _ in range(cfg.data.group_size)]
        rollout = self.fleet.engines.generate([r["prompt"] for r in rows], s.global_step, version=s.global_step)
        self.fault_point("step.rolled_out", s)
        rewards = torch.tensor(self.rewards(rows, rollout["completions"]))
        self.fault_point("step.scored", s)
        t_rollout = time.monotonic()
        self.phase = Phase.TRAIN
        for memory, group in self.memories_of_groups():
            memory.wait_landed(group, s.global_step - 1)
        t_landed = time.monotonic()
        batch = {k: rollout[k] for k in ("input_ids", "attention_mask", "response_mask")}
        critic = {}
        if self.config.critic is None:  # GRPO: a row's advantage is its reward against its group's
            batch["advantages"] = group_advantages(rewards, cfg.data.group_size)
            results = self.fleet.trainers.train(split(batch, self.fleet.trainers.world_size), s.global_step)
        else:
            results, critic = self._train_with_critic(batch, rewards, s)
        metrics = results[0]
        # ---- the commit point: every rank took its optimizer step -----------------------------------
        t_train = time.monotonic()
        self.state.step = s
        if "kl_coef" in metrics:  # PPO's KL penalty in the rewards: the next step's coefficient
            self.state.kl = self.state.kl.after(metrics["kl"], len(rows))
        self.last_reward = float(rewards.mean())
        elapsed = t_train - t0
        last = s.global_step + 1 >= self.total_steps
        self._set_recover_interval()  # before the recover check below; its event, if any, is emitted there
        self.owed = Owed(
            step=s, started=t0,
            row={"global_step": s.global_step, "epoch": s.epoch, "epoch_step": s.epoch_step,
                 "reward": self.last_reward, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                 "lr": metrics["lr"], "weights_version": s.global_step + 1,
                 "time/rollout": t_rollout - t0, "time/train": t_train - t_landed,
                 **({"time/memory_wait": t_landed - t_rollout} if self.memories else {}),
                 **({"kl": metrics["kl"]} if "kl" in metrics else {}),  # with actor.kl_coef
                 **({"kl_coef": metrics["kl_coef"]} if "kl_coef" in metrics else {}),  # critic.kl_in_reward
                 **({"clip_frac": metrics["clip_frac"]} if "clip_frac" in metrics else {}),  # several updates
                 **{f"critic/{k}": v for k, v in critic.items()},  # PPO: the critic's loss, grad_norm, ...
                 **memory_fields([r["memory"] for r in results], rollout["memory"],
                                 [m for pool in self.pools.values() for m in pool.peak_memory()])},
            export=self.state.saver.check(s.is_epoch_end, elapsed),
            evaluate=self.state.evaluator.check(s.is_epoch_end, elapsed),
            save=self.checkpoints.enabled and (self.state.recover.check(s.is_epoch_end, elapsed) or last)
            and not self.checkpoints.committed_already(s.global_step),
        )  # from here on, a fault never replays the update: `settle` pays what is owed
        if self.memories:
            self.snapshots = {g: st for g, st in self.snapshots.items() if g >= s.global_step - 1}
            self.snapshots[s.global_step] = copy.deepcopy(self.state)
            for memory, group in self.memories_of_groups():
                memory.begin(group, s.global_step)
            off = next((m.off for m in self.memories.values() if m.off is not None), None)
            for memory, group in self.memories_of_groups():  # the tier serves every group or none
                if memory.off is None and off is not None:
                    memory.turn_off(group, f"another group's copies are off ({off})")
            self.owed.row["time/memory_stage"] = time.monotonic() - t_train
        self.fault_point("step.trained", s)

    def _train_with_critic(self, batch: dict, rewards: torch.Tensor, s: StepInfo) -> tuple[list[dict], dict]:
        """PPO: the critic's values of the step's states, GAE's advantages and returns from them (here, so that
        the whole batch's tokens whiten the advantages), then both groups' updates at once. Returns the policy's
        results and the critic's rank-0 metrics. A fault in either group replays the step from the last commit
        (both groups reload it: the other may have taken its update)."""
        critics, trainers, c = self.fleet.critics, self.fleet.trainers, self.config.critic
        values = torch.cat(critics.values(split(batch, critics.world_size), s.global_step))
        policy_batch, kl = {}, None
        if c.kl_in_reward:  # each token's reward less beta * (log p - log p_ref) (verl's apply_kl_penalty, "kl")
            logprobs = trainers.logprobs(split(batch, trainers.world_size), s.global_step)
            policy_batch["old_logp"] = torch.cat([lp["logp"] for lp in logprobs])  # not computed again
            kl = policy_batch["old_logp"] - torch.cat([lp["ref_logp"] for lp in logprobs])
        beta = self.state.kl.value if kl is not None else 0.0
        advantages, returns = gae(token_rewards(rewards, batch["response_mask"], kl, beta), values,
                                  batch["response_mask"], c.gamma, c.lam)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="critic") as pool:
            critic = pool.submit(critics.train, split(batch | {"old_values": values, "returns": returns},
                                                      critics.world_size), s.global_step)
            policy = trainers.train(split(batch | policy_batch | {"advantages": advantages}, trainers.world_size),
                                    s.global_step)
            trained = critic.result()[0]
        if kl is not None:  # each sequence's mean KL per generated token, averaged (verl's controller's current_kl),
            # and the coefficient it was weighed with
            mask = batch["response_mask"][:, 1:].float()
            per_row = (kl * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
            policy[0] = policy[0] | {"kl": float(per_row.mean()), "kl_coef": beta}
        return policy, {k: trained[k] for k in ("loss", "grad_norm", "vf_clip_frac") if k in trained}

    def _set_recover_interval(self) -> None:
        """The Young/Daly interval for this step's recover check; an event when it moved."""
        if self.interval is None:
            return
        now = time.time()
        secs, moved = self.interval.update(now)
        self.state.recover.freq_secs = secs
        if moved:
            cost = self.interval.save_cost
            self.events.emit(Event.RECOVER_INTERVAL, secs=round(secs, 3), mtbf_secs=round(self.interval.mtbf(now), 1),
                             save_cost_secs=None if cost is None else round(cost, 4), failures=self.interval.failures)

    # ---- after the commit: each item is paid exactly once -------------------------------------------
    def _settle(self, o: Owed) -> None:
        s = o.step
        if self.fleet.engine_version != self.weights_version:
            self.phase, t = Phase.PUSH, time.monotonic()
            sent = self.fleet.sync_engines(self.weights_version, gate=False)
            o.paid_secs["push"] = time.monotonic() - t
            o.row["time/weight_sync"], o.row["time/weight_digest"] = sent["secs"], sent["digest_secs"]
            if "write_secs" in sent:  # the ranks wrote the engines' weights in place (shared memory, CUDA IPC)
                o.row["time/weight_write"] = sent["write_secs"]
            self.fault_point("step.pushed", s)
        if o.export:
            self.phase, t = Phase.EXPORT, time.monotonic()
            self.checkpoints.export_hf(self.fleet.trainers, s, self.config.async_export, self.fleet.critics)
            o.export, o.paid_secs["export"] = False, time.monotonic() - t
            self.fault_point("step.exported", s)
        if o.evaluate:
            self.phase, t = Phase.EVALUATE, time.monotonic()
            o.row["eval/reward"] = self._evaluate(s)
            o.evaluate, o.paid_secs["evaluate"] = False, time.monotonic() - t
            self.fault_point("step.evaluated", s)
        if o.save and o.staged is None:
            self.phase, waited = Phase.SAVE, time.monotonic()
            self.checkpoints.collect_save(self.fleet.trainers, block=True)  # one in flight: waiting stalls this step
            waited = time.monotonic() - waited
            nxt = s.next()
            infos = self.state.to_infos(self.loader.state_dict(nxt.epoch, nxt.epoch_step))
            try:
                o.staged = self.checkpoints.write_recover(self.fleet.trainers, s, infos, self.config.async_recover,
                                                          self.fleet.critics)
                o.staged.secs += waited
            except Exception:
                self._log_row(o)  # the step was trained: its row is owed whatever becomes of its save
                raise
        if not o.logged:  # before the commit: a step that is the last valid one always has its row
            self.phase = Phase.LOG
            self._log_row(o)
            self.fault_point("step.logged", s)
        if o.save:
            self.phase = Phase.SAVE
            if o.staged.background:
                self.checkpoints.begin_background_save(o.staged, self.fleet.weights_checksum(self.weights_version))
            else:
                self.checkpoints.collect_export(self.fleet.trainers, block=True)  # its recover_info says it is done
                self.checkpoints.commit_recover(o.staged, self.fleet.weights_checksum(self.weights_version))
            o.save = False
            self.fault_point("step.saved", s)

    def _log_row(self, o: Owed) -> None:
        if o.logged:
            return
        o.row["time/saving"] = o.paid_secs.get("export", 0.0) + (o.staged.secs if o.staged else 0.0)
        if o.staged and o.staged.background:
            o.row["ckpt/blocked_secs"] = o.staged.secs  # the write's own figures come with its commit event
        elif o.staged:
            o.row["ckpt/bytes"] = o.staged.nbytes
            o.row["ckpt/MBps"] = round(o.staged.nbytes / max(o.staged.secs, 1e-9) / 1e6, 3)
        o.row.update({f"time/{k}": o.paid_secs.get(k, 0.0) for k in ("push", "export", "evaluate")})
        o.row["time/save"] = o.staged.secs if o.staged else 0.0  # the recover save's stall before this row
        if self.logged and self.logged[1] is self.fleet.trainers:
            # the last row's write (fsync), its save's commit, background collections, the controller's loop;
            # absent on a new TrainGroup's first step (the gap was a repair)
            o.row["time/between_steps"] = o.started - self.logged[0]
        o.row["time/step"] = time.monotonic() - o.started
        self.logged = (time.monotonic(), self.fleet.trainers)
        self.stats.append(o.row)
        o.logged = True

    def save_now(self) -> None:
        """Before a stop: the background writes in flight are committed, then the last step completed is saved and
        committed now, unless it is already. Its recover_info is the one its own save would have had, so the
        resumed run goes on exactly as an uninterrupted one."""
        s = self.state.step
        self.checkpoints.collect(self.fleet.trainers, block=True)
        if s.global_step < 0 or not self.checkpoints.enabled or self.checkpoints.committed_already(s.global_step):
            return
        self.phase = Phase.SAVE
        nxt = s.next()
        infos = self.state.to_infos(self.loader.state_dict(nxt.epoch, nxt.epoch_step))
        staged = self.checkpoints.write_recover(self.fleet.trainers, s, infos, critics=self.fleet.critics)
        self.checkpoints.commit_recover(staged, self.fleet.weights_checksum(self.weights_version))

    def skip_owed_save(self) -> str | None:
        """After this step's export or recover save failed on storage: give it up; returns what was skipped."""
        if self.owed is None:
            return None
        if self.phase is Phase.EXPORT and self.owed.export:
            self.owed.export = False
            return "export"
        if self.phase is Phase.SAVE and self.owed.save:
            self.owed.save, self.owed.staged = False, None
            return "recover"
        return None

    def _evaluate(self, s: StepInfo) -> float:
        """Greedy reward over every prompt of the dataset, with the weights the step produced."""
        rows = self.loader.rows
        out = self.fleet.engines.generate([r["prompt"] for r in rows], s.global_step, version=s.global_step + 1,
                                    greedy=True)
        return float(torch.tensor(self.rewards(rows, out["completions"])).mean())
