"""GRPO's two formulas: group-normalised advantages and the policy-gradient loss."""
from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """(r - mean of its group) / (std of its group + eps); a group of equal rewards teaches nothing."""
    groups = rewards.view(-1, group_size)
    adv = (groups - groups.mean(dim=1, keepdim=True)) / (groups.std(dim=1, keepdim=True) + eps)
    return adv.view(-1)


def policy_loss(logits: torch.Tensor, input_ids: torch.Tensor, response_mask: torch.Tensor,
                advantages: torch.Tensor) -> torch.Tensor:
    """On-policy GRPO (one update per batch, so the PPO ratio is 1): -A * log p(token), token mean.

    logits[:, t] predicts input_ids[:, t + 1]; response_mask marks generated tokens in input_ids.
    """
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    token_logp = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    mask = response_mask[:, 1:].float()
    per_token = -advantages.unsqueeze(1) * token_logp * mask
    return per_token.sum() / mask.sum().clamp(min=1)
