"""`relaunch plan CONFIG`: what a run will ask for and do, before anything starts.

Pure: from the validated config and the dataset's size it derives the resources, the steps per epoch
and in total, and the global steps after which each save, recover checkpoint and evaluation fires (the
same FreqCtl the Supervisor runs, fed step by step). Time-based triggers cannot be placed in advance;
the plan says so, and warns when a schedule never fires or the run is only a handful of steps long.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from supervisor.config import AUTO, Config, Frequency
from supervisor.control.freq import FreqCtl
from supervisor.control.step_info import StepInfo

FEW_STEPS = 10  # fewer steps than this is a smoke test, not a training run


@dataclass
class Plan:
    lines: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def fire_steps(freq: Frequency, steps_per_epoch: int, total_steps: int) -> list[int]:
    """Global steps after which the epoch/step conditions of `freq` fire (time ignored)."""
    ctl = FreqCtl(freq.freq_epochs, freq.freq_steps, None)
    fired, s = [], StepInfo.before_start(steps_per_epoch)
    for _ in range(total_steps):
        s = s.next()
        if ctl.check(s.is_epoch_end, 0.0):
            fired.append(s.global_step)
    return fired


def _steps_text(steps: list[int]) -> str:
    if not steps:
        return "never by step or epoch"
    shown = ", ".join(map(str, steps)) if len(steps) <= 8 else \
        f"{', '.join(map(str, steps[:4]))}, ..., {', '.join(map(str, steps[-2:]))}"
    return f"after steps {shown} ({len(steps)} times)"


def _rule_text(freq: Frequency) -> str:
    parts = [f"every {freq.freq_epochs} epochs" if freq.freq_epochs else "",
             f"every {freq.freq_steps} steps" if freq.freq_steps else "",
             _secs_text(freq.freq_secs)]
    return " or ".join(p for p in parts if p) or "off"


def _secs_text(secs) -> str:
    if secs == AUTO:
        return "every Young/Daly interval (auto: from the measured save stall and the time between failures)"
    return f"every {secs:g} s" if secs else ""


def _schedule(name: str, freq: Frequency, steps_per_epoch: int, total_steps: int, plan: Plan,
              extra: str = "") -> None:
    if not freq.any_set:
        plan.lines.append(f"{name:<10} off")
        return
    steps = fire_steps(freq, steps_per_epoch, total_steps)
    when = _steps_text(steps)
    if freq.fixed_secs:
        when += (f", and whenever {freq.freq_secs:g} s have passed since the last one (for one to fire by time "
                 f"alone, steps must take {freq.freq_secs / total_steps:.0f} s on average)")
    plan.lines.append(f"{name:<10} {when} [{_rule_text(freq)}]{extra}")
    if not steps and freq.secs_auto:
        pass  # the interval is decided while the job runs
    elif not steps and freq.freq_secs:
        plan.warnings.append(
            f"{name}.freq_secs={freq.freq_secs:g} is its only trigger within these {total_steps} steps: it fires only "
            f"if a step takes {freq.freq_secs / total_steps:.0f} s or more on average; add {name}.freq_steps")
    elif not steps:
        plan.warnings.append(f"{name} never fires: {_rule_text(freq)} is beyond the run's "
                             f"{total_steps} steps ({total_steps // steps_per_epoch} epochs)")


def _resources(config: Config) -> str:
    c = config.cluster

    def bundle(cpus: float, gpus: float) -> str:
        return f"{{CPU: {cpus:g}{f', GPU: {gpus:g}' if gpus else ''}}}"

    cpus = (c.n_train_workers + c.n_rollout_workers) * c.cpus_per_worker
    gpus = c.n_train_workers * c.gpus_per_worker + c.n_rollout_workers * c.gpus_per_engine
    return (f"TrainGroup {c.n_train_workers} x {bundle(c.cpus_per_worker, c.gpus_per_worker)} "
            f"({'nccl' if c.gpus_per_worker else 'gloo'}), engines {c.n_rollout_workers} x "
            f"{bundle(c.cpus_per_worker, c.gpus_per_engine)}; in all {cpus:g} CPUs"
            f"{f', {gpus:g} GPUs' if gpus else ''} (the Supervisor takes none)")


def make_plan(config: Config, dataset_size: int) -> Plan:
    """The plan of a run over `dataset_size` prompts (at least one batch: the loader refuses fewer)."""
    plan = Plan()
    d = config.data
    steps_per_epoch = dataset_size // d.batch_size
    total = steps_per_epoch * config.total_train_epochs
    plan.lines.append(f"{'resources':<10} {_resources(config)}")
    plan.lines.append(f"{'model':<10} {config.model.path or 'tiny Qwen2 built from model.* sizes'}")
    plan.lines.append(f"{'data':<10} {dataset_size} prompts in {d.path}; {d.batch_size} prompts x {d.group_size} "
                      f"samples = {d.batch_size * d.group_size} a step, up to {d.max_new_tokens} new tokens each")
    plan.lines.append(f"{'steps':<10} {steps_per_epoch} per epoch x {config.total_train_epochs} epochs = {total} "
                      f"(global steps 0-{total - 1})")
    if steps_per_epoch * d.batch_size < dataset_size:
        plan.lines.append(f"{'':<10} the last {dataset_size - steps_per_epoch * d.batch_size} prompts of each epoch's "
                          f"order are left out (a partial batch)")
    _schedule("saver", config.saver, steps_per_epoch, total, plan, " -> HF export")
    if config.recover.mode.enabled:
        _schedule("recover", config.recover, steps_per_epoch, total, plan, "; and after the last step")
    else:
        plan.lines.append(f"{'recover':<10} off (recover.mode={config.recover.mode.value}): a failure is not survived")
    _schedule("evaluator", config.evaluator, steps_per_epoch, total, plan)
    if total < FEW_STEPS:
        plan.warnings.append(f"the run is only {total} steps ({steps_per_epoch} per epoch: {dataset_size} prompts / "
                             f"batch {d.batch_size}); lower data.batch_size or raise total_train_epochs")
    return plan
