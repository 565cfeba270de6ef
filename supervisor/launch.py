"""The driver: lock the trial, connect to (or start) a Ray cluster, start the Supervisor actor, follow it to the end.

The driver holds the trial's lock (checkpoint/trial_lock.py) for the whole run, so a second run of the trial,
from any cluster or machine sharing the fileroot, is refused before it touches anything. It holds no state of the
run; it shows a progress bar from the Supervisor's answers, has Ray restart a
Supervisor that hangs (control/watchdog.py), and turns the result into an exit code. The Supervisor is a named
actor (`relaunch/{experiment}/{trial}`), so one trial can never have two controllers on a cluster, and
`relaunch status` can find it.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import uuid
from unittest import mock

import ray
import ray._private.ray_constants
import ray._private.utils
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from supervisor.checkpoint.layout import TrialLayout
from supervisor.checkpoint.trial_lock import TrialLock, TrialLocked, trial_lock
from supervisor.config import RECOVERY_OFF, REPO_ROOT, Config
from supervisor.control.actor import NAMESPACE, Supervisor, supervisor_name
from supervisor.control.policy import budget
from supervisor.control.trackers import ENV_VARS as WANDB_ENV_VARS
from supervisor.control.watchdog import Watchdog
from supervisor.exit_codes import ExitCode
from supervisor.progress import RunProgress
from supervisor.testing.fault_points import ENV_VARS as FAULT_ENV_VARS


def _runtime_env() -> dict:
    """What every actor inherits from the driver: import paths, W&B's settings, and armed fault points (tests
    only)."""
    paths = [os.getcwd(), str(REPO_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
    env.update({k: os.environ[k] for k in FAULT_ENV_VARS + WANDB_ENV_VARS if k in os.environ})
    return {"env_vars": env}


class Terminated(KeyboardInterrupt):
    """SIGTERM to the driver (`ray job stop`, a driver that is its container's main process evicted): the run stops
    at the next step boundary, saved there, within recover.term_grace_secs (`_stop`)."""


class Termination:
    """SIGTERM, noted by its handler (an exception raised there, inside Ray's waits, comes out as Ctrl-C): when it
    came, and the Supervisor told at once by a thread of its own, so that the stop lands at the next step boundary
    whatever the driver's loop is waiting on."""

    def __init__(self):
        self.at: float | None = None
        self.noted = threading.Event()

    def handler(self, signum, frame) -> None:
        if self.at is None:
            self.at = time.monotonic()
        self.noted.set()

    def forward(self, supervisor) -> None:
        def tell() -> None:
            self.noted.wait()
            try:
                supervisor.stop.remote("SIGTERM")
            except Exception:  # noqa: BLE001 - Ray already shut down: the driver ends the run itself
                pass
        threading.Thread(target=tell, daemon=True, name="sigterm").start()

    def left(self, grace: float) -> float:
        return max(grace - (time.monotonic() - self.at), 0.0)


def _interrupted(e: KeyboardInterrupt) -> int:
    return ExitCode.TERMINATED if isinstance(e, Terminated) else ExitCode.INTERRUPTED


class ClusterUnreachable(Exception):
    """The cluster at --address does not answer, or refuses us; the message says which and what to do."""


def gcs_endpoint(address: str) -> tuple[str, int] | None:
    """Pure: (host, port) of a plain `host:port` GCS address, the one form a socket can probe; None for
    `auto`, `local`, `ray://...` and the like, which Ray resolves itself."""
    host, sep, port = address.rpartition(":")
    if not sep or "/" in address or not port.isdigit():
        return None
    return host.strip("[]"), int(port)  # [::1]:6379 -> ::1


def probe(address: str, timeout: float = 5.0) -> None:
    """Fail fast, in one line, where ray.init would retry an unreachable GCS for minutes."""
    endpoint = gcs_endpoint(address)
    if endpoint is None:
        return
    try:
        socket.create_connection(endpoint, timeout=timeout).close()
    except OSError as e:
        raise ClusterUnreachable(f"--address {address}: no Ray cluster answers there ({e.strerror or e}); "
                                 "start one (docs/cli.md), or leave --address out for a Ray of the job's own") from e


def connect(config: Config, address: str | None) -> None:
    if address:
        # Inside a submitted Ray job the job's runtime env (working dir, env vars) already reaches every actor.
        in_ray_job = "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ
        try:
            _init(address=address, namespace=NAMESPACE, runtime_env=None if in_ray_job else _runtime_env())
        except (ConnectionError, ray.exceptions.AuthenticationError) as e:
            raise ClusterUnreachable(f"--address {address}: {str(e).strip().splitlines()[0]}") from e
        return
    cluster = config.cluster
    needed = (config.train_ranks + cluster.n_rollout_workers) * cluster.cpus_per_worker
    # "local": a Ray of the job's own, even where another cluster on this machine left its address file
    # (a plain ray.init() would join that cluster, and refuse num_cpus there)
    _init(address="local", num_cpus=max(int(needed + 0.999), os.cpu_count() or 1), namespace=NAMESPACE,
          include_dashboard=False, runtime_env=_runtime_env(), object_store_memory=512 * 1024**2)


def _init(**kwargs) -> None:
    """ray.init without the two SIGTERM handlers it would put in the driver. Its own (`sys.exit(15)`) raises
    wherever the driver happens to be, and where Python ignores exceptions (logging's at-fork hook, as Ray starts
    its processes) the SIGTERM was lost and the run went on. Its core worker's crash handler prints a stack and
    aborts the driver 3 s after a SIGTERM (an alarm it never cancels). The driver's own handler stays in place and
    only notes the signal; the run stops once ray.init returns, as at any other time. It is put back after, in case
    a Ray to come puts its handlers in another way."""
    handler = signal.getsignal(signal.SIGTERM)
    with mock.patch.object(ray._private.utils, "set_sigterm_handler", lambda _: None), \
            mock.patch.object(ray._private.ray_constants, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER", True):
        ray.init(**kwargs)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def run_job(config: Config, address: str | None) -> int:
    if not config.recover.mode.enabled:
        print(f"relaunch: warning: {RECOVERY_OFF.format(mode=config.recover.mode.value)}", file=sys.stderr)
    lock = trial_lock(TrialLayout.from_config(config))
    term = Termination()
    previous = signal.signal(signal.SIGTERM, term.handler)  # from here on a SIGTERM is a stop, never a bare exit
    try:
        try:
            if address:
                probe(address)
            taken_over = lock.acquire()
        except (ClusterUnreachable, TrialLocked) as e:
            print(f"relaunch: error: {e}", file=sys.stderr)
            return ExitCode.BAD_INPUT
        except OSError as e:  # the lock's disk or store failed it: nothing has started
            print(f"relaunch: error: cannot take the trial's lock {lock.path}: {e}", file=sys.stderr)
            return ExitCode.BAD_INPUT
        try:
            if taken_over:
                print(f"relaunch: {taken_over}", file=sys.stderr)
            return _run_locked(config, address, lock, term)
        except ClusterUnreachable as e:
            print(f"relaunch: error: {e}", file=sys.stderr)
            return ExitCode.BAD_INPUT
        except Terminated:  # before the Supervisor started: nothing ran
            ray.shutdown()
            print("relaunch: stopped by SIGTERM while starting, before any step; the last valid checkpoint is kept "
                  "and the same command resumes", file=sys.stderr)
            return ExitCode.TERMINATED
        except KeyboardInterrupt:  # while Ray started, before the run was followed
            ray.shutdown()
            print("relaunch: interrupted while starting; the last valid checkpoint is kept", file=sys.stderr)
            return ExitCode.INTERRUPTED
        finally:
            lock.release()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_locked(config: Config, address: str | None, lock: TrialLock, term: Termination) -> int:
    if term.noted.is_set():  # while the lock was taken
        raise Terminated()
    connect(config, address)
    if term.noted.is_set():  # while Ray connected
        raise Terminated()
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
        job = uuid.uuid4().hex[:12]
        supervisor = Supervisor.options(
            name=name, namespace=NAMESPACE, max_restarts=backstop, max_task_retries=backstop,
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
        ).remote(config, job, lock.holder.token)
        progress = RunProgress(TrialLayout.from_config(config), job)
        try:
            # Ray spends a task's retries on each restart of its actor and on each push its stopped actor left
            # unanswered, apart from the actor's restarts: a Supervisor SIGSTOPped again and again while starting
            # spent the run's retries first (ActorUnavailableError) and was lost while it had restarts left.
            # The run is retried as long as the Supervisor lives; its max_restarts stays the one backstop.
            run = supervisor.run.options(max_task_retries=-1).remote()
            term.forward(supervisor)
            try:
                result = _follow(supervisor, run, Watchdog.from_config(config, time.monotonic()), progress, lock,
                                 term)
            except Terminated:
                result = _stop(run, term.left(config.recover.term_grace_secs))
                if result is None:
                    raise
        except KeyboardInterrupt as e:
            # Leaving Ray ends the Supervisor and its workers (their owner is gone) without the "will be
            # retried" line that killing the actor under a pending task makes Ray print.
            ray.shutdown()
            print(progress.interrupted(), file=sys.stderr)
            return _interrupted(e)
    finally:
        ray.shutdown()
    if result["details"]:
        print(result["details"], file=sys.stderr, end="")
    code = result["exit_code"]
    if code == 0:
        reward = f", last mean reward {result['reward']:.3f}" if result["reward"] is not None else ""
        print(f"relaunch: {result['message']} (global step {result['global_step']}{reward})")
    elif code == ExitCode.TERMINATED:
        print(f"relaunch: {result['message']}", file=sys.stderr)
    else:
        print(f"relaunch: failed: {result['message']}", file=sys.stderr)
    return code


def _follow(supervisor, run_ref, watchdog: Watchdog, progress: RunProgress, lock: TrialLock,
            term: Termination) -> dict:
    """Wait for the run, drawing a progress bar from the Supervisor's progress answers; have Ray restart a
    Supervisor that the watchdog finds hung (it rebuilds from disk and counts the restart); end the run once
    its trial's lock is another run's (two runs must never write one trial)."""
    try:
        while True:
            done = []
            for _ in range(5):  # a second in slices: a signal's handler runs only between them, in this thread
                done, _ = ray.wait([run_ref], timeout=0.2)
                if done or term.noted.is_set():
                    break
            if done:
                break
            if term.noted.is_set():
                raise Terminated()
            if lock.lost:
                ray.kill(supervisor, no_restart=True)
                return {"exit_code": ExitCode.FAILED, "message": f"stopped: {lock.lost}", "global_step": -1,
                        "reward": None, "details": ""}
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
            progress.show(p)
        try:
            return ray.get(run_ref)
        except ray.exceptions.RayError as e:
            return {"exit_code": ExitCode.FAILED, "message": f"the Supervisor was lost: {str(e).splitlines()[0]}",
                    "global_step": -1, "reward": None, "details": ""}
    finally:
        progress.close()


def _stop(run_ref, left: float) -> dict | None:
    """SIGTERM (the Supervisor was told at once, `Termination.forward`): its result once it ended the run at the
    next step boundary, saved there, or None when it did not in the `left` seconds of the grace (the step in
    flight is then abandoned, the last commit kept)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second notice changes nothing: the bound is set
    print(f"[relaunch] SIGTERM: stopping at the next step boundary, within {left:.0f}s", file=sys.stderr, flush=True)
    try:
        done, _ = ray.wait([run_ref], timeout=left)
        return ray.get(run_ref) if done else None
    except ray.exceptions.RayError:
        return None


def _alive(supervisor) -> bool:
    """Whether Ray has the Supervisor running (not dead, not being restarted); True when it cannot tell."""
    try:
        return ray._private.state.actors(supervisor._actor_id.hex()).get("State", "ALIVE") == "ALIVE"
    except Exception:  # noqa: BLE001 - no answer from the GCS: do not take that for the Supervisor's death
        return True
