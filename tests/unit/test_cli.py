"""What the command line says and does on the mistakes people make, without a cluster."""
from __future__ import annotations

import os
import socket

import pytest
from click.testing import CliRunner

from supervisor.checkpoint.layout import TrialLayout
from supervisor.checkpoint.trial_lock import TrialLock
from supervisor.cli import main
from supervisor.config import DEFAULT_CONFIG, load_config
from supervisor.control.events import Event
from supervisor.launch import gcs_endpoint
from supervisor.progress import kept_step
from supervisor.submit import SubmitError, submit_when_ready
from supervisor.tools.status import TrialState, state_of


@pytest.fixture
def layout(tmp_path) -> TrialLayout:
    """A trial with recover state on disk (empty directories are enough for clean-restart)."""
    layout = TrialLayout.from_config(load_config(DEFAULT_CONFIG, [f"cluster.fileroot={tmp_path}"]))
    for p in layout.recover_state_paths():
        p.mkdir(parents=True)
    return layout


def relaunch(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize("args, option", [
    (("run", "--adress", "127.0.0.1:1"), "--adress"),
    (("status", "--adress=127.0.0.1:1"), "--adress"),
    (("clean-restart", str(DEFAULT_CONFIG), "-y"), "-y"),
])
def test_an_unknown_option_is_named_as_one(args, option):
    r = relaunch(*args)
    assert r.exit_code == 2
    assert r.output == f"relaunch: error: no such option: {option} (`main {args[0]} --help` lists the options)\n"


@pytest.mark.parametrize("args, line", [
    (("plot",), "Missing option '--out'. (`main plot --help` lists the options)"),
    (("strat",), "No such command 'strat'. Did you mean 'status'? (`main --help` lists the options)"),
    (("demo", "--kill-at-step", "soon"), "Invalid value for '--kill-at-step': 'soon' is not a valid integer. "
                                         "(`main demo --help` lists the options)"),
])
def test_clicks_own_usage_errors_are_one_line_too(args, line):
    r = relaunch(*args)
    assert (r.exit_code, r.output) == (2, f"relaunch: error: {line}\n")


def test_clean_restart_without_yes_off_a_terminal_removes_nothing_and_says_so(layout, tmp_path):
    r = relaunch("clean-restart", f"cluster.fileroot={tmp_path}")
    assert r.exit_code == 2
    assert "removing" not in r.output
    assert r.output.startswith("relaunch: error: clean-restart would delete ")
    assert all(p.exists() for p in layout.recover_state_paths())


def test_clean_restart_says_removing_only_while_it_removes(layout, tmp_path):
    dry = relaunch("clean-restart", f"cluster.fileroot={tmp_path}", "--dry-run")
    assert dry.exit_code == 0
    assert dry.output.splitlines() == [f"would remove {p}" for p in layout.recover_state_paths()]
    r = relaunch("clean-restart", f"cluster.fileroot={tmp_path}", "--yes")
    assert r.exit_code == 0
    assert r.output.splitlines() == [*(f"removing {p}" for p in layout.recover_state_paths()),
                                     "done: the next run starts at step 0"]
    assert not any(p.exists() for p in layout.recover_state_paths())
    assert not layout.lock.exists()


def test_clean_restart_of_a_live_trial_refuses_naming_the_holder(layout, tmp_path):
    with TrialLock(layout.lock):
        r = relaunch("clean-restart", f"cluster.fileroot={tmp_path}", "--yes")
    assert r.exit_code == 2
    assert r.output.startswith(f"relaunch: error: trial is already running: {layout.lock} is held by pid "
                               f"{os.getpid()} on {socket.gethostname()}")
    assert all(p.exists() for p in layout.recover_state_paths())


def test_status_of_a_trial_that_never_ran_exits_2(tmp_path):
    r = relaunch("status", f"cluster.fileroot={tmp_path}", "trial_name=misspelt")
    assert r.exit_code == 2
    assert r.output == (f"relaunch: error: no run of tiny-grpo/misspelt under {tmp_path} "
                        "(check experiment_name, trial_name and cluster.fileroot)\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("job, ended, locked, state", [
    (None, None, False, TrialState.NEVER_RUN),
    ("j", None, True, TrialState.RUNNING),
    ("j", None, False, TrialState.STOPPED),
    ("j", Event.INTERRUPTED, False, TrialState.INTERRUPTED),
    ("j", Event.DONE, True, TrialState.RUNNING),  # a new run holds the trial, before its first event
    ("j", Event.DONE, False, TrialState.DONE),
])
def test_state_of(job, ended, locked, state):
    assert state_of(job, ended, locked) == state


