"""RolloutWorker: an inference engine holding the policy's weights, tagged with a version.

The version is the global step those weights are used for: the initial weights are version 0, and the
weights after step G's update are version G + 1. Every sample is drawn from its own generator seeded by
(seed, step, sample index), so a restarted engine, or any number of engines, draws the same samples.
"""
from __future__ import annotations

import os

import numpy as np
import ray
import torch

from supervisor.classify import StaleWeights
from supervisor.faults import fault_points
from workers.model import build_model, build_tokenizer, forward_logits, weights_checksum


def sample_generator(seed: int, step: int, sample: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(int(np.random.SeedSequence([seed, step, sample]).generate_state(1, dtype=np.uint64)[0] >> 1))
    return g


@ray.remote
class RolloutWorker:
    def __init__(self, config, index: int = 0):
        torch.set_num_threads(1)
        self.config, self.rank = config, index  # `rank`: the engine's index, for fault points
        self.tokenizer = build_tokenizer(config.model)
        self.model = build_model(config.model, self.tokenizer, config.seed).eval()
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
    @torch.no_grad()
    def generate(self, prompts: list[str], sample_ids: list[int], global_step: int, version: int,
                 greedy: bool = False) -> dict:
        """Sample (or, for evaluation, greedily pick) one completion per prompt; left-padded ids and masks.
        Refuses unless it holds weights `version`: no rollout is ever drawn from the wrong weights."""
        if self.version != version:
            raise StaleWeights(f"asked for weights version {version} at step {global_step}, holds {self.version}")
        tok = self.tokenizer
        encoded = [[tok.bos_token_id] + tok.encode(p, add_special_tokens=False) for p in prompts]
        width = max(map(len, encoded))
        ids = torch.tensor([[tok.pad_token_id] * (width - len(e)) + e for e in encoded])
        attn = (torch.arange(width) >= torch.tensor([width - len(e) for e in encoded]).unsqueeze(1)).long()
        gens = [sample_generator(self.config.seed, global_step, s) for s in sample_ids]
        done = torch.zeros(len(prompts), dtype=torch.bool)
        response = []
        for _ in range(self.config.data.max_new_tokens):
            logits = forward_logits(self.model, ids, attn)[:, -1].float() / self.config.rollout.temperature
            probs = torch.softmax(logits, dim=-1)
            if greedy:
                nxt = probs.argmax(dim=-1)
            else:
                nxt = torch.stack([torch.multinomial(probs[i], 1, generator=g)[0] for i, g in enumerate(gens)])
            nxt = torch.where(done, torch.full_like(nxt, tok.pad_token_id), nxt)
            response.append(~done)
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            attn = torch.cat([attn, (~done).long()[:, None]], dim=1)
            done |= nxt == tok.eos_token_id
        response_mask = torch.zeros_like(ids)
        response_mask[:, width:] = torch.stack(response, dim=1).long()
        completions = [tok.decode(row[width:][response_mask[i, width:].bool()], skip_special_tokens=True)
                       for i, row in enumerate(ids)]
        return {"input_ids": ids, "attention_mask": attn, "response_mask": response_mask,
                "completions": completions, "pad_id": tok.pad_token_id}


def merge_rollouts(chunks: list[dict]) -> dict:
    """Concatenate engines' results in sample order, left-padding to a common width."""
    pad_id = chunks[0]["pad_id"]
    width = max(c["input_ids"].shape[1] for c in chunks)

    def pad(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.nn.functional.pad(t, (width - t.shape[1], 0), value=value)

    return {
        "input_ids": torch.cat([pad(c["input_ids"], pad_id) for c in chunks]),
        "attention_mask": torch.cat([pad(c["attention_mask"], 0) for c in chunks]),
        "response_mask": torch.cat([pad(c["response_mask"], 0) for c in chunks]),
        "completions": [x for c in chunks for x in c["completions"]],
    }
