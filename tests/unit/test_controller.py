"""The controller without Ray: stand-in groups, real checkpoints on disk, faults at every phase of a step.

The stand-ins behave like the real groups seen from the Supervisor: a dead or hung actor fails every call
to it until it is replaced (a rank: until the whole TrainGroup is), an engine refuses weights of another
version, a broken weight stream fails the sync that used it. The trainer's "weights" are the list of steps it has
applied, so a step trained twice, or one dropped, shows in the final weights.
"""
from __future__ import annotations

import errno
import hashlib
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from ray import exceptions as rex

from supervisor.checkpoint.layout import TMP_PREFIX, TrialLayout
from supervisor.cluster.drains import DrainWatch
from supervisor.cluster.errors import Group, GroupError
from supervisor.config import RoleName, load_config
from supervisor.control.controller import Controller, Outcome, Result, State, UnexpectedState, transition
from supervisor.control.coordinator import CheckpointCoordinator
from supervisor.control.events import EventLog, StatsLog, read_jsonl
from supervisor.control.fleet import Fleet
from supervisor.control.policy import RestartPolicy
from supervisor.control.step import StepRunner
from supervisor.exit_codes import ExitCode
from workers.data import PromptLoader
from workers.errors import StaleWeights, WeightSyncError
from workers.rewards import Rewards

STEPS = 8  # 2 epochs of 4 steps; export, evaluation and recover save every 2 steps (1, 3, 5, 7)
ROWS = [{"prompt": f"p{i}", "answer": str(i % 10)} for i in range(8)]


def digest(history: list[int]) -> str:
    return hashlib.sha256(json.dumps(history).encode()).hexdigest()[:16]


class World:
    """What the stand-in groups share: the faults still to strike, and what was broken."""

    def __init__(self):
        self.armed: dict[tuple[str, int], str] = {}   # (phase, step) -> fault
        self.dead_ranks = self.hung_ranks = False
        self.broken_collective = False
        self.dead_engines: set[int] = set()
        self.hung_engines: set[int] = set()
        self.poisoned_engines: set[int] = set()  # a device error on every call, until replaced
        self.broken_stream = False
        self.then: list[tuple[tuple[str, int], str]] = []  # armed one by one, each after the previous fired
        self.storage_full = self.reward_raises = self.env_fails = False
        self.train_groups = 0
        self.regroups = 0  # repairs from disk that kept the survivors' processes
        self.digest_passes = 0  # how often the trainers went over their weights only to hash them
        self.groups = 0  # weights-update groups made
        self.write_polls = 1  # a background save is reported unfinished to this many polls

    def strike(self, phase: str, step: int) -> None:
        fault = self.armed.pop((phase, step), None)
        if fault and self.then:
            key, follow = self.then.pop(0)
            self.armed[key] = follow
        if fault == "rank_death":
            self.dead_ranks = True
        elif fault == "rank_hang":
            self.hung_ranks = True
        elif fault == "peer_collective":
            self.broken_collective = True
        elif fault == "engine_death":
            self.dead_engines.add(1)
        elif fault == "engine_hang":
            self.hung_engines.add(0)
        elif fault == "broken_stream":
            self.broken_stream = True
        elif fault == "storage":
            self.storage_full = True
        elif fault == "user":
            self.reward_raises = True
        elif fault == "engine_device":
            self.poisoned_engines.add(0)
        elif fault == "runtime_env":
            self.env_fails = True


class FakeTrainers:
    def __init__(self, world: World, world_size: int):
        world.dead_ranks = world.hung_ranks = world.broken_collective = False
        world.train_groups += 1
        self.world, self.world_size, self.history = world, world_size, []
        self.nodes = ["n1"] * world_size
        self.timings = {"scheduling": 0.0, "process_start": 0.0, "rendezvous": 0.0}
        self.members = [SimpleNamespace(name=f"TrainWorker[rank {r}]") for r in range(world_size)]
        self.bundles = {r: r for r in range(world_size)}  # every rank started cold, in a bundle of its own
        self.from_spares = 0

    def _lost(self) -> set[int]:
        """The ranks a fault took: rank 1 died (its death also breaks rank 0's collective), rank 0 hung."""
        return {1} if self.world.dead_ranks else {0} if self.world.hung_ranks else set()

    def placeable(self, lost, spares):
        return set(lost)

    def answering(self, timeout):
        return set(range(self.world_size)) - self._lost()

    def progress(self, timeout):
        return {r: None if r in self._lost() else {"phase": "train", "secs": 1.0, "seq": 3}
                for r in range(self.world_size)}

    def kill_ranks(self, ranks):
        assert ranks == self._lost()

    def regroup(self, lost, spares):
        """The lost ranks start again and the survivors keep their processes (and their history, which
        load_recover then replaces with the checkpoint's)."""
        assert set(lost) == self._lost()
        self.world.regroups += 1
        self.from_spares = spares.take(len(lost)) if spares is not None else 0
        self.world.dead_ranks = self.world.hung_ranks = self.world.broken_collective = False

    def _check(self, phase: str, step: int) -> None:
        self.world.strike(phase, step)
        if self.world.dead_ranks:
            raise GroupError(Group.TRAIN, rex.ActorDiedError(), ("TrainWorker[rank 1]",), "n1", 0.1)
        if self.world.hung_ranks:
            raise GroupError(Group.TRAIN, rex.GetTimeoutError("no answer"), ("TrainWorker[rank 0]",), "n1", 10.0)
        if self.world.broken_collective:
            err = rex.RayTaskError("train", "tb", RuntimeError("[gloo] Connection reset by peer")).as_instanceof_cause()
            raise GroupError(Group.TRAIN, err, ("TrainWorker[rank 0]",), "n1", 0.1)

    def _storage(self) -> None:
        if self.world.storage_full:
            self.world.storage_full = False
            err = rex.RayTaskError("save", "tb", OSError(errno.ENOSPC, "No space left on device")).as_instanceof_cause()
            raise GroupError(Group.TRAIN, err, ("TrainWorker[rank 0]",), "n1", 0.1, settled=True)

    def train(self, shards, global_step):
        self._check("train", global_step)
        self.history.append(global_step)
        return [{"loss": float(global_step), "grad_norm": 1.0, "lr": 0.1, "memory": {"rss_gb": 0.1}}]


    def save_recover(self, staging, global_step):
        self._check("save", global_step)
        self._storage()
        path = Path(staging) / "model.json"
        path.write_text(json.dumps(self.history))
        return {"model.json": {"size": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}}

    def begin_save(self, staging, global_step):
        """A background save: staged now, written when asked for its result the second time (or at once)."""
        self._check("save", global_step)
        self._storage()
        self.background, self.polls = (Path(staging), list(self.history), global_step), 0

    def start_upload(self, global_step):
        assert self.background[2] == global_step

    def save_result(self, global_step, block):
        staging, history, step = self.background
        assert step == global_step
        self._check("background", step)
        self._storage()
        self.polls += 1
        if not block and self.polls <= self.world.write_polls:
            return None  # still being written: the run goes on, the save stays in flight a step or more
        path = staging / "model.json"
        path.write_text(json.dumps(history))
        return {"model.json": {"size": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}}

    def load_recover(self, path, world_size):
        self._check("load", -1)
        self.history = json.loads((Path(path) / "model.json").read_text())
        return []

    def export_hf(self, directory, global_step):
        self._check("export", global_step)
        self._storage()
        Path(directory).mkdir(parents=True)
        (Path(directory) / "weights.json").write_text(json.dumps(self.history))

    def begin_export(self, directory, global_step):
        """A background export: the weights taken now, written when asked for the result the second time."""
        self._check("export", global_step)
        self._storage()
        self.exporting, self.export_polls = (Path(directory), list(self.history), global_step), 0

    def export_result(self, global_step, block):
        directory, history, step = self.exporting
        assert step == global_step
        self._check("background_export", step)
        self._storage()
        self.export_polls += 1
        if not block and self.export_polls <= self.world.write_polls:
            return False
        directory.mkdir(parents=True)
        (directory / "weights.json").write_text(json.dumps(history))
        return True

    def shutdown(self):
        pass


