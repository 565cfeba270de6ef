"""`relaunch plan CONFIG`: what a run will ask for and do, before anything starts.

Pure: from the validated config and the dataset's size it derives the resources, the steps per epoch
and in total, and the global steps after which each save, recover checkpoint and evaluation fires (the
same FreqCtl the Supervisor runs, fed step by step), the warm spares and what they hold, and what has run on a GPU
and what has not. Time-based triggers cannot be placed in advance; the plan says so, and warns when a schedule
never fires or the run is only a handful of steps long.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from supervisor.cluster.spare_placement import rank_resources
from supervisor.config import AUTO, RECOVERY_OFF, Config, Frequency, RoleName, TokenizerKind
from supervisor.control.freq import FreqCtl
from supervisor.control.step_info import StepInfo
from supervisor.tools.rank_memory import param_count, rank_memory

FEW_STEPS = 10  # fewer steps than this is a smoke test, not a training run
# What has run where, said wherever a GPU config is planned (docs/benchmarks.md, "On a GPU").
GPU_WHAT_RAN = ("relaunch has run on one GPU only (an H200, torch 2.11: FSDP2 on nccl as a world of one, DCP saves "
                "and loads of CUDA state, the CUDA RNGs, pinned staging, the built-in engine on the GPU written "
                "through CUDA IPC, a rank killed and recovered bit-identically); never run: nccl across several "
                "GPUs (training and the weight stream), DeepSpeed on CUDA, vLLM on GPU")


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

    cpus = (config.train_ranks + c.n_rollout_workers) * c.cpus_per_worker
    gpus = config.train_ranks * c.gpus_per_worker + c.n_rollout_workers * c.gpus_per_engine
    critic = (f", critic's group {config.workers_of(RoleName.CRITIC)} x "
              f"{bundle(c.cpus_per_worker, c.gpus_per_worker)}" if config.critic else "")
    return (f"TrainGroup {c.n_train_workers} x {bundle(c.cpus_per_worker, c.gpus_per_worker)} "
            f"({'nccl' if c.gpus_per_worker else 'gloo'}){critic}, engines {c.n_rollout_workers} x "
            f"{bundle(c.cpus_per_worker, c.gpus_per_engine)}; in all {cpus:g} CPUs"
            f"{f', {gpus:g} GPUs' if gpus else ''} (the Supervisor takes none)")


def built_shape(config: Config) -> dict:
    """The HF config fields of the model relaunch builds from model.* (path null)."""
    m = config.model
    vocab = m.vocab_size if m.tokenizer is TokenizerKind.BPE else len(m.vocab)
    return {"hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers, "vocab_size": vocab,
            "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads,
            "intermediate_size": m.intermediate_size, "tie_word_embeddings": True}


def _size_text(params: int) -> str:
    count = (f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M" if params >= 1e6
             else f"{params / 1e3:.0f}k")
    return f"{count} parameters, ~{params * 4 / 2**20:,.1f} MiB of host memory"


def _spares(config: Config, shape: dict | None) -> str:
    """How many warm spares the run keeps, where, and what each holds (spare_placement.spare_count decides)."""
    c, setting = config.cluster, config.recover.spare_workers
    holds = rank_resources(c)
    bundle = "{" + ", ".join(f"{k}: {v:g}" for k, v in holds.items()) + "}"
    model = (f"the unsharded fp32 model built from the config ({_size_text(param_count(shape))})" if shape else
             "the unsharded fp32 model from model.path (its size unknown here: no config.json on this machine)")
    if setting == AUTO and c.gpus_per_worker:
        return (f"none (recover.spare_workers=auto idles no GPU; set it to N to keep N, each holding {bundle} and "
                f"{model})")
    critic = f" and up to {config.workers_of(RoleName.CRITIC)} for the critic's" if config.critic else ""
    if setting == AUTO:
        beside = "the groups and the engines, the actor's first" if config.critic else "the TrainGroup and the engines"
        count = (f"up to {c.n_train_workers}{critic} (auto: one per rank as far as the cluster has room beside "
                 f"{beside}; counted when the job starts)")
    elif setting == 0:
        return "none (recover.spare_workers=0): a restart starts its lost ranks cold"
    else:
        count = f"{setting}" + (" for each group (the actor's, the critic's)" if config.critic else "")
    return (f"{count}, each on a node that runs no rank when one has room, each holding {bundle} and {model}, "
            f"imports done, in no process group")


def _memory_tier(config: Config, shape: dict | None) -> str:
    """What the memory tier holds, where (docs/failures.md#recovery-from-memory), or why it is off."""
    keeps_none = config.recover.spare_workers == AUTO and config.cluster.gpus_per_worker  # auto idles no GPU
    off = config.memory_tier_off({role: 0 for role in config.trained} if keeps_none else None)
    if off is not None:
        return f"off: {off}; a lost rank recovers from disk"
    n = config.cluster.n_train_workers
    state = (f"~{3 * param_count(shape) * 4 / n / 2**20:,.1f} MiB (its shards of the weights and of AdamW's two "
             f"moments, fp32)" if shape else "its shards of the weights and of AdamW's two moments")
    if config.recover.spare_workers == 0 or keeps_none:
        holder = ("a peer rank's (another node's where one runs), after every step; a new process takes a dead "
                  "rank's place with the copy its peer gives it")
    else:
        holder = ("a holder's, after every step: a warm spare on another node, else a peer rank there, else a spare "
                  "or peer on its own node (a process death only); a dead rank's place is taken by the spare "
                  "holding its state, or by a new process given the peer's copy")
    critic = (" (the critic's ranks likewise, with holders of their own: the critic's spares, else its ranks; the "
              "other group's ranks roll back in place beside a repair)" if config.critic else "")
    return (f"{config.recover.memory.value}: each rank's state, {state}, is kept twice in its own memory and twice "
            f"in {holder}, and the others roll back in place, nothing read from disk{critic}; a node without the "
            f"room for its copies (15% of its memory left free) turns it off for the run")


def _rank_peak(config: Config, shape: dict | None) -> str:
    """A rank's host memory at its peak, and what a node needs for its ranks and the copies it holds."""
    if config.cluster.gpus_per_worker:
        return "not predicted for GPU ranks (their state is on the device)"
    if shape is None:
        return "not predicted: model.path's config.json is not on this machine"
    memory = rank_memory(config, shape, config.memory_tier_off() is None)  # CPU ranks: auto keeps spares
    text = memory.text()
    if memory.holder_bytes:
        text += (f"; a memory-tier holder keeps {memory.size(memory.holder_bytes)} for each rank it covers, so a node "
                 f"running k ranks and holding the copies of j needs about k x {memory.size(memory.peak_bytes)} + "
                 f"j x {memory.size(memory.holder_bytes)}")
    return text


def make_plan(config: Config, dataset_size: int, model_shape: dict | None = None) -> Plan:
    """The plan of a run over `dataset_size` prompts (at least one batch: the loader refuses fewer).
    `model_shape`: the HF config of model.path when it is on this machine (null: not readable here)."""
    plan = Plan()
    d = config.data
    steps_per_epoch = dataset_size // d.batch_size
    total = steps_per_epoch * config.total_train_epochs
    plan.lines.append(f"{'resources':<10} {_resources(config)}")
    plan.lines.append(f"{'model':<10} {config.model.path or 'tiny Qwen2 built from model.* sizes'}")
    shape = built_shape(config) if config.model.path is None else model_shape
    plan.lines.append(f"{'spares':<10} {_spares(config, shape)}")
    plan.lines.append(f"{'memory':<10} {_memory_tier(config, shape)}")
    plan.lines.append(f"{'rank peak':<10} {_rank_peak(config, shape)}")
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
        plan.warnings.append(RECOVERY_OFF.format(mode=config.recover.mode.value))
    _schedule("evaluator", config.evaluator, steps_per_epoch, total, plan)
    if config.logging.trackers:
        when = "at every recover checkpoint and the end" if config.recover.mode.enabled else "as each step ends"
        plan.lines.append(f"{'trackers':<10} {', '.join(t.value for t in config.logging.trackers)}: every stats "
                          f"row once its step is final ({when}), faults and restarts as markers")
    if config.cluster.gpus_per_worker or config.cluster.gpus_per_engine:
        plan.warnings.append(GPU_WHAT_RAN)
    if total < FEW_STEPS:
        plan.warnings.append(f"the run is only {total} steps ({steps_per_epoch} per epoch: {dataset_size} prompts / "
                             f"batch {d.batch_size}); lower data.batch_size or raise total_train_epochs")
    return plan
