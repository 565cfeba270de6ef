"""The `relaunch` command line (also `python -m supervisor`).

Exit codes: 0 success, 1 the job failed, 2 bad usage or bad input (one line naming the key or file).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import click

from supervisor.config import DEFAULT_CONFIG, ConfigError, check_engine_installed, load_config
from supervisor.exit_codes import ExitCode


def _fail(message: str) -> None:
    click.echo(f"relaunch: error: {message}", err=True)
    sys.exit(ExitCode.BAD_INPUT)


def _dataset_size(config) -> int:
    """The number of prompts in data.path, every row checked as the Supervisor will read it, none kept (one line
    on error)."""
    from workers.data import DataError, iter_prompts

    try:
        rows = sum(1 for _ in iter_prompts(config.data.path, config.data.prompt_key, config.data.answer_key))
    except DataError as e:
        _fail(str(e))
    if rows < config.data.batch_size:
        _fail(f"data.batch_size {config.data.batch_size} is larger than the dataset ({rows} prompts)")
    return rows


def _split_args(args: tuple[str, ...]) -> tuple[Path, list[str]]:
    """`[CONFIG] [KEY=VALUE ...]`: the first argument without '=' is the config file."""
    path, overrides = None, []
    for a in args:
        if a.startswith("-"):  # the commands take unknown options as arguments, to pass KEY=VALUE through
            command = click.get_current_context().command_path
            _fail(f"no such option: {a.split('=', 1)[0]} (`{command} --help` lists the options)")
        if "=" not in a and path is None and not overrides:
            path = Path(a)
        else:
            overrides.append(a)
    return path or DEFAULT_CONFIG, overrides


def _config_and_overrides(args: tuple[str, ...]):
    try:
        return load_config(*_split_args(args))
    except ConfigError as e:
        _fail(str(e))


def _check_store(where: str, path) -> None:
    """A URL on a bucket that is not there, or on a store that cannot be reached, is bad input: one line within
    seconds naming `where` (a config key, or "" for an argument) and the URL, before anything is created (for a
    run: rather than at its first save)."""
    from supervisor.checkpoint.layout import ObjectPath, as_path
    from supervisor.checkpoint.storage import check_bucket

    root = as_path(path)
    if isinstance(root, ObjectPath):
        try:
            check_bucket(root)
        except OSError as e:
            _fail(f"{where}{root}: {e.strerror}")


def _check_fileroot(config) -> None:
    _check_store("cluster.fileroot: ", config.cluster.fileroot)


def _os_error(e: OSError) -> str:
    """An error naming its file as `path: what`, the way the other errors read."""
    return f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e)


def _address(address: str | None) -> str | None:
    return address or os.environ.get("RAY_ADDRESS") or None


NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())  # Click 8.2 and later


class OneLineErrors(click.Group):
    """Click's own usage errors (a missing option, an unknown command, a bad value) in one line, exit 2, as
    relaunch's are, instead of its usage block."""

    def main(self, *args, **kwargs):
        kwargs.pop("standalone_mode", None)
        try:
            return super().main(*args, standalone_mode=False, **kwargs)
        except NO_ARGS_IS_HELP as e:  # `relaunch` alone: its help, as Click gives it
            e.show()
            sys.exit(e.exit_code)
        except click.UsageError as e:
            command = e.ctx.command_path if e.ctx else self.name
            _fail(f"{e.format_message()} (`{command} --help` lists the options)")
        except click.ClickException as e:
            click.echo(f"relaunch: error: {e.format_message()}", err=True)
            sys.exit(e.exit_code)
        except click.Abort:  # Ctrl-C where no command handles it: as Click says it
            click.echo("Aborted!", err=True)
            sys.exit(1)


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """relaunch: run RL post-training on Ray and keep it running through failures."""
    # As in a Ray job, the directory a command starts in is importable (`reward.fn: myreward:reward`), also
    # under the `relaunch` script, whose sys.path has its own directory instead; the driver passes it on to
    # every actor (launch.py's runtime env).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


@main.command(context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1)
@click.option("--address", help="Ray cluster address (default: $RAY_ADDRESS, else a local embedded Ray)")
def run(args, address):
    """Run CONFIG (default configs/tiny_grpo.yaml) with KEY=VALUE overrides to completion."""
    config = _config_and_overrides(args)
    _check_fileroot(config)  # where the driver starts: here, or on the head node of a submitted job
    try:
        check_engine_installed(config)
    except ConfigError as e:
        _fail(str(e))
    from supervisor.launch import run_job
    from workers.rewards import UserCodeError, load_reward_fn

    from supervisor.control.trackers import missing_packages

    try:
        load_reward_fn(config.reward.fn)
    except UserCodeError as e:
        _fail(str(e))
    _dataset_size(config)
    if missing_packages(config.logging.trackers):
        _fail(f"logging.trackers: {', '.join(missing_packages(config.logging.trackers))} is not installed "
              f"(pip install 'relaunch[trackers]')")
    sys.exit(run_job(config, _address(address)))