class FakeEngines:
    def __init__(self, world: World, n: int = 2):
        self.world = world
        self.held = [None] * n          # (ref, version) of each engine
        self.generated: list[tuple[int, int, bool]] = []
        self.spares, self.from_spares = [], 0  # no warm spare engine (rollout.spare_engines 0)

    def live_spares(self):
        return 0

    @property
    def nodes(self):
        return ["n0"] * len(self.held)

    @property
    def members(self):
        return [SimpleNamespace(name=f"RolloutWorker[{i}]", node_id="n0") for i in range(len(self.held))]

    def _check(self, phase: str, step: int) -> None:
        self.world.strike(phase, step)
        for i in sorted(self.world.dead_engines):
            raise GroupError(Group.ROLLOUT, rex.ActorDiedError(), (f"RolloutWorker[{i}]",), "n0", 0.1)
        for i in sorted(self.world.poisoned_engines):
            err = rex.RayTaskError("generate", "tb", RuntimeError("CUDA error: an illegal memory access"))
            raise GroupError(Group.ROLLOUT, err.as_instanceof_cause(), (f"RolloutWorker[{i}]",), "n0", 0.1)
        if self.world.env_fails:
            self.world.env_fails = False
            error = rex.RuntimeEnvSetupError("Failed to set up runtime environment: pip install timed out")
            raise GroupError(Group.ROLLOUT, error, ("RolloutWorker[1]",), "n0", 0.1)
        if self.world.hung_engines:
            names = tuple(f"RolloutWorker[{i}]" for i in sorted(self.world.hung_engines))
            raise GroupError(Group.ROLLOUT, rex.GetTimeoutError("no answer"), names, "n0", 10.0)

    def generate(self, prompts, global_step, version, greedy=False):
        self._check("evaluate" if greedy else "rollout", global_step)
        for ref_version in self.held:
            if ref_version is None or ref_version[1] != version:
                err = rex.RayTaskError("generate", "tb", StaleWeights(f"{ref_version} != {version}"))
                raise GroupError(Group.ROLLOUT, err.as_instanceof_cause(), ("RolloutWorker[0]",))
        self.generated.append((global_step, version, greedy))
        n = len(prompts)
        completions = [str((global_step * 3 + i) % 10) for i in range(n)]
        ids = torch.zeros(n, 3, dtype=torch.long)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "response_mask": torch.ones_like(ids),
                "completions": completions, "memory": {"rss_gb": 0.1}}

    def connect(self, trainers):
        self.world.groups += 1
        return FakeStream(self, trainers)

    def weight_status(self):
        self._check("resync", -1)
        return [(h[1], h[0]) if h else (None, "") for h in self.held]

    def replace(self, faulty):
        broken = {int(n.split("[")[1][:-1]) for n in faulty} | self.world.dead_engines | self.world.hung_engines
        self.world.poisoned_engines -= broken  # a poisoned engine answers probes: only naming it replaces it
        self.world.dead_engines, self.world.hung_engines = set(), set()
        for i in broken:
            self.held[i] = None
        return sorted(f"RolloutWorker[{i}]" for i in broken)

    def shutdown(self):
        pass


