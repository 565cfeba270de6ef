"""The Supervisor actor: a thin Ray shell around the controller, and the only writer of the run's state.

It builds the controller with the real worker groups, runs it, and answers queries (`progress`, which says how
long ago the controller last moved and which bounded waits it is blocked in, for the driver's watchdog) while
it runs. When Ray restarts it after its own death, it counts that as a fault like any other (the policy, rebuilt
from this job's events, decides, backs off or gives up) and rebuilds everything from disk.
"""
from __future__ import annotations

import os
import threading
import time
import traceback
from typing import TYPE_CHECKING, Callable

import ray

from supervisor.checkpoint.layout import TrialLayout
from supervisor.checkpoint.storage import retry_budget
from supervisor.checkpoint.trial_lock import trial_lock
from supervisor.cluster.drains import DrainWatch
from supervisor.cluster.spare_placement import spare_count
from supervisor.config import Config, RoleName
from supervisor.control.events import Event, EventLog, StatsLog, group_of, read_jsonl
from supervisor.control.fleet import Fleet
from supervisor.control.log_mirror import LogMirror
from supervisor.control.policy import RestartPolicy
from supervisor.control.step_info import StepInfo
from supervisor.control.trackers import Trackers
from supervisor.control.watchdog import Waits
from supervisor.exit_codes import ExitCode
from supervisor.testing import fault_points
from workers.data import PromptLoader, read_prompts
from workers.rewards import Rewards, UserCodeError

# The controller, the worker groups and the checkpoint coordinator import torch: they are imported in the actor's
# own process, where they run, so that the driver, which imports this module for the class, starts without torch
# (about 3 s of CPU less at every `relaunch run`: docs/testing.md)
if TYPE_CHECKING:
    from supervisor.control.controller import Controller

NAMESPACE = "relaunch"  # the Ray namespace of every relaunch job's named actors


def supervisor_name(config: Config) -> str:
    """The Supervisor's actor name: one controller per trial on a cluster, and `relaunch status` finds it."""
    return f"{config.experiment_name}/{config.trial_name}"


