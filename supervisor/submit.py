"""`relaunch submit`: the same job through Ray's Job Submission SDK (working dir + runtime env).

The entrypoint is `python -m supervisor run CONFIG KEY=VALUE ...` on the cluster's head node, with the
current directory uploaded as the job's working dir (files ignored by git are left out). A relative
`cluster.fileroot` (and `cluster.local_root`) is made absolute here, so checkpoints land where the user expects, not inside Ray's
copy of the working dir.
"""
from __future__ import annotations

import asyncio
import math
import os
import shlex
import time
import uuid
from pathlib import Path

from supervisor.cluster.errors import first_line
from supervisor.config import Config
from supervisor.control.trackers import ENV_VARS as WANDB_ENV_VARS
from supervisor.testing.fault_points import ENV_VARS as FAULT_ENV_VARS


class SubmitError(ValueError):
    pass


def entrypoint(config_path: Path, overrides: list[str], config: Config) -> str:
    cwd = Path.cwd().resolve()
    path = config_path.resolve()
    if cwd not in path.parents:
        raise SubmitError(f"{config_path}: the config must be inside the working directory {cwd}")
    roots = ("cluster.fileroot=", "cluster.local_root=")
    args = [str(path.relative_to(cwd)), *[o for o in overrides if not o.startswith(roots)],
            f"cluster.fileroot={config.cluster.fileroot}", f"cluster.local_root={config.cluster.local_root}"]
    return "python -m supervisor run " + " ".join(shlex.quote(a) for a in args)


AGENT_WAIT_SECS = 120.0  # how long a newly started head's job agent may take to come up
RECONNECT_SECS = 1.0  # before the job's log stream is opened again, after the dashboard dropped it
STOP_SHUTDOWN_SECS = 15  # beyond recover.term_grace_secs: Ray's shutdown of the job's actors, and the driver's exit


def submit_when_ready(client, address: str, **job) -> str:
    """Submit; while a head that has just started answers "No available agent to submit job, please try again
    later" (its job agent is not up yet, though the Jobs API already answers), or drops the connection without
    an answer (its dashboard still starting, or overloaded), try again. Every try carries the same submission
    id, so a try whose answer was lost after the job was made is not a second job."""
    import requests

    job = {"submission_id": f"relaunch-{uuid.uuid4().hex[:12]}", **job}
    deadline = time.monotonic() + AGENT_WAIT_SECS
    while True:
        try:
            return client.submit_job(**job)
        except requests.exceptions.ConnectionError as e:
            if time.monotonic() > deadline:
                raise SubmitError(f"--address {address}: the Jobs API dropped the submission ({first_line(e)})") from e
        except RuntimeError as e:
            if "already exists" in str(e):  # an earlier try made it; its answer was lost
                return job["submission_id"]
            if "No available agent" not in str(e) or time.monotonic() > deadline:
                raise SubmitError(f"--address {address}: {first_line(e)}") from e
        time.sleep(2)


def submit(config_path: Path, overrides: list[str], config: Config, address: str, wait: bool) -> int:
    from ray.job_submission import JobStatus, JobSubmissionClient

    try:
        client = JobSubmissionClient(address)
    except ConnectionError as e:
        raise SubmitError(f"--address {address}: {str(e).strip().splitlines()[0]}") from e
    env = {k: os.environ[k] for k in FAULT_ENV_VARS + WANDB_ENV_VARS if k in os.environ}
    # `ray job stop` sends SIGTERM, then SIGKILL after this many seconds (Ray's default, 3, is too short for the
    # driver to stop at a step boundary and save there: recover.term_grace_secs, then Ray's shutdown)
    env["RAY_JOB_STOP_WAIT_TIME_S"] = str(math.ceil(config.recover.term_grace_secs) + STOP_SHUTDOWN_SECS)
    job_id = submit_when_ready(
        client, address, entrypoint=entrypoint(config_path, overrides, config),
        runtime_env={"working_dir": str(Path.cwd()), "env_vars": env},
        metadata={"relaunch": f"{config.experiment_name}/{config.trial_name}"},
    )
    print(f"submitted {job_id}")
    print(f"  logs:   ray job logs --follow {job_id} --address {address}")
    print(f"  status: relaunch status {config_path} {' '.join(overrides)}".rstrip())
    if not wait:
        return 0

    follow_logs(client, job_id)
    status = client.get_job_status(job_id)
    print(f"job {job_id}: {status.value}")
    return 0 if status == JobStatus.SUCCEEDED else 1


def follow_logs(client, job_id: str, sleep=time.sleep) -> None:
    """Print the job's log as it is written, until the job ends. The dashboard may drop the stream before that
    (Ray's `tail_job_logs` raises on an abnormal close, 1006, seen on a loaded head a second after a
    submission): it is opened again, and as each stream starts at the log's beginning, what was printed is
    skipped; once the job has ended, the rest of its log is read whole."""
    printed = 0

    async def stream() -> None:
        nonlocal printed
        seen = 0
        async for chunk in client.tail_job_logs(job_id):
            new = chunk[max(0, printed - seen):]
            seen += len(chunk)
            if new:
                print(new, end="", flush=True)
                printed += len(new)

    while True:
        try:
            asyncio.run(stream())
            return
        except RuntimeError as e:
            if "closed unexpectedly" not in str(e):
                raise
        if client.get_job_status(job_id).is_terminal():
            print(client.get_job_logs(job_id)[printed:], end="", flush=True)
            return
        sleep(RECONNECT_SECS)
