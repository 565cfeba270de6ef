"""The driver: connect to (or start) a Ray cluster, start the Supervisor actor, follow it to the end.

The driver holds no state of the run; it shows a progress bar from the Supervisor's answers, has Ray restart a
Supervisor that hangs (control/watchdog.py), and turns the result into an exit code. The Supervisor is a named
actor (`relaunch/{experiment}/{trial}`), so one trial can never have two controllers on a cluster, and
`relaunch status` can find it.
"""
from __future__ import annotations

import os
import sys
import time
import uuid

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from tqdm import tqdm

from supervisor.config import REPO_ROOT, Config
from supervisor.control.actor import NAMESPACE, Supervisor, supervisor_name
from supervisor.control.policy import budget
from supervisor.control.watchdog import Watchdog
from supervisor.exit_codes import ExitCode
from supervisor.testing.fault_points import ENV_VARS as FAULT_ENV_VARS


def _runtime_env() -> dict:
    """What every actor inherits from the driver: import paths, and armed fault points (tests only)."""
    paths = [os.getcwd(), str(REPO_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
    env.update({k: os.environ[k] for k in FAULT_ENV_VARS if k in os.environ})
    return {"env_vars": env}


def connect(config: Config, address: str | None) -> None:
    if address:
        # Inside a submitted Ray job the job's runtime env (working dir, env vars) already reaches every actor.
        in_ray_job = "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ
        ray.init(address=address, namespace=NAMESPACE, runtime_env=None if in_ray_job else _runtime_env())
        return
    cluster = config.cluster
    needed = (cluster.n_train_workers + cluster.n_rollout_workers) * cluster.cpus_per_worker
    # "local": a Ray of the job's own, even where another cluster on this machine left its address file
    # (a plain ray.init() would join that cluster, and refuse num_cpus there)
    ray.init(address="local", num_cpus=max(int(needed + 0.999), os.cpu_count() or 1), namespace=NAMESPACE,
             include_dashboard=False, runtime_env=_runtime_env(), object_store_memory=512 * 1024**2)


def run_job(config: Config, address: str | None) -> int:
    connect(config, address)
    try:
        name = supervisor_name(config)
        try:
            ray.get_actor(name, namespace=NAMESPACE)
            print(f"relaunch: error: trial {name} is already running on this cluster", file=sys.stderr)
            return ExitCode.BAD_INPUT
        except ValueError:
            pass
        # The restart policy counts the Supervisor's own restarts against recover.retries and gives up once
        # they are spent; Ray's limit is only a backstop one above it, never a second budget.
        backstop = budget(config) + 1
        supervisor = Supervisor.options(
            name=name, namespace=NAMESPACE, max_restarts=backstop, max_task_retries=backstop,
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
        ).remote(config, uuid.uuid4().hex[:12])
        try:
            result = _follow(supervisor, supervisor.run.remote(), Watchdog.from_config(config, time.monotonic()))
        except KeyboardInterrupt:
            ray.kill(supervisor, no_restart=True)
            print("relaunch: interrupted; the last valid checkpoint is kept", file=sys.stderr)
            return ExitCode.INTERRUPTED
    finally:
        ray.shutdown()
    if result["details"]:
        print(result["details"], file=sys.stderr, end="")
    code = result["exit_code"]
    if code == 0:
        reward = f", last mean reward {result['reward']:.3f}" if result["reward"] is not None else ""
        print(f"relaunch: {result['message']} (global step {result['global_step']}{reward})")
    else:
        print(f"relaunch: failed: {result['message']}", file=sys.stderr)
    return code


def _follow(supervisor, run_ref, watchdog: Watchdog) -> dict:
    """Wait for the run, drawing a progress bar from the Supervisor's progress answers; have Ray restart a
    Supervisor that the watchdog finds hung (it rebuilds from disk and counts the restart)."""
    bar = tqdm(desc="relaunch", unit="step", mininterval=1.0, dynamic_ncols=True, file=sys.stderr)
    try:
        while True:
            done, _ = ray.wait([run_ref], timeout=1.0)
            if done:
                break
            try:
                p = ray.get(supervisor.progress.remote(), timeout=5)
            except Exception:  # noqa: BLE001 - restarting, or hung: the watchdog tells
                p = None
            now = time.monotonic()
            hung = watchdog.verdict(now, p, alive=p is not None or _alive(supervisor))
            if hung:
                print(f"[relaunch] the Supervisor is hung: {hung}; restarting it", flush=True)
                ray.kill(supervisor, no_restart=False)
                watchdog.restarted(now)
            if p is None:
                continue
            bar.total = p["total_steps"]
            bar.n = p["global_step"] + 1
            reward = f"{p['reward']:.3f}" if p["reward"] is not None else "-"
            bar.set_postfix(phase=p["phase"], reward=reward, restarts=p["restarts"], refresh=False)
            bar.refresh()
        try:
            return ray.get(run_ref)
        except ray.exceptions.RayError as e:
            return {"exit_code": ExitCode.FAILED, "message": f"the Supervisor was lost: {str(e).splitlines()[0]}",
                    "global_step": -1, "reward": None, "details": ""}
    finally:
        bar.close()


def _alive(supervisor) -> bool:
    """Whether Ray has the Supervisor running (not dead, not being restarted); True when it cannot tell."""
    try:
        return ray._private.state.actors(supervisor._actor_id.hex()).get("State", "ALIVE") == "ALIVE"
    except Exception:  # noqa: BLE001 - no answer from the GCS: do not take that for the Supervisor's death
        return True