class FakeStream:
    """The weight stream between a TrainGroup and the engines: the trainers' history lands in the targets."""

    def __init__(self, engines: FakeEngines, trainers: FakeTrainers):
        self.engines, self.trainers, self.world = engines, trainers, engines.world

    def sync(self, global_step, only=None):
        self.trainers._check("weights", global_step)
        only = range(len(self.engines.held)) if only is None else only
        if not only:
            self.world.digest_passes += 1
        else:
            self.engines._check("push", global_step)
        if only and self.world.broken_stream:
            self.world.broken_stream = False
            broken = WeightSyncError("weight stream broken: Connection closed by peer")
            raise GroupError(Group.ROLLOUT, rex.RayTaskError("update_weights_from_distributed", "tb", broken)
                             .as_instanceof_cause(), ("RolloutWorker[0]",))
        for i in only:
            self.engines.held[i] = (digest(self.trainers.history), global_step + 1)
        return {"digest": digest(self.trainers.history), "secs": 0.01, "digest_secs": 0.0}

    def close(self):
        pass


def make_controller(tmp_path: Path, world: World, *overrides: str):
    config = load_config(None, [f"cluster.fileroot={tmp_path}", "total_train_epochs=2", "data.batch_size=2",
                                "data.group_size=2", "saver.freq_epochs=null", "saver.freq_steps=2",
                                "evaluator.freq_epochs=null", "evaluator.freq_steps=2", "recover.mode=on",
                                "recover.freq_steps=2", "recover.retries=5", "recover.backoff_secs=0", *overrides])
    layout = TrialLayout.from_config(config)
    events, stats = EventLog(layout.events_log, job="j"), StatsLog(layout.stats_log)
    checkpoints = CheckpointCoordinator(config, layout, events)

    def reward(prompt, completion, row):
        if world.reward_raises:
            world.reward_raises = False
            raise KeyError("answer")
        return float(completion == row["answer"])

    loader = PromptLoader(ROWS, 2, config.seed)

    def fault_point(point, s):
        if point == "step.rolled_out":
            world.strike("score", s.global_step)

    runner = StepRunner(config, loader, Rewards(reward), stats, events, checkpoints, fault_point, Fleet(events))
    engines = FakeEngines(world)
    policy = RestartPolicy.from_history(config, read_jsonl(layout.events_log))  # as the Supervisor actor builds it
    controller = Controller(config, runner, checkpoints, policy, events, stats,
                            make_train_group=lambda n: FakeTrainers(world, n), make_rollout_group=lambda: engines,
                            sleep=lambda s: None, memory_off="these tests have no memory tier")
    return controller, layout, engines


def run(tmp_path, world, *overrides):
    controller, layout, engines = make_controller(tmp_path, world, *overrides)
    result = controller.run()
    return result, layout, engines, controller


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """An uninterrupted run: what every recovered run must end with."""
    world = World()
    result, layout, engines, controller = run(tmp_path_factory.mktemp("clean"), world)
    assert result.exit_code == 0
    assert world.digest_passes == 0  # every digest comes from a sync: the commits reuse their step's
    assert world.groups == 1  # one weights-update group, made at the start and used by every step
    return read_jsonl(layout.stats_log), engines.generated


PHASES = ["rollout", "score", "train", "weights", "push", "export", "evaluate", "save", "background",
          "background_export"]
MODES = ["recover.write_mode=async", "recover.write_mode=sync"]
TRAIN_FAULTS = ["rank_death", "rank_hang", "peer_collective"]
ENGINE_FAULTS = ["engine_death", "engine_hang", "broken_stream", "engine_device"]


def final_history(layout: TrialLayout) -> list[int]:
    step_dir = sorted(layout.recover_checkpoint.glob("globalstep*"), key=lambda p: int(p.name[10:]))[-1]
    return json.loads((step_dir / "model.json").read_text())


def assert_complete_and_exact(layout, clean_stats):
    stats = read_jsonl(layout.stats_log)
    assert [r["global_step"] for r in stats] == list(range(STEPS))      # every step logged, exactly once
    measured = ("time/", "ckpt/", "mem/")
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(measured)} for r in rows]  # noqa: E731
    assert strip(stats) == strip(clean_stats)                           # same metrics, evaluations included
    assert [r["global_step"] for r in stats if "eval/reward" in r] == [1, 3, 5, 7]
    assert final_history(layout) == list(range(STEPS))                  # no step trained twice, none dropped
    exported = sorted(int(p.name.rsplit("globalstep", 1)[1]) for p in layout.export_root.glob("epoch*"))
    assert exported == [1, 3, 5, 7]                                     # every export written, none lost


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("fault", TRAIN_FAULTS)
def test_a_train_group_fault_at_any_phase_rolls_back_and_ends_exact(tmp_path, clean, phase, fault, mode):
    if phase == "background" and mode.endswith("sync") and not mode.endswith("async"):
        pytest.skip("a synchronous save has no background write")
    world = World()
    world.armed[(phase, 3)] = fault
    result, layout, engines, controller = run(tmp_path, world, mode)
    assert result.exit_code == 0, result.message
    assert_complete_and_exact(layout, clean[0])
    events = read_jsonl(layout.events_log)
    assert [e["cause"] for e in events if e["event"] == "failure"] == [
        {"rank_death": "worker_died", "rank_hang": "hang", "peer_collective": "collective_failed"}[fault]]
    loaded = [e["global_step"] for e in events if e["event"] == "loaded"]
    failed_at = next(e["time"] for e in events if e["event"] == "failure")
    committed = [e["global_step"] for e in events if e["event"] == "commit" and e["time"] < failed_at]
    assert loaded == [-1, committed[-1]] and committed[-1] in (1, 3)  # rolled back to the last commit
    # from disk, the ranks that still answer keep their processes: the lost ones start again beside them
    assert (world.train_groups, world.regroups) == (1, 1)
    assert [e["kept"] for e in events if e["event"] == "loaded"] == [[], {"rank_death": [0], "rank_hang": [1],
                                                                         "peer_collective": [0, 1]}[fault]]
    assert not [e for e in events if e["event"] == "failure" and e["cause"] == "stale_weights"]
    recovery = [e for e in events if e["event"] == "recovery"]
    assert len(recovery) == 1 and recovery[0]["what"] == "restart_train_group"
    rec = recovery[0]
    assert {"detection", "teardown", "scheduling", "process_start", "rendezvous", "load", "resync", "replay", "redo",
            "total", "steady_step", "lost"} <= set(rec) and not {"seen", "resumed"} & set(rec)
    # the clock stops at the step that was in flight, not at the first (replayed) step after the repair
    if not phase.startswith("background"):  # a background write's fault is seen at a later step
        assert rec["global_step"] == 3
    assert rec["source"] == "disk" and rec["loaded_step"] == committed[-1]
    assert rec["replayed_steps"] == rec["global_step"] - committed[-1] - 1
    rows_after = [r["global_step"] for r in read_jsonl(layout.stats_log)]
    assert rec["global_step"] in rows_after
    assert rec["lost"] == pytest.approx(rec["total"] - rec["steady_step"], abs=2e-3)


