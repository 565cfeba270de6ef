"""What a TrainWorker rank holds in host memory at its peak, and what a memory-tier holder keeps for it: `plan`'s
prediction, from the config and the model's size alone (CPU ranks; on a GPU the state is on the device).

The parts, for P parameters over n ranks (fp32 master weights in either actor.dtype):
- the process itself: Python, torch, transformers and Ray's worker, with a model of a few weights (PROCESS_GB,
  measured: benchmarks/step.py's tiny size);
- the training state: weights, gradients and AdamW's two moments, 16P/n on fsdp; on DeepSpeed the module's weights
  and gradients (w bytes each: 4, or 2 in bf16) beside the optimizer's fp32 master weights and moments (12P/n):
  ZeRO-1 keeps the weights and gradients whole (2wP), ZeRO-2 the weights (wP + wP/n), ZeRO-3 neither (2wP/n);
- micro-batches on fsdp: the unsharded gradients kept until an update's last micro-batch, 4P;
- the memory tier's two slots of the rank's own state (weights and both moments, 12P/n each);
- with actor.kl_coef, the reference policy: a frozen full fp32 copy on every rank, 4P (not measured);
- the engines' weights the rank maps where an engine shares its host (the shared path writes them in place), 4P
  (2P for bf16 engines; none without rollout.shared_memory_weights);
- then the largest of two moments that do not overlap: the step's activations (logits over the vocabulary, kept
  three times by the loss and its gradient, and each layer's saved activations; prompts are not counted, `plan`
  does not tokenize the data), or what comes after the step on rank 0: a background save's staging copy (12P/n)
  while the HF export holds the gathered model and safetensors' copy of it as it writes (8P).
Measured against it (docs/benchmarks.md, "A rank's memory"): the ~100M job within 3% with the tier and without it,
in fp32 and in bf16 with micro-batches and recomputed activations; DeepSpeed's parts are not measured.
"""
from __future__ import annotations

from dataclasses import dataclass

from supervisor.config import Backend, Config, TrainDtype

GB = 1e9
PROCESS_GB = 0.47           # a rank's process with a model of a few weights (benchmarks/step.py --size tiny)
ACTIVATION_FLOATS = 16      # fp32 values a layer keeps per token and hidden unit for its backward
CHECKPOINTED_FLOATS = 1     # with gradient checkpointing: the layer's input only
LOGIT_COPIES = 3            # logits, their log-softmax and its gradient
SLOTS = "memory tier's two slots"  # weights and both moments, 12P/n each


def param_count(shape: dict) -> int:
    """Parameters of a Qwen2-shaped decoder (the built model; Llama/Qwen2 directories) from its HF config
    fields: embeddings, per layer attention (q/k/v with bias, o without), a gated MLP and two norms, a final
    norm, and an output head unless tied."""
    h, layers, vocab = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
    kv = shape.get("num_key_value_heads", shape["num_attention_heads"]) * (h // shape["num_attention_heads"])
    per_layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * shape["intermediate_size"] + 2 * h
    head = 0 if shape.get("tie_word_embeddings", False) else vocab * h
    return vocab * h + layers * per_layer + h + head


@dataclass(frozen=True)
class RankMemory:
    parts: dict[str, float]  # what the rank holds at its peak, in bytes, by name

    @property
    def holder_bytes(self) -> float:
        """What a memory-tier holder keeps for the rank: the same two slots as the rank's own (0 without the tier)."""
        return self.parts[SLOTS]

    @property
    def peak_bytes(self) -> float:
        return sum(self.parts.values())

    @staticmethod
    def size(b: float) -> str:
        return f"{b / GB:.2f} GB" if b >= 0.01 * GB else f"{b / 1e6:.1f} MB"

    def text(self) -> str:
        shown = ", ".join(f"{name} {b / GB:.2f}" for name, b in self.parts.items() if b >= 0.005 * GB)
        return f"~{self.peak_bytes / GB:.2f} GB at a rank's peak ({shown})"


def rank_memory(config: Config, shape: dict, memory_tier: bool) -> RankMemory:
    """The prediction for a model of HF config fields `shape`; `memory_tier`: whether the tier holds copies."""
    actor, d = config.actor, config.data
    n, p = config.cluster.n_train_workers, float(param_count(shape))
    fsdp = actor.backend is Backend.FSDP
    w = 2 if actor.dtype is TrainDtype.BF16 else 4
    state = 16 * p / n if fsdp else 12 * p / n + w * p * {1: 2, 2: 1 + 1 / n, 3: 2 / n}[actor.zero_stage]
    share = d.batch_size * d.group_size // n  # a rank's samples a step
    update = -(-share // actor.mini_batches)  # the most of them in one optimizer update
    rows = min(actor.micro_batch_size or update, update)  # in one forward and backward
    split = fsdp and rows < update
    floats = CHECKPOINTED_FLOATS if actor.gradient_checkpointing else ACTIVATION_FLOATS
    activations = rows * d.max_new_tokens * 4 * (LOGIT_COPIES * shape["vocab_size"] +
                                                 floats * shape["hidden_size"] * shape["num_hidden_layers"])
    after_step = (12 * p / n if config.async_recover else 0.0) + 8 * p
    engine_bytes = 2 if config.engine_dtype == "bfloat16" else 4
    parts = {"process": PROCESS_GB * GB, "training state": state, "unsharded gradients of micro-batches":
             4 * p if split else 0.0, SLOTS: 2 * 12 * p / n if memory_tier else 0.0,
             "KL reference": 4 * p if actor.kl_coef else 0.0,
             "engine weights mapped": engine_bytes * p if config.rollout.shared_memory_weights else 0.0,
             "activations" if activations > after_step else
             "background save and HF export": max(activations, after_step)}
    return RankMemory(parts)
