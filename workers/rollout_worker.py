"""RolloutWorker: an inference engine holding the policy's weights, tagged with a version.

The version is the global step those weights are used for: the initial weights are version 0, and the
weights after step G's update are version G + 1. Generation (workers/generate.py) is batched and
KV-cached; every sample is drawn from its own generator seeded by (seed, step, sample index), so a
restarted engine, or any number of engines, draws the same samples. With cluster.gpus_per_engine > 0
the engine's model lives on its GPU.
"""
from __future__ import annotations

import os

import ray
import torch

from supervisor.config import Config
from supervisor.testing.fault_points import fault_points
from workers.errors import StaleWeights
from workers.generate import generate
from workers.memory import peak_memory
from workers.model import build_model, build_tokenizer, weights_checksum


@ray.remote
class RolloutWorker:
    def __init__(self, config: Config, index: int = 0):
        torch.set_num_threads(1)
        self.config, self.rank = config, index  # `rank`: the engine's index, for fault points
        self.tokenizer = build_tokenizer(config.model)
        self.model = build_model(config.model, self.tokenizer, config.seed).eval()
        if config.cluster.gpus_per_engine > 0:  # Ray set CUDA_VISIBLE_DEVICES to the engine's GPU
            self.model.to("cuda")
        self.version: int | None = None
        self._weight_names: list[str] = []

    @fault_points
    def where(self) -> dict:
        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    @fault_points
    def load_weights(self, state_dict: dict, version: int) -> None:
        missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
        tied = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
        if unexpected or set(missing) - tied:
            raise ValueError(f"weights do not fit the engine's model: missing {missing}, unexpected {unexpected}")
        self._weight_names = sorted(state_dict)
        self.version = version

    @fault_points
    def weight_status(self) -> tuple[int | None, str]:
        """(version, checksum of the weights it holds), for the resync gate."""
        own = self.model.state_dict()
        return self.version, weights_checksum({k: own[k] for k in self._weight_names})

    @fault_points
    def generate(self, prompts: list[str], sample_ids: list[int], global_step: int, version: int,
                 greedy: bool = False) -> dict:
        """Sample (or, for evaluation, greedily pick) one completion per prompt; left-padded ids and masks, and
        this process's peak memory (`memory`). Refuses unless it holds weights `version`: no rollout is ever
        drawn from the wrong weights."""
        if self.version != version:
            raise StaleWeights(f"asked for weights version {version} at step {global_step}, holds {self.version}")
        cfg = self.config
        out = generate(self.model, self.tokenizer, prompts, sample_ids, seed=cfg.seed, step=global_step,
                       max_new_tokens=cfg.data.max_new_tokens, temperature=cfg.rollout.temperature,
                       greedy=greedy, chat_template=cfg.data.chat_template)
        return out | {"memory": peak_memory()}


def merge_rollouts(chunks: list[dict]) -> dict:
    """Concatenate engines' results in sample order, left-padding to a common width; the engines' largest peak
    memory of each kind."""
    pad_id = chunks[0]["pad_id"]
    width = max(c["input_ids"].shape[1] for c in chunks)

    def pad(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.nn.functional.pad(t, (width - t.shape[1], 0), value=value)

    return {
        "input_ids": torch.cat([pad(c["input_ids"], pad_id) for c in chunks]),
        "attention_mask": torch.cat([pad(c["attention_mask"], 0) for c in chunks]),
        "response_mask": torch.cat([pad(c["response_mask"], 0) for c in chunks]),
        "completions": [x for c in chunks for x in c["completions"]],
        "memory": {k: max(c["memory"][k] for c in chunks) for k in chunks[0]["memory"]},
    }