@pytest.mark.parametrize("phase", ["save", "background"])
def test_a_fault_in_the_last_steps_save_is_timed_to_that_steps_completion(tmp_path, clean, phase):
    """The last step's save is still in flight when the step is done: the clock stops when the step trained
    again completes (the run has no next step to wait for)."""
    world = World()
    world.armed[(phase, STEPS - 1)] = "rank_death"
    result, layout, *_ = run(tmp_path, world)
    assert result.exit_code == 0, result.message
    assert_complete_and_exact(layout, clean[0])
    recovery = [e for e in read_jsonl(layout.events_log) if e["event"] == "recovery"]
    assert [(e["global_step"], e["loaded_step"], e["replayed_steps"]) for e in recovery] == [(STEPS - 1, 5, 1)]


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("fault", ENGINE_FAULTS)
def test_an_engine_fault_at_any_phase_replaces_engines_alone_and_never_retrains(tmp_path, clean, phase, fault):
    world = World()
    world.armed[(phase, 3)] = fault
    result, layout, engines, controller = run(tmp_path, world)
    assert result.exit_code == 0, result.message
    assert_complete_and_exact(layout, clean[0])
    events = read_jsonl(layout.events_log)
    assert world.train_groups == 1 and [e["global_step"] for e in events if e["event"] == "loaded"] == [-1]
    failures = [e["cause"] for e in events if e["event"] == "failure"]
    kinds = {"engine_death": "engine_died", "engine_hang": "hang", "broken_stream": "collective_failed",
             "engine_device": "device_error"}
    assert failures == [kinds[fault]]
    # every rollout and evaluation was generated once per step, with the weights of its step
    assert sorted(set(engines.generated)) == sorted(set(clean[1]))
    assert all(version == step + int(greedy) for step, version, greedy in engines.generated)


@pytest.mark.parametrize("phase, mode", [("export", MODES[0]), ("save", MODES[0]), ("save", MODES[1]),
                                         ("background", MODES[0]), ("background_export", MODES[0]),
                                         ("export", "saver.mode=sync")])
def test_a_storage_error_skips_that_save_and_trains_on(tmp_path, clean, phase, mode):
    world = World()
    world.armed[(phase, 3)] = "storage"
    result, layout, engines, controller = run(tmp_path, world, mode)
    assert result.exit_code == 0, result.message
    assert [r["global_step"] for r in read_jsonl(layout.stats_log)] == list(range(STEPS))
    events = read_jsonl(layout.events_log)
    failed = [e for e in events if e["event"] == "save_failed"]
    what = {"background": "background save", "background_export": "background export"}.get(phase, phase)
    assert len(failed) == 1 and failed[0]["global_step"] == 3 and failed[0]["what"] == what
    assert not list(layout.recover_checkpoint.glob(f"{TMP_PREFIX}*"))  # nothing left behind
    assert not [e for e in events if e["event"] == "restart"]  # spends no retry
    exported = [e["global_step"] for e in events if e["event"] == "export"]
    committed = [e["global_step"] for e in events if e["event"] == "commit"]
    assert (exported, committed) == (([1, 5, 7], [1, 3, 5, 7]) if "export" in phase else ([1, 3, 5, 7], [1, 5, 7]))
    assert final_history(layout) == list(range(STEPS))


@pytest.mark.parametrize("mode", MODES)
def test_a_commit_never_overtakes_its_steps_background_export(tmp_path, clean, mode):
    """Step 1 is committed (its recover_info says its export is done) only once its export is published, so a
    rollback to step 1 right after never loses that export."""
    world = World()
    world.write_polls = 3
    world.armed[("train", 2)] = "rank_death"
    result, layout, *_ = run(tmp_path, world, mode)
    assert result.exit_code == 0, result.message
    assert_complete_and_exact(layout, clean[0])


def test_a_failed_export_leaves_the_background_save_in_flight_alone(tmp_path):
    world = World()
    world.write_polls = 3  # step 2's save is still being written when step 3's export fails
    world.armed[("export", 3)] = "storage"
    result, layout, *_ = run(tmp_path, world, "recover.freq_steps=1")
    assert result.exit_code == 0, result.message
    events = read_jsonl(layout.events_log)
    assert [e["what"] for e in events if e["event"] == "save_failed"] == ["export"]
    assert [e["global_step"] for e in events if e["event"] == "commit"] == list(range(STEPS))
    assert final_history(layout) == list(range(STEPS))


def test_a_storage_error_with_stop_ends_the_job(tmp_path):
    world = World()
    world.armed[("save", 3)] = "storage"
    result, layout, *_ = run(tmp_path, world, "recover.on_save_error=stop")
    assert result.exit_code == ExitCode.FAILED and "No space left" in result.message
    assert [r["global_step"] for r in read_jsonl(layout.stats_log)] == list(range(4))  # step 3 was trained