@main.command(context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1)
def plan(args):
    """Validate CONFIG and print what a run would ask for and do: resources, steps, the schedule of every
    save, recover checkpoint and evaluation, and warnings. Starts nothing."""
    try:
        config = load_config(*_split_args(args), model_here=False)
    except ConfigError as e:
        _fail(str(e))
    from supervisor.tools.plan import make_plan
    from workers.rewards import UserCodeError, load_reward_fn

    try:
        load_reward_fn(config.reward.fn)
    except UserCodeError as e:
        _fail(str(e))
    prompts = _dataset_size(config)
    _check_fileroot(config)
    hf_config = config.model.path / "config.json" if config.model.path is not None else None
    shape = json.loads(hf_config.read_text()) if hf_config is not None and hf_config.is_file() else None
    result = make_plan(config, prompts, shape)
    click.echo(f"{'run':<10} {config.experiment_name}/{config.trial_name} -> {config.cluster.fileroot}")
    for line in result.lines:
        click.echo(line)
    if config.model.path is not None and not (config.model.path / "config.json").is_file():
        result.warnings.append(f"model.path {config.model.path} is not on this machine: every node must have it")
    for w in result.warnings:
        click.echo(f"warning: {w}")


@main.command(context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1)
@click.option("--address", help="Ray Jobs address, e.g. http://127.0.0.1:8265 (default: $RAY_ADDRESS)")
@click.option("--wait", is_flag=True, help="follow the job's logs to its end and exit with its result")
def submit(args, address, wait):
    """Submit CONFIG through Ray Jobs: the current directory is the job's working dir."""
    config = _config_and_overrides(args)
    address = _address(address)
    if not address:
        _fail("submit needs --address (or RAY_ADDRESS): the Ray dashboard URL, e.g. http://127.0.0.1:8265")
    from supervisor.checkpoint.layout import TrialLayout
    from supervisor.checkpoint.trial_lock import TrialLocked, trial_lock
    from supervisor.submit import SubmitError
    from supervisor.submit import submit as submit_job

    try:  # the job's driver takes the lock; a live run is named here, before anything is uploaded
        trial_lock(TrialLayout.from_config(config)).check_free()
    except TrialLocked as e:
        _fail(str(e))
    except OSError:  # a bucket this machine cannot read: the driver checks it, with the head node's credentials
        pass
    path, overrides = _split_args(args)
    try:
        sys.exit(submit_job(path, overrides, config, address, wait))
    except SubmitError as e:
        _fail(str(e))


@main.command(context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1)
@click.option("--kill-at-step", default=8, show_default=True, help="kill the TrainGroup's node after this step")
def demo(args, kill_at_step):
    """The default job on a local 3-node Ray cluster, with a worker node killed mid-run."""
    path, overrides = _split_args(args)
    try:
        config = load_config(path, ["trial_name=demo-" + time.strftime("%Y%m%d-%H%M%S"), *overrides])
        check_engine_installed(config)
    except ConfigError as e:
        _fail(str(e))
    _dataset_size(config)
    from supervisor.demo import run_demo

    sys.exit(run_demo(config, kill_at_step))


@main.command(context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1)
@click.option("--out", type=click.Path(path_type=Path), required=True, help="PNG file to write")
def plot(args, out):
    """Reward and loss per step of CONFIG's trial, with failures, restarts and checkpoints marked."""
    config = _config_and_overrides(args)
    from supervisor.checkpoint.layout import TrialLayout
    from supervisor.tools.plot import plot_trial

    try:
        plot_trial(TrialLayout.from_config(config), out)
    except FileNotFoundError as e:
        _fail(str(e))
    click.echo(f"wrote {out}")


@main.command(context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1)
@click.option("--json", "as_json", is_flag=True, help="one JSON object")
@click.option("--address", help="Ray cluster address, to ask the live Supervisor")
def status(args, as_json, address):
    """Last valid step, restarts and recent events of CONFIG's trial."""
    config = _config_and_overrides(args)
    _check_fileroot(config)
    from supervisor.tools.status import TrialState, format_status, live_progress, trial_status

    st = trial_status(config)
    if st["state"] == TrialState.NEVER_RUN:  # most likely a misspelled name or fileroot: nothing to report
        if as_json:
            click.echo(json.dumps(st, default=str))
        _fail(f"no run of {config.experiment_name}/{config.trial_name} under {config.cluster.fileroot} "
              "(check experiment_name, trial_name and cluster.fileroot)")
    st["live"], st["live_error"] = live_progress(config, _address(address))
    click.echo(json.dumps(st, default=str) if as_json else format_status(st))