@pytest.mark.parametrize("events, step", [
    ([], None),
    ([{"event": "loaded", "global_step": -1}], None),
    ([{"event": "loaded", "global_step": -1}, {"event": "commit", "global_step": 9}, {"event": "state"}], 9),
    ([{"event": "commit", "global_step": 9}, {"event": "loaded", "global_step": 4}], 4),  # rolled back
])
def test_kept_step(events, step):
    assert kept_step(events) == step


@pytest.mark.parametrize("address, endpoint", [
    ("127.0.0.1:6379", ("127.0.0.1", 6379)),
    ("head.example:6379", ("head.example", 6379)),
    ("[::1]:6379", ("::1", 6379)),
    ("auto", None),
    ("ray://127.0.0.1:10001", None),  # Ray Client: Ray resolves it
    ("http://127.0.0.1:8265", None),
])
def test_gcs_endpoint(address, endpoint):
    assert gcs_endpoint(address) == endpoint


def test_run_with_an_unreachable_address_is_one_line_and_touches_nothing(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = relaunch("run", f"cluster.fileroot={tmp_path}", "--address", f"127.0.0.1:{port}")
    assert r.exit_code == 2
    assert r.output == (f"relaunch: error: --address 127.0.0.1:{port}: no Ray cluster answers there (Connection "
                        "refused); start one (docs/cli.md), or leave --address out for a Ray of the job's own\n")
    assert list(tmp_path.iterdir()) == []
    # with recovery off, the run says first that the job survives nothing (and so does plan)
    r = relaunch("run", f"cluster.fileroot={tmp_path}", "recover.mode=off", "--address", f"127.0.0.1:{port}")
    warning = "relaunch: warning: recover.mode=off: no recover checkpoint is written and no failure is survived"
    assert r.exit_code == 2 and r.output.startswith(warning), r.output
    r = relaunch("plan", f"cluster.fileroot={tmp_path}", "recover.mode=disabled")
    assert r.exit_code == 0 and "warning: recover.mode=disabled: no recover checkpoint is written" in r.output


def test_submit_of_a_live_trial_refuses_before_it_contacts_the_cluster(layout, tmp_path):
    with TrialLock(layout.lock):
        r = relaunch("submit", f"cluster.fileroot={tmp_path}", "--address", "http://127.0.0.1:1")
    assert r.exit_code == 2
    assert r.output.startswith(f"relaunch: error: trial is already running: {layout.lock} is held by pid "
                               f"{os.getpid()} on {socket.gethostname()}")


class StandInJobsClient:
    """Answers as a newly started head does: no job agent for the first `busy` submissions."""

    def __init__(self, busy: int, error: str = "Request failed with status code 500: No available agent to "
                                               "submit job, please try again later.."):
        self.busy, self.error, self.calls = busy, error, 0

    def submit_job(self, **job) -> str:
        self.calls += 1
        if self.calls <= self.busy:
            raise RuntimeError(self.error)
        return "raysubmit_1"


def test_submit_waits_for_a_new_heads_job_agent(monkeypatch):
    monkeypatch.setattr("supervisor.submit.time.sleep", lambda s: None)
    client = StandInJobsClient(busy=2)
    assert submit_when_ready(client, "http://h:8265", entrypoint="x") == "raysubmit_1"
    assert client.calls == 3


class DroppingJobsClient:
    """A head whose dashboard drops the first submission without an answer, after making the job."""

    def __init__(self):
        self.made: list[str] = []

    def submit_job(self, submission_id: str, **job) -> str:
        import requests

        if submission_id in self.made:
            raise RuntimeError(f"Request failed with status code 400: Job with submission_id {submission_id} "
                               f"already exists. Please use a different submission_id.")
        self.made.append(submission_id)
        raise requests.exceptions.ConnectionError("('Connection aborted.', RemoteDisconnected('Remote end closed "
                                                  "connection without response'))")


def test_a_submission_the_head_dropped_is_tried_again_as_the_same_job(monkeypatch):
    monkeypatch.setattr("supervisor.submit.time.sleep", lambda s: None)
    client = DroppingJobsClient()
    assert submit_when_ready(client, "http://h:8265", entrypoint="x") == client.made[0]
    assert len(client.made) == 1  # one job, not two


class DroppedLogsClient:
    """A head whose dashboard drops the log stream abnormally (Ray raises on close code 1006) after the first
    chunks of the log, twice, while the job runs; each new stream starts at the log's beginning."""

    LOG = ["submitted\n", "step 0\n", "step 1\n", "step 2\n", "done\n"]

    def __init__(self):
        self.streams, self.drops = 0, [2, 3]  # each stream, how many chunks before it drops (then to the end)

    async def tail_job_logs(self, job_id):
        drop = self.drops[self.streams] if self.streams < len(self.drops) else None
        self.streams += 1
        for i, chunk in enumerate(self.LOG):
            if i == drop:
                raise RuntimeError("WebSocket connection closed unexpectedly with close code 1006")
            yield chunk

    ended = False  # the job ended before the stream dropped: the rest of its log is read whole

    def get_job_status(self, job_id):
        from ray.job_submission import JobStatus

        return JobStatus.SUCCEEDED if self.ended else JobStatus.RUNNING

    def get_job_logs(self, job_id):
        return "".join(self.LOG)


@pytest.mark.parametrize("ended, streams", [(False, 3), (True, 1)])
def test_a_log_stream_the_dashboard_drops_is_opened_again_and_nothing_is_printed_twice(capsys, ended, streams):
    from supervisor.submit import follow_logs

    client = DroppedLogsClient()
    client.ended = ended
    follow_logs(client, "raysubmit_1", sleep=lambda s: None)
    assert capsys.readouterr().out == "".join(DroppedLogsClient.LOG)
    assert client.streams == streams


def test_submit_fails_in_one_line_on_another_error():
    with pytest.raises(SubmitError, match=r"^--address http://h:8265: Request failed with status code 403$"):
        submit_when_ready(StandInJobsClient(busy=1, error="Request failed with status code 403\nbody"),
                           "http://h:8265", entrypoint="x")


def test_without_vllm_the_default_job_is_read_everywhere_and_refused_only_where_it_would_run(monkeypatch, tmp_path):
    """status, plan, clean-restart and submit only read the config (a laptop submitting to a cluster with vLLM);
    run and demo start the engines, and stop in one line saying how to run without vLLM."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    fileroot = f"cluster.fileroot={tmp_path}"
    for command in (["plan"], ["status"], ["clean-restart", "--dry-run"]):  # no run here: status says so
        r = CliRunner().invoke(main, [*command, str(DEFAULT_CONFIG), fileroot])
        assert "not installed" not in r.output and (r.exit_code == 0 or "no run of tiny-grpo" in r.output), r.output
    for command in (["run"], ["demo"]):
        r = CliRunner().invoke(main, [*command, str(DEFAULT_CONFIG), fileroot])
        assert r.exit_code == 2 and "rollout.engine: vllm is not installed" in r.output, r.output
        assert "rollout.engine=hf" in r.output and "Traceback" not in r.output
    assert not any(tmp_path.iterdir())



@pytest.mark.parametrize("modules", ["supervisor.control.classify", "supervisor.cli, supervisor.launch"],
                         ids=["read-only commands", "driver"])
def test_the_clis_own_process_imports_no_torch(modules):
    """The CLI's read-only commands (status, ...) classify events, and `relaunch run`'s driver imports the
    Supervisor's class, without torch's seconds of import: the controller and the worker groups are imported in
    the Supervisor's process."""
    import subprocess
    import sys
    from pathlib import Path

    code = f"import sys, {modules}; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.stdout.strip() == "False", r.stderr[-2000:]