@pytest.mark.parametrize("phase", ["score", "evaluate"])
def test_a_user_error_fails_fast_or_replays_when_allowed(tmp_path, clean, phase):
    world = World()
    world.armed[(phase, 3)] = "user"
    result, layout, *_ = run(tmp_path / "fail", world)
    assert result.exit_code == ExitCode.FAILED and "reward function raised KeyError" in result.message
    assert "KeyError" in result.details
    world = World()
    world.armed[(phase, 3)] = "user"
    result, layout, *_ = run(tmp_path / "retry", world, "reward.retry_user_errors=true")
    assert result.exit_code == 0
    assert_complete_and_exact(layout, clean[0])


def test_a_second_fault_during_the_repair_is_repaired_too(tmp_path, clean):
    world = World()
    world.armed[("train", 4)] = "rank_death"
    world.then = [(("load", -1), "rank_death"),     # the new group dies while loading the checkpoint
                  (("resync", -1), "engine_death")]  # and then an engine during the resync
    result, layout, *_ = run(tmp_path, world)
    assert result.exit_code == 0, result.message
    assert_complete_and_exact(layout, clean[0])
    causes = [e["cause"] for e in read_jsonl(layout.events_log) if e["event"] == "failure"]
    assert causes == ["worker_died", "worker_died", "engine_died"]


def test_retries_run_out_and_the_job_gives_up(tmp_path):
    world = World()
    for step in (2, 4, 6):
        world.armed[("train", step)] = "rank_death"
    result, layout, *_ = run(tmp_path, world, "recover.retries=2")
    assert result.exit_code == ExitCode.FAILED and "retries exhausted (2/2)" in result.message
    events = read_jsonl(layout.events_log)
    assert events[-1]["event"] == "gave_up"
    assert [e["state"] for e in events if e["event"] == "state"][-1] == "failed"


def test_a_restarted_supervisor_is_a_counted_fault_that_rebuilds_from_disk(tmp_path, clean):
    controller, layout, engines = make_controller(tmp_path, World(), "total_train_epochs=1")
    assert controller.run().exit_code == 0  # steps 0-3 done and committed

    def second_life(*overrides):
        controller, layout, engines = make_controller(tmp_path, World(), *overrides)
        controller.supervisor_restarted = True
        return controller.run(), layout

    result, layout = second_life("recover.retries=0")  # no retry left: stop, and keep every logged step
    assert result.exit_code == ExitCode.FAILED and "retries exhausted (0/0)" in result.message
    assert [r["global_step"] for r in read_jsonl(layout.stats_log)] == list(range(4))
    result, layout = second_life("recover.retries=1")  # one retry: rebuild from disk and finish
    assert result.exit_code == 0, result.message
    assert_complete_and_exact(layout, clean[0])
    result, layout = second_life("recover.retries=0")  # a restart after the last commit trains nothing more
    assert result.exit_code == 0 and "already complete" in result.message
    assert_complete_and_exact(layout, clean[0])
    failures = [e for e in read_jsonl(layout.events_log) if e["event"] == "failure"]
    assert [(e["cause"], e["global_step"]) for e in failures] == [("supervisor_died", 4)] * 2


def test_a_restarted_supervisor_spends_what_is_left_of_the_budget_and_keeps_the_backoff(tmp_path):
    """Two rank deaths in a row (restarts 1 and 2, backoff 0 s then 1 s), then the Supervisor dies: its new
    life rebuilds the policy from the events, so its own restart is the third of the crash loop (2 s), and the
    next fault finds the budget spent."""
    world = World()
    world.armed[("train", 2)] = world.armed[("train", 3)] = "rank_death"
    overrides = ["total_train_epochs=1", "recover.retries=3", "recover.backoff_secs=1"]
    controller, layout, _ = make_controller(tmp_path, world, *overrides)
    assert controller.run().exit_code == 0
    world = World()
    world.armed[("train", 5)] = "rank_death"  # in the second epoch, which the second life trains
    controller, layout, _ = make_controller(tmp_path, world, "total_train_epochs=2", *overrides[1:])
    controller.supervisor_restarted = True
    result = controller.run()
    restarts = [(e["cause"], e["n"], e["delay_secs"]) for e in read_jsonl(layout.events_log) if e["event"] == "restart"]
    assert restarts == [("worker_died", 1, 0.0), ("worker_died", 2, 1.0), ("supervisor_died", 3, 2.0)]
    assert result.exit_code == ExitCode.FAILED and "retries exhausted (3/3)" in result.message


@pytest.mark.parametrize("state, outcome, expected", [
    (State.STARTING, Outcome.OK, State.RUNNING),
    (State.STARTING, Outcome.DONE, State.FINISHED),      # the checkpoint is already the last step
    (State.STARTING, Outcome.FAULT, State.REPAIRING),
    (State.RUNNING, Outcome.OK, State.RUNNING),
    (State.RUNNING, Outcome.DONE, State.FINISHED),
    (State.RUNNING, Outcome.FAULT, State.REPAIRING),
    (State.REPAIRING, Outcome.OK, State.RUNNING),
    (State.REPAIRING, Outcome.FAULT, State.REPAIRING),    # a fault while repairing: decided again
    (State.RUNNING, Outcome.FATAL, State.FAILED),
    (State.REPAIRING, Outcome.FATAL, State.FAILED),
    (State.RUNNING, Outcome.TERMINATED, State.TERMINATED),  # SIGTERM, at a step boundary
])
def test_transitions(state, outcome, expected):
    assert transition(state, Result(outcome)) is expected


@pytest.mark.parametrize("state, outcome", [
    (State.FINISHED, Outcome.OK), (State.FAILED, Outcome.FAULT), (State.TERMINATED, Outcome.OK),  # terminal
    (State.REPAIRING, Outcome.DONE),                               # a repair never finishes the run
])
def test_unexpected_transitions_raise(state, outcome):
    with pytest.raises(UnexpectedState):
        transition(state, Result(outcome))