@main.command("clean-restart", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1)
@click.option("--yes", is_flag=True, help="do not ask for confirmation")
@click.option("--dry-run", is_flag=True, help="only list what would be removed")
def clean_restart(args, yes, dry_run):
    """Delete this trial's recover state so the next run starts at step 0. Exports and logs are kept.
    Refused while a run holds the trial."""
    config = _config_and_overrides(args)
    _check_fileroot(config)
    from supervisor.checkpoint.layout import TrialLayout
    from supervisor.checkpoint.store import RecoverStore
    from supervisor.checkpoint.trial_lock import TrialLocked, trial_lock

    layout = TrialLayout.from_config(config)
    store = RecoverStore(layout, config.recover.keep_last)
    root, targets = layout.checkpoint_root, store.recover_state()
    if isinstance(root, Path):  # a local tree: no symlink may lead the deletion out of it
        root = root.resolve()
        for p in targets:
            if p.is_symlink() or root not in p.resolve().parents:
                _fail(f"{p}: refusing to delete a path outside the trial root {root}")
    if not targets:
        click.echo(f"nothing to remove: no recover state under {root}")
        return
    if dry_run:
        for p in targets:
            click.echo(f"would remove {p}")
        return
    lock = trial_lock(layout)  # no run may be running, or start, while its recover state goes
    try:
        lock.acquire()
    except TrialLocked as e:
        _fail(str(e))
    try:
        if not yes:
            if not sys.stdin.isatty():
                _fail(f"clean-restart would delete {', '.join(map(str, targets))}: pass --yes to confirm")
            for p in targets:
                click.echo(f"would remove {p}")
            click.confirm("delete these?", abort=True)
        for p in targets:
            click.echo(f"removing {p}")
            store.fs.remove(p)
    finally:
        lock.release()
    click.echo("done: the next run starts at step 0")


@main.command()
@click.argument("checkpoint")
@click.option("--out", type=click.Path(path_type=Path), help="output directory (default ./hf-<checkpoint name>)")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]),
              help="cast the weights (default: as saved)")
@click.option("--max-shard-size",
              help="split safetensors above this size, e.g. 500MB (default: the run's saver.max_shard_size)")
@click.option("--model", "model_dir", type=click.Path(path_type=Path),
              help="the run's HuggingFace model directory, when model.path of the run is not on this machine")
def export(checkpoint, out, dtype, max_shard_size, model_dir):
    """Turn a recover checkpoint (any world size; a path or a URL such as s3://...) into a HuggingFace model
    directory. No cluster needed."""
    from supervisor.checkpoint.layout import as_path
    from supervisor.checkpoint.transfer import readable
    from supervisor.tools.export import ExportError, export_recover_checkpoint

    out = out or Path.cwd() / f"hf-{as_path(checkpoint).name}"
    _check_store("", checkpoint)
    try:
        with readable(checkpoint) as local:
            export_recover_checkpoint(local, out, dtype, max_shard_size, model_dir)
    except ExportError as e:
        _fail(str(e))
    except OSError as e:
        _fail(_os_error(e))
    click.echo(f"exported {checkpoint} -> {out}")


@main.command()
@click.argument("export_dir", metavar="EXPORT")
@click.option("--against", required=True,
              help="a HuggingFace directory or a recover checkpoint (globalstep<N>); a path or a URL")
@click.option("--atol", type=float, default=0.0, show_default=True, help="largest absolute difference accepted")
def verify(export_dir, against, atol):
    """Compare EXPORT's weights (a path or a URL) with another model tensor by tensor; exit 1 naming what differs."""
    from supervisor.checkpoint.transfer import readable
    from supervisor.tools.verify import VerifyError
    from supervisor.tools.verify import verify as compare_weights

    _check_store("", export_dir)
    _check_store("", against)
    try:
        with readable(export_dir) as mine, readable(against) as theirs:
            result = compare_weights(mine, theirs, atol)
    except VerifyError as e:
        _fail(str(e))
    except OSError as e:
        _fail(_os_error(e))
    for line in result.problems:
        click.echo(f"DIFFERS {line}")
    click.echo(f"{result.compared} tensors compared, max abs difference {result.max_diff:.3g}"
               f"{f' ({result.max_diff_name})' if result.max_diff_name else ''}: "
               f"{'match' if result.ok else f'{len(result.problems)} differences'}")
    sys.exit(ExitCode.OK if result.ok else ExitCode.FAILED)


@main.command()
@click.argument("checkpoint")
def inspect(checkpoint):
    """Step, world size, files and validity of a recover checkpoint (a path or a URL), and what a resume would
    load. Exit 2 when it is damaged."""
    from supervisor.checkpoint.transfer import readable
    from supervisor.tools.inspect_checkpoint import inspect as describe

    _check_store("", checkpoint)
    try:
        with readable(checkpoint) as local:
            valid, report = describe(local)
    except OSError as e:
        _fail(_os_error(e))
    click.echo(report)
    if not valid:
        sys.exit(ExitCode.BAD_INPUT)


if __name__ == "__main__":
    main()
