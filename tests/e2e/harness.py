"""Helpers to run and break jobs on real Ray clusters, for the end-to-end tests: the job's config, the CLI
as a subprocess, a trial's files, a cluster made with `ray start`. A module of its own name (not conftest),
so that an import of it finds this file from any process, whatever other conftest.py pytest loaded last.
Processes are killed only through ids this suite started.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from supervisor.testing.local_cluster import short_tmp
from supervisor.testing.processes import kill_all, process_tree, session_members

REPO = Path(__file__).resolve().parents[2]
DEFAULT_JOB = REPO / "configs" / "tiny_grpo.yaml"


def suite_job(config: Path) -> Path:
    """`config` as the suite runs it, written beside this worker's other temp files: `rollout.engine: hf`, the
    built-in engine, no warm spares (`recover.spare_workers: 0`) and no memory tier (`recover.memory: off`). The
    suite's jobs start engines hundreds of times, and vLLM's import (10-20 s at every engine start) does not fit
    its time; the default job as shipped, on vLLM, runs in the demo, the submitted job, the documented cluster
    recipe and test_vllm_engine.py. Each job's spares cost it two more TrainWorker processes to start, and on a
    multi-node cluster its first step waits for them (the memory tier's first link); the tier's copies cost every
    step: the tests of the spares and of the memory tier ask for them (`recover.spare_workers=auto`, as shipped,
    or a number, and MEMORY_TIER), the others run without, and so test the repairs from disk."""
    raw = yaml.safe_load(config.read_text())
    raw.setdefault("rollout", {})["engine"] = "hf"
    raw.setdefault("recover", {})["spare_workers"] = 0
    raw["recover"]["memory"] = "off"
    path = Path(tempfile.mkdtemp(prefix="relaunch-cfg.")) / config.name
    path.write_text(yaml.safe_dump(raw))
    return path


CONFIG = suite_job(DEFAULT_JOB)
AS_SHIPPED_SPARES = "recover.spare_workers=auto"
MEMORY_TIER = "recover.memory=auto"  # as shipped
# The job the fault tests break: two epochs (24 steps), a recover checkpoint every 5 steps.
SHORT = ["total_train_epochs=2"]


def data_as(form: str, directory: Path) -> str:
    """The `data.path=` override of the default task's prompts written as users keep data: `parquet` (a Parquet
    file, in several record batches) or `saved` (a directory saved by HF datasets); a job reading it must reach
    the figures of the JSONL it came from."""
    from workers.data import read_prompts

    rows = read_prompts(REPO / yaml.safe_load(DEFAULT_JOB.read_text())["data"]["path"])
    if form == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = directory / "data.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=16)
    else:
        import datasets

        path = directory / "saved-dataset"
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return f"data.path={path}"


def kill_session(sid: int) -> None:
    """SIGKILL a driver started with start_new_session and its whole embedded Ray cluster."""
    kill_all(session_members(sid))


def job_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update(extra or {})
    return env


def relaunch(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "supervisor", *args], cwd=REPO, env=env or job_env(),
                          capture_output=True, text=True, timeout=timeout)


PROGRESS_BAR = re.compile(r"^\s*relaunch:\s+\d+%\|[^\]]*\]")


def log_tail(path: Path, chars: int = 3000) -> str:
    """The end of a job's log for a failed assertion, without the progress bar's redraws (a hang's minutes of
    them would fill it): what the job and its Supervisor said, the faults and repairs, up to its last line."""
    lines = [PROGRESS_BAR.sub("", x) for x in re.split(r"[\r\n]", path.read_text())]
    return "\n".join(x for x in lines if x.strip())[-chars:]


def start_relaunch(*args: str, env: dict, log: Path) -> subprocess.Popen:
    """The CLI in a session of its own, with SIGINT as a terminal's foreground job has it (a suite started from
    a background shell inherits it ignored, and the driver would never see a Ctrl-C)."""
    return subprocess.Popen([sys.executable, "-m", "supervisor", *args], cwd=REPO, env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


class Trial:
    """Paths of one trial under its own fileroot."""

    def __init__(self, fileroot: Path):
        self.fileroot = fileroot
        user = __import__("getpass").getuser()
        self.root = fileroot / "checkpoints" / user / "tiny-grpo" / "trial0"
        self.logs = fileroot / "logs" / user / "tiny-grpo" / "trial0"

    @property
    def overrides(self) -> list[str]:
        return [f"cluster.fileroot={self.fileroot}"]

    def stats(self) -> list[dict]:
        path = self.logs / "stats.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def events(self, name: str | None = None) -> list[dict]:
        path = self.logs / "events.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        return [r for r in rows if name is None or r["event"] == name]

    def exports(self) -> list[Path]:
        d = self.root / "default"
        return sorted((p for p in d.iterdir() if p.name.startswith("epoch")),
                      key=lambda p: int(p.name.rsplit("globalstep", 1)[1])) if d.exists() else []

    def final_weights(self) -> bytes:
        return (self.exports()[-1] / "model.safetensors").read_bytes()

    def final_checksum(self) -> tuple[int, str]:
        """(step, weights checksum) of the last commit: what the run really ended with (an HF export is not
        rewritten when a rollback replays its step)."""
        commit = self.events("commit")[-1]
        return commit["global_step"], commit["weights_checksum"]

    def wait_for_step(self, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.stats() and self.stats()[-1]["global_step"] >= step:
                return
            assert proc.poll() is None, f"job ended early with {proc.returncode}"
            time.sleep(0.2)
        raise TimeoutError(f"step {step} not reached")


def curve(stats: list[dict]) -> list[tuple]:
    """What must match between an interrupted and an uninterrupted run: every step's metrics."""
    return [(r["global_step"], r["reward"], r["loss"], r["grad_norm"]) for r in stats]