def test_an_auto_interval_follows_the_save_cost_and_the_failures(tmp_path, clean):
    world = World()
    world.armed[("train", 5)] = "rank_death"
    result, layout, engines, controller = run(tmp_path, world, "recover.freq_secs=auto", "recover.freq_steps=null")
    assert result.exit_code == 0, result.message
    events = read_jsonl(layout.events_log)
    intervals = [e for e in events if e["event"] == "recover_interval"]
    assert intervals[0]["save_cost_secs"] is None and intervals[0]["secs"] == 10.0  # first save not measured yet
    commits = [e["global_step"] for e in events if e["event"] == "commit"]
    assert commits[-1] == STEPS - 1  # the last step always saves
    assert controller.runner.interval.failures == 1


class FakePool:
    """A warm spare pool seen from the controller: taken by the TrainGroup, refilled by the controller."""

    def __init__(self, size: int):
        self.size, self.ready, self.refills = size, 0, []
        self.dropped = 0  # holders the memory tier dropped (none here)

    def __len__(self):
        return self.ready

    def take(self, n: int) -> int:
        taken = min(n, self.ready)
        self.ready -= taken
        return taken

    def refill(self, avoid, placed=()):
        self.refills.append(list(avoid))
        started = ["n2"] * (self.size - self.ready)
        self.ready = self.size
        return started

    def make_room(self, n: int, keep=frozenset(), reserve=0, last=frozenset(), freed=0) -> int:
        return 0  # the stand-in cluster always has room for a replaced engine

    def shutdown(self):
        self.ready = 0


def use_pool(controller, world: World, pool) -> None:
    """Give the controller a spare pool: every new TrainGroup takes its ranks from it first."""
    def make_train_group(n):
        group = FakeTrainers(world, n)
        group.from_spares = pool.take(n)
        return group

    controller.make_train_group, controller.pools = make_train_group, {RoleName.ACTOR: pool}


def test_a_restart_takes_spares_first_and_the_pool_is_refilled_after_the_next_step(tmp_path, clean):
    world, pool = World(), FakePool(1)
    world.armed[("train", 3)] = "rank_death"
    controller, layout, _ = make_controller(tmp_path, world)
    use_pool(controller, world, pool)
    assert controller.run().exit_code == 0
    assert_complete_and_exact(layout, clean[0])
    spares = [(e["action"], e.get("taken"), e.get("cold"), e["pool"])
              for e in read_jsonl(layout.events_log) if e["event"] == "spares"]
    # the first group starts cold; the pool fills after its first step; the repair from disk takes the spare for
    # the dead rank, the other keeps its process; the pool is full again after the next step
    assert spares == [("taken", 0, 2, 0), ("refilled", None, None, 1),
                      ("taken", 1, 0, 0), ("refilled", None, None, 1)]
    assert pool.refills == [["n1", "n1"], ["n1", "n1"]]  # away from the ranks' nodes
    assert len(pool) == 0  # the pool is shut down with the job


def test_a_run_whose_recover_info_went_missing_stops_with_exit_2_and_keeps_its_checkpoints(tmp_path):
    import shutil

    controller, layout, _ = make_controller(tmp_path, World(), "total_train_epochs=1")
    assert controller.run().exit_code == 0
    steps = sorted(p.name for p in layout.recover_checkpoint.glob("globalstep*"))
    shutil.rmtree(layout.recover_info)
    controller, layout, _ = make_controller(tmp_path, World(), "total_train_epochs=1")
    result = controller.run()
    assert result.exit_code == 2 and str(layout.recover_info) in result.message and "clean-restart" in result.message
    assert sorted(p.name for p in layout.recover_checkpoint.glob("globalstep*")) == steps


def test_a_runtime_env_failure_fails_the_first_start_and_is_retried_after_it(tmp_path, clean):
    world = World()
    world.armed[("resync", -1)] = "runtime_env"  # the job's own env is broken: nothing ever started
    result, layout, *_ = run(tmp_path / "first", world)
    assert result.exit_code == ExitCode.FAILED and "runtime env could not be set up" in result.message
    world = World()
    world.armed[("rollout", 5)] = "runtime_env"  # a replacement node's transient failure, after the start
    result, layout, *_ = run(tmp_path / "later", world)
    assert result.exit_code == 0, result.message
    assert_complete_and_exact(layout, clean[0])
    restarts = [e for e in read_jsonl(layout.events_log) if e["event"] == "restart"]
    assert [(e["cause"], e["what"]) for e in restarts] == [("runtime_env_failed", "restart_engines")]


class FlakyPool(FakePool):
    """A pool whose upkeep meets GCS errors: the first refill and every make_room raise."""

    def refill(self, avoid, placed=()):
        if not self.refills:
            self.refills.append(None)
            raise rex.RaySystemError("GCS unavailable: failed to get cluster resources")
        return super().refill(avoid)

    def make_room(self, n: int, keep=frozenset(), reserve=0, last=frozenset(), freed=0) -> int:
        raise rex.RaySystemError("GCS unavailable: failed to get available resources")


def test_the_spare_pools_upkeep_fails_soft_and_is_retried(tmp_path, clean):
    world, pool = World(), FlakyPool(1)
    world.armed[("rollout", 5)] = "engine_death"  # the engine restart asks the pool to make room
    controller, layout, _ = make_controller(tmp_path, world)
    use_pool(controller, world, pool)
    assert controller.run().exit_code == 0
    assert_complete_and_exact(layout, clean[0])  # nothing rolled back: one TrainGroup, one engine restart
    events = read_jsonl(layout.events_log)
    assert world.train_groups == 1
    assert [(e["cause"], e["what"]) for e in events if e["event"] == "restart"] == [("engine_died", "restart_engines")]
    warnings = [e["message"] for e in events if e["event"] == "warning"]
    assert len(warnings) == 2 and "refilling the spare pool failed" in warnings[0]
    assert "making room for the engines failed" in warnings[1]
    assert [e["pool"] for e in events if e["event"] == "spares" and e["action"] == "refilled"] == [1]  # retried


