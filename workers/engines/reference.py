"""The reference policy of GRPO's KL term (`actor.kl_coef`), refreshed from the policy every
`actor.ref_update_steps` steps, for every engine.

Every rank holds a frozen full copy (no gradients, not sharded). Its weights are checkpointed only on the
steps where they change: rank 0 writes `recover_checkpoint/reference/ref_globalstep{U}.safetensors` when a
recover save falls on update step U (config validation makes every update step a recover step), and each
step directory's manifest names the file it needs. Before the first refresh the reference is the initial
policy, which the engine rebuilds exactly from the config; nothing is written for it.
"""
from __future__ import annotations

from pathlib import Path

import torch

from supervisor.checkpoint.durable import write_atomic
from supervisor.checkpoint.layout import reference_file
from supervisor.config import Config
from workers.grpo import clipped_policy_loss, kl_penalty, policy_loss, token_logprobs
from workers.model import build_model, forward_logits


def reference_step(global_step: int, every: int | None) -> int | None:
    """The last step <= global_step after whose update the reference was refreshed; None: the initial policy."""
    if every is None:
        return None
    step = (global_step + 1) // every * every - 1
    return step if step >= 0 else None


class ReferencePolicy:
    def __init__(self, config: Config, tokenizer, device: torch.device):
        self.every = config.actor.ref_update_steps
        self.coef = config.actor.kl_coef
        self.model = build_model(config.model, tokenizer, config.seed).to(device).eval().requires_grad_(False)

    def kl(self, policy_logits: torch.Tensor, batch: dict, device: torch.device,
           tokens: torch.Tensor | None = None) -> torch.Tensor:
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        with torch.no_grad():
            ref_logp = token_logprobs(forward_logits(self.model, ids, mask), ids)
        return kl_penalty(token_logprobs(policy_logits, ids), ref_logp, batch["response_mask"].to(device), tokens)

    def refresh_due(self, global_step: int) -> bool:
        return self.every is not None and (global_step + 1) % self.every == 0

    def refresh(self, full_state: dict[str, torch.Tensor]) -> None:
        """Copy the policy's full weights; only a tied lm_head may be left out."""
        missing = set(self.model.load_state_dict(full_state, strict=False).missing_keys)
        if missing - {"lm_head.weight"}:
            raise RuntimeError(f"reference refresh got no weights for {sorted(missing)[:3]}")

    def save(self, recover_root: Path, global_step: int, rank: int) -> None:
        """Rank 0 writes the weights on the step they changed; any other step writes nothing, unless the
        file is missing (the save of the step that changed them failed): the weights are the same since."""
        step = reference_step(global_step, self.every)
        if rank != 0 or step is None or (step != global_step and reference_file(recover_root, step).is_file()):
            return
        from safetensors.torch import save

        state = {k: v.detach().cpu().contiguous().clone() for k, v in self.model.state_dict().items()}
        write_atomic(reference_file(recover_root, step), save(state))

    def load(self, recover_root: Path, global_step: int) -> None:
        step = reference_step(global_step, self.every)
        if step is not None:
            from safetensors.torch import load_file

            self.refresh(load_file(reference_file(recover_root, step)))


def grpo_loss(logits: torch.Tensor, batch: dict, device: torch.device, reference: "ReferencePolicy | None",
              tokens: torch.Tensor | None = None, clip: float | None = None) -> tuple[torch.Tensor, dict]:
    """GRPO's loss on this rank's shard of the batch (or, with `tokens`, a micro-batch's share of it), with the KL
    term to the reference when there is one; with a `clip` (a step of several updates), PPO's clipped surrogate
    to the log-probabilities of the policy that drew the batch (`old_logp`), clipped at `clip`."""
    ids, mask, adv = batch["input_ids"].to(device), batch["response_mask"].to(device), batch["advantages"].to(device)
    metrics = {}
    if clip is not None:
        loss, clipped = clipped_policy_loss(logits, ids, mask, adv, batch["old_logp"].to(device), clip, tokens)
        metrics["clip_frac"] = float(clipped)
    else:
        loss = policy_loss(logits, ids, mask, adv, tokens)
    if reference is None:
        return loss, metrics
    kl = reference.kl(logits, batch, device, tokens)
    return loss + reference.coef * kl, {**metrics, "kl": float(kl.detach())}