def metrics(stats: list[dict]) -> list[dict]:
    """Every field of every step's row (lr, kl, eval/reward, weights_version, ...) but its timings, the
    figures of its save and the peak memory, which depend on the clock, on where saves happened and on the
    processes a restart replaced."""
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "ckpt/", "mem/"))} for r in stats]


def status_json(trial: Trial, *extra: str, env: dict | None = None) -> dict:
    r = relaunch("status", str(CONFIG), *trial.overrides, *extra, "--json", env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)



class RayStartCluster:
    """A cluster made the way users make one: `ray start --head` and `ray start --address`, each started
    with --block so that the process we own is the parent of the node's raylet and workers."""

    def __init__(self):
        from supervisor.testing.local_cluster import free_port

        self.temp_dir = short_tmp("rls")
        self.port, self.dashboard_port = free_port(), free_port()
        # Token auth, Ray's default for new clusters, with a token of this cluster's own; clients given an
        # explicit address need RAY_AUTH_MODE=token. This process's Ray may have read its auth mode long
        # ago, so its own Jobs client sends the token as a header.
        self.token = secrets.token_hex(32)
        token_file = self.temp_dir / "auth_token"
        token_file.write_text(self.token)
        self.env = dict(job_env(), RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file),
                        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
        self.procs: list[subprocess.Popen] = []
        try:
            self._start_head()
        except BaseException:
            self.shutdown()
            raise

    def _start_head(self) -> None:
        from supervisor.testing.local_cluster import free_port

        self._start("--head", f"--port={self.port}", "--num-cpus=1", f"--temp-dir={self.temp_dir}",
                    "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
                    f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
                    f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
                    "--object-store-memory=150000000",
                    # a killed node refuses the checks at once: seen in 2.5 s; a node starting on two loaded
                    # cores gets 2 s an answer (at 0.5 s, three missed answers may have declared one dead as it
                    # joined: a first `add_worker` once waited 180 s in CI for a node that never stayed)
                    '--system-config={"health_check_period_ms":500,"health_check_failure_threshold":5,'
                    '"health_check_timeout_ms":2000}')
        self.gcs_address = f"127.0.0.1:{self.port}"
        self.jobs_address = f"http://127.0.0.1:{self.dashboard_port}"
        self.wait_for_jobs_api()

    def _start(self, *args: str) -> subprocess.Popen:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--block", *args],
                                env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def add_worker(self, timeout: float = 180) -> subprocess.Popen:
        """A worker node, once it has joined (told by a node name of its own: counting the nodes alive miscounts
        just after a kill, while the killed node is still alive to the head). A `ray start` whose raylet does not
        come up within Ray's fixed 30 s (seen on two loaded cores in CI: the job then waited for a node that never
        came) exits; what it left is killed, and a node of another name is started."""
        from supervisor.testing.local_cluster import free_port

        deadline, proc, name, tried = time.time() + timeout, None, "", []
        while proc is None or proc.poll() is not None or name not in self.alive_nodes():
            assert time.time() < deadline, f"a worker node did not join within {timeout:g} s (tried {tried}, " \
                f"the last one's `ray start` {'running' if proc.poll() is None else 'gone'}; the head's nodes: " \
                f"{self.nodes()})"
            if proc is None or proc.poll() is not None:  # not started yet, or its raylet gave up
                if proc is not None:
                    kill_session(proc.pid)
                name = f"worker-{len(self.procs)}"
                tried.append(name)
                proc = self._start(f"--address={self.gcs_address}", f"--node-name={name}", "--num-cpus=3",
                                   "--object-store-memory=150000000", f"--dashboard-agent-listen-port={free_port()}",
                                   f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}")
            time.sleep(0.5)
        return proc

    def alive_nodes(self) -> list[str]:
        """The names of the cluster's nodes that are up, from the head's state API (none while it does not
        answer: it is asked again)."""
        nodes = self.nodes()
        return [name for name, state in nodes.items() if state == "ALIVE"] if isinstance(nodes, dict) else []

    def nodes(self) -> dict[str, str] | str:
        """Every node the head knows, name -> state; or why the state API did not answer."""
        import requests

        try:
            r = requests.get(f"{self.jobs_address}/api/v0/nodes", headers={"Authorization": f"Bearer {self.token}"},
                             timeout=10)
            r.raise_for_status()
        except requests.RequestException as e:
            return f"no answer: {type(e).__name__}"
        return {n["node_name"]: n["state"] for n in r.json()["data"]["result"]["result"]}

    def jobs_client(self):
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(self.jobs_address, headers={"Authorization": f"Bearer {self.token}"})

    def wait_for_jobs_api(self, timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while True:
            try:
                self.jobs_client().list_jobs()
                return
            except Exception:  # noqa: BLE001 - not up yet
                if time.time() > deadline:
                    raise
                time.sleep(0.5)

    def kill(self, proc: subprocess.Popen) -> None:
        kill_all(process_tree(proc.pid))
        proc.wait()

    def shutdown(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                self.kill(proc)