def test_a_node_with_a_rank_and_an_engine_is_one_incident_and_one_retry(tmp_path, clean):
    world = World()
    world.armed[("rollout", 5)] = "engine_death"           # the node's engine is seen first
    world.then = [(("weights", 4), "rank_death")]         # its rank while the engines are resynced
    result, layout, *_ = run(tmp_path, world, "recover.retries=1")
    assert result.exit_code == 0, result.message
    assert_complete_and_exact(layout, clean[0])
    events = read_jsonl(layout.events_log)
    assert [(e["event"], e["cause"], e["what"]) for e in events if e["event"] in ("restart", "repair")] == [
        ("restart", "engine_died", "restart_engines"), ("repair", "worker_died", "restart_train_group")]
    assert (world.train_groups, world.regroups) == (1, 1)  # Ray has its node alive here: the survivor stays


def test_before_the_first_checkpoint_and_when_the_regroup_fails_every_rank_starts_again(tmp_path, clean):
    """A survivor keeps its process only where it can load a checkpoint and the new group forms: a rank dead
    before the first commit restarts the whole group from the initial weights; a regroup that fails (a
    rendezvous that times out) is followed, in the same repair, by a restart of every rank."""
    world = World()
    world.armed[("train", 0)] = "rank_death"
    result, layout, *_ = run(tmp_path / "first", world)
    assert result.exit_code == 0, result.message
    assert_complete_and_exact(layout, clean[0])
    assert (world.train_groups, world.regroups) == (2, 0)
    assert [e["kept"] for e in read_jsonl(layout.events_log) if e["event"] == "loaded"] == [[], []]

    world = World()
    world.armed[("train", 4)] = "rank_death"

    def regroup(lost, spares):
        world.regroups += 1
        raise GroupError(Group.TRAIN, rex.GetTimeoutError("no answer"), ("TrainWorker[rank 0]",), "n1", 60.0)

    controller, layout, _ = make_controller(tmp_path / "failed", world)
    make_train_group = controller.make_train_group

    def make_group(n):
        group = make_train_group(n)
        group.regroup = regroup
        return group

    controller.make_train_group = make_group
    result = controller.run()
    assert result.exit_code == 0, result.message
    assert_complete_and_exact(layout, clean[0])
    assert (world.train_groups, world.regroups) == (2, 1)
    assert any("keeping the ranks that answered failed: GroupError" in e.get("message", "")
               for e in read_jsonl(layout.events_log) if e["event"] == "warning")
    assert [e["what"] for e in read_jsonl(layout.events_log) if e["event"] == "restart"] == ["restart_train_group"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_run_whose_lock_is_no_longer_surely_its_own_commits_nothing_more_and_stops(tmp_path, mode):
    """The Supervisor checks the trial's lock before each commit (its driver frozen, say): once the check fails,
    the run ends at once, failed, naming why, with no restart and no later commit."""
    from supervisor.checkpoint.trial_lock import LockLost

    world = World()
    controller, layout, _ = make_controller(tmp_path, world, f"recover.write_mode={mode}")
    commits = []

    def fence():
        commits.append(1)
        if len(commits) == 3:
            raise LockLost("run.lock was not refreshed by this run's driver for 45 s")

    controller.checkpoints.fence = fence
    result = controller.run()
    assert result.exit_code == ExitCode.FAILED and "not refreshed by this run's driver" in result.message
    events = read_jsonl(layout.events_log)
    assert len([e for e in events if e["event"] == "commit"]) == 2
    assert not [e for e in events if e["event"] in ("restart", "failure")]


def test_the_supervisors_own_commit_failing_on_a_full_disk_skips_that_background_save(tmp_path):
    """The ranks wrote the background save, but publishing it (recover_info, manifest: the Supervisor's own
    writes) hits a full disk: that save is skipped as a failed background save, and the run trains on."""
    world = World()
    controller, layout, _ = make_controller(tmp_path, world, "recover.write_mode=async")
    store, commit = controller.checkpoints.store, controller.checkpoints.store.commit

    def full_disk_at_step_3(path, global_step, *args, **kwargs):
        if global_step == 3 and not getattr(store, "failed_once", False):
            store.failed_once = True
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return commit(path, global_step, *args, **kwargs)

    store.commit = full_disk_at_step_3
    result = controller.run()
    assert result.exit_code == 0, result.message
    events = read_jsonl(layout.events_log)
    assert [(e["global_step"], e["what"]) for e in events if e["event"] == "save_failed"] == \
        [(3, "background save")]
    assert [e["global_step"] for e in events if e["event"] == "commit"] == [1, 5, 7]
    assert not [e for e in events if e["event"] == "restart"]
    assert final_history(layout) == list(range(STEPS))


class SparedEngines(FakeEngines):
    """Engines with a warm spare pool: `refill` starts one spare (noting the step of the last rollout), a
    replacement takes spares first."""

    def __init__(self, world: World):
        super().__init__(world)
        self.refills: list[int] = []

    def refill(self) -> int:
        self.refills.append(self.generated[-1][0])
        self.spares.append("spare")
        return 1

    def replace(self, faulty):
        replaced = super().replace(faulty)
        self.from_spares = min(len(replaced), len(self.spares))
        del self.spares[:self.from_spares]
        return replaced


def test_spare_engines_start_after_the_first_step_and_after_a_repair_never_during_one(tmp_path, clean):
    world = World()
    world.armed[("rollout", 5)] = "engine_death"
    controller, layout, _ = make_controller(tmp_path, world, "rollout.spare_engines=1")
    engines = SparedEngines(world)
    controller.make_rollout_group = lambda: engines
    assert controller.run().exit_code == 0
    assert_complete_and_exact(layout, clean[0])
    # once step 0 completed, then once step 5 (in flight at the fault) completed again: not while repairing
    assert engines.refills == [0, 5]
    events = read_jsonl(layout.events_log)
    assert [e["from_spares"] for e in events if e["event"] == "engines_restarted"] == [1]
    assert [(e["kind"], e["started"], e["pool"], e["size"]) for e in events if e["event"] == "spares"] == \
        [("engine", 1, 1, 1)] * 2


def test_a_drain_notice_moves_the_engines_off_their_node_at_a_step_boundary_and_spends_no_retry(tmp_path, clean):
    """Drain notices arrive after step 2: for the engines' node (replaced and resynced before step 3, nothing
    trained again), for the ranks' node (the memory tier does not serve here: they stay, and the event says why)
    and for a node the job does not use (nothing)."""
    world = World()
    controller, layout, engines = make_controller(tmp_path, world)
    at = lambda: controller.runner.state.step.global_step  # noqa: E731
    deadline = time.time() + 60
    polls = iter(range(0, 10**6, 10))  # every boundary polls
    controller.drains = DrainWatch(source=lambda: {"n0": deadline, "n1": None, "n9": deadline} if at() >= 2 else {},
                                   clock=lambda: next(polls))
    result = controller.run()
    assert result.exit_code == 0, result.message
    assert_complete_and_exact(layout, clean[0])
    events = read_jsonl(layout.events_log)
    assert not [e for e in events if e["event"] in ("failure", "restart", "repair")]
    moved = [(e["node"], e["global_step"], e["engines"], e["ranks"], e["fallback"]) for e in events
             if e["event"] == "preemption"]
    assert moved[0] == ("n0", 2, ["RolloutWorker[0]", "RolloutWorker[1]"], [], None)
    assert moved[1][:4] == ("n1", 2, [], []) and moved[1][4] == \
        "ranks [0, 1] stay until the node goes (these tests have no memory tier), then recover as from its loss"
    assert len(moved) == 2
    recovery = [e for e in events if e["event"] == "recovery"]
    assert [(e["cause"], e["global_step"], e["replayed_steps"]) for e in recovery] == [("preemption", 3, 0)]
    assert sorted(set(engines.generated)) == sorted(set(clean[1]))


def test_a_handoff_that_fails_is_repaired_as_a_fault_once_and_the_run_ends_exact(tmp_path, clean, monkeypatch):
    """The engines' node drains after step 2 and the engine that should take engine 0's place dies as it starts:
    the handoff's error is a fault like any other (a `failure`, a repair of the engines, one retry spent), the
    step trained next is not trained twice, and the run ends exact. The node is acted on again at the next step
    boundary: what it still holds moves then."""
    from supervisor.cluster.errors import Group, GroupError

    world = World()
    controller, layout, engines = make_controller(tmp_path, world)
    at = lambda: controller.runner.state.step.global_step  # noqa: E731
    polls = iter(range(0, 10**6, 10))
    controller.drains = DrainWatch(source=lambda: {"n0": time.time() + 60} if at() >= 2 else {},
                                   clock=lambda: next(polls))
    replace, failed = type(engines).replace, []

    def dies_once(self, faulty):
        if faulty and not failed:
            failed.append(faulty)
            world.dead_engines.add(0)
            raise GroupError(Group.ROLLOUT, rex.ActorDiedError(), ("RolloutWorker[0]",), "n2", 0.1)  # as it started
        return replace(self, faulty)

    monkeypatch.setattr(type(engines), "replace", dies_once)
    result = controller.run()
    assert result.exit_code == 0, result.message
    assert_complete_and_exact(layout, clean[0])
    events = read_jsonl(layout.events_log)
    assert failed and [(e["group"], e["global_step"]) for e in events if e["event"] == "failure"] == [("rollout", 3)]
    assert [e["what"] for e in events if e["event"] == "restart"] == ["restart_engines"]
    assert [r["global_step"] for r in read_jsonl(layout.stats_log)] == list(range(len(clean[0])))
    assert [e["node"] for e in events if e["event"] == "preemption"] == ["n0"]  # the second handoff


@pytest.mark.parametrize("at, full", [(2, False), (3, False), (4, False), (4, True)])
def test_a_stop_asked_for_ends_at_the_next_step_boundary_saved_there_and_the_same_command_resumes_exact(
        tmp_path, clean, at, full, monkeypatch):
    """SIGTERM to the driver: the run stops after the step in flight, with that step saved (2, 4: not a save step;
    3: its own background save, committed first), exit 143; run again, it resumes after it and ends exact. A disk
    full at that save (`full`) keeps the last checkpoint, and the stop is still a stop."""
    world = World()
    controller, layout, engines = make_controller(tmp_path, world)
    train = FakeTrainers.train

    def asked_while_training(self, shards, global_step):
        if global_step == at:
            controller.stop_requested = "SIGTERM"
            world.storage_full = full
        return train(self, shards, global_step)

    monkeypatch.setattr(FakeTrainers, "train", asked_while_training)
    result = controller.run()
    monkeypatch.undo()
    assert result.exit_code == ExitCode.TERMINATED and controller.state is State.TERMINATED
    events = read_jsonl(layout.events_log)
    kept = max(e["global_step"] for e in events if e["event"] == "commit")
    where = f"the last checkpoint is global step {kept}" if full else f"saved at global step {at}"
    assert result.message == f"stopped by SIGTERM after global step {at} ({where}); the same command resumes"
    assert (kept < at) == full == any("the save before the stop failed: GroupError" in e.get("message", "")
                                      for e in events if e["event"] == "warning")
    assert [(e["global_step"], e["signal"]) for e in events if e["event"] == "interrupted"] == [(kept, "SIGTERM")]
    assert [r["global_step"] for r in read_jsonl(layout.stats_log)] == list(range(at + 1))
    result, layout, engines, _ = run(tmp_path, World())
    assert result.exit_code == 0, result.message
    assert_complete_and_exact(layout, clean[0])
    assert [e["global_step"] for e in read_jsonl(layout.events_log) if e["event"] == "loaded"] == [-1, kept]