@ray.remote(num_cpus=0, max_concurrency=4)
class Supervisor:
    def __init__(self, config: Config, job_id: str, lock_token: str | None = None):
        """`lock_token`: the token of the trial's lock the driver holds; each commit checks it is still held."""
        self.config, self.job_id = config, job_id
        layout = TrialLayout.from_config(config)
        prior = [e for e in read_jsonl(layout.events_log) if e.get("job") == job_id]
        self.attempt = sum(e["event"] == Event.START for e in prior)
        self.waits = Waits()  # what the controller is blocked in, for the driver's watchdog
        # the logs' appends (each fsynced) are bounded like the rest of the Supervisor's own file work
        append = lambda: self.waits.on("an append to the run's logs", config.recover.step_timeout_secs)  # noqa: E731
        self.events = EventLog(layout.events_log, attempt=self.attempt, job=job_id, guard=append)
        self.policy = RestartPolicy.from_history(config, prior)
        rows = read_prompts(config.data.path, config.data.prompt_key, config.data.answer_key)
        self.loader = PromptLoader(rows, config.data.batch_size, config.seed, config.data.shuffle)
        self.stats = StatsLog(layout.stats_log, guard=append)
        lock = trial_lock(layout)
        fence = (lambda: lock.check_held(lock_token)) if lock_token else None  # noqa: E731
        from supervisor.control.coordinator import CheckpointCoordinator

        self.checkpoints = CheckpointCoordinator(config, layout, self.events, self.waits, fence)
        if layout.log_mirror is not None:
            self.events.listeners.append(LogMirror(layout, self.events, retry_budget(config)).on_event)
        self.controller: Controller | None = None
        self.stop_requested: str | None = None  # asked before the controller was made: handed to it
        self.trackers: Trackers | None = None
        self.created = time.monotonic()
        self._run_once = threading.Lock()
        self._result: dict | None = None

    # ---- queries (served concurrently with run) -------------------------------------------------
    def progress(self) -> dict:
        from supervisor.control.controller import State

        c = self.controller
        r, f = (c.runner, c.fleet) if c else (None, None)
        return {
            "phase": c.phase if c else State.STARTING.value,
            "global_step": r.state.step.global_step if r else -1,
            "total_steps": self.loader.steps_per_epoch * self.config.total_train_epochs,
            "reward": r.last_reward if r else None, "restarts": self.policy.restarts, "attempt": self.attempt,
            "weights_version": f.engine_version if f else None,
            "train_nodes": f.trainers.nodes if f and f.trainers else [],
            "rollout_nodes": f.engines.nodes if f and f.engines else [],
            "supervisor_pid": os.getpid(),
            # a reward call that returns is progress too: a step scoring many samples by a slow service is healthy
            "since_transition_secs": time.monotonic() - max(c.transitioned if c else self.created,
                                                            r.rewards.returned if r else 0.0),
            "waits": self.waits.report(),
            "workers": [w for group in ((f.trainers, f.critics, f.engines) if f else ()) if group is not None
                        for w in group.describe()],
        }

    def stop(self, why: str) -> None:
        """End the run at the next step boundary, saved there (the driver got SIGTERM): `run` returns exit 143."""
        self.stop_requested = why
        if self.controller is not None:
            self.controller.stop_requested = why

    # ---- the run --------------------------------------------------------------------------------
    def run(self) -> dict:
        """The run, once per life of this actor: the driver's call is retried when a push goes unanswered and may
        have reached it already (ActorUnavailableError), and a second controller must never start beside the
        first: a second call waits for the first's result."""
        with self._run_once:
            if self._result is None:
                self._result = self._run()
            return self._result

    def _run(self) -> dict:
        from supervisor.cluster.groups import RolloutGroup, TrainGroup, remove_leftover_placement_groups
        from supervisor.cluster.memory_copies import MemoryCopies
        from supervisor.cluster.spares import SparePool, remove_leftover_spares
        from supervisor.control.controller import Controller, JobResult
        from supervisor.control.step import StepRunner

        cfg = self.config
        self.events.emit(Event.START, experiment=cfg.experiment_name, trial=cfg.trial_name,
                         total_steps=self.loader.steps_per_epoch * cfg.total_train_epochs,
                         n_train_workers=cfg.cluster.n_train_workers, n_rollout_workers=cfg.cluster.n_rollout_workers)
        try:
            rewards = Rewards.from_config(cfg.reward)
        except UserCodeError as e:
            self.events.emit(Event.FAILED, reason=str(e))
            return JobResult(ExitCode.BAD_INPUT, str(e)).__dict__
        self._attach_trackers()
        if self.attempt > 0:
            removed, spares = remove_leftover_placement_groups(cfg), remove_leftover_spares(cfg)
            if removed or spares:
                self.events.emit(Event.CLEANUP, placement_groups=removed, spares=spares)
        sizes: dict[RoleName, int] = {}
        for role in cfg.trained:  # the actor's pool first; each next one gets the room the ones before it left
            ranks = cfg.workers_of(role)
            sizes[role] = spare_count(cfg.recover.spare_workers, ray.cluster_resources(), cfg.cluster,
                                      cfg.rollout.spare_engines, cfg.train_ranks - ranks + sum(sizes.values()), ranks)
        pools = {role: SparePool(cfg, n, role) for role, n in sizes.items() if n}
        memory_off = cfg.memory_tier_off(sizes)
        warn = lambda message: self.events.emit(Event.WARNING, message=message)  # noqa: E731
        memories = {role: MemoryCopies(pools.get(role), warn, self._linked(role))
                    for role in cfg.trained} if memory_off is None else {}
        runner = StepRunner(cfg, self.loader, rewards, self.stats, self.events, self.checkpoints, self._fault_point,
                            Fleet(self.events), pools, memories)
        self.controller = Controller(
            cfg, runner, self.checkpoints, self.policy, self.events, self.stats,
            make_train_group=lambda size, role=RoleName.ACTOR: TrainGroup(
                cfg, size, cfg.recover.step_timeout_secs, pools.get(role), role),
            make_rollout_group=lambda: RolloutGroup(cfg, cfg.recover.step_timeout_secs),
            supervisor_restarted=self.attempt > 0, pools=pools, memory_off=memory_off, drains=DrainWatch())
        self.controller.stop_requested = self.stop_requested
        try:
            result = self.controller.run()
        except Exception as e:  # noqa: BLE001 - a bug in the controller itself: report it, never hang the driver
            result = JobResult(ExitCode.FAILED, f"relaunch internal error: {type(e).__name__}: {e}",
                               details=traceback.format_exc())
            self.events.emit(Event.FAILED, reason=result.message)
        finally:
            rewards.close()
        return result.__dict__

    def _linked(self, role: RoleName) -> Callable[[dict], None]:
        """What `role`'s memory copies say when its ranks are linked to their holders: a `buddies` event."""
        return lambda nodes: self.events.emit(Event.BUDDIES, nodes=nodes, **group_of(role))

    def _wait_spares(self, point: str, bound: float = 300.0) -> None:
        ctl, deadline = self.controller, time.monotonic() + bound
        pools = [(pool, ctl.fleet.group(role)) for role, pool in ctl.pools.items()]
        engines = ctl.fleet.engines
        while any(len(pool.warm()) < pool.size for pool, _ in pools) or \
                engines.warm_spares() < self.config.rollout.spare_engines:
            if time.monotonic() > deadline:
                raise RuntimeError(f"fault point {point}: the spare pools were not warm after {bound:.0f}s")
            placed = []
            for pool, group in pools:
                placed += pool.refill(group.nodes, placed)
            engines.refill()
            time.sleep(0.2)

    def _attach_trackers(self) -> None:
        """logging.trackers follow the two logs from here on (once per Supervisor life)."""
        if self.config.logging.trackers and self.trackers is None:
            self.trackers = Trackers(self.config, TrialLayout.from_config(self.config))
            self.events.listeners.append(self.trackers.on_event)
            self.stats.listeners.append(self.trackers.on_stats)

    def _fault_point(self, point: str, s: StepInfo) -> None:
        """Test instrumentation at the step's phase boundaries: besides the usual actions, `kill_rank` and
        `stop_rank` break the last TrainWorker, `kill_engine` and `stop_engine` the first engine, and
        `wait_spares` waits until the spare pools (TrainWorkers, the critic's, engines) are full and warm (so that the memory
        tier links at this step)."""
        action = fault_points.armed(point, step=s.global_step)
        if action is None:
            return
        fleet = self.controller.fleet
        verb, _, target = action.partition("_")
        if action == "wait_spares":
            self._wait_spares(point)
        elif target in ("rank", "engine"):
            pid = fleet.trainers.members[-1].pid if target == "rank" else fleet.engines.members[0].pid
            if pid is None:
                raise RuntimeError(f"fault point {point}: the {target}'s pid is not known yet")
            fault_points.apply(verb, point, pid=pid)
        else:
            fault_points.apply(action, point)
