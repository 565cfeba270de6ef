"""GRPO's formulas: group-normalised advantages, the policy-gradient loss (PPO's clipped surrogate when a step makes
several updates) and the KL penalty. The losses take a row's advantage (GRPO's) or a token's (PPO's GAE)."""
from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """(r - mean of its group) / (std of its group + eps); a group of equal rewards teaches nothing."""
    groups = rewards.view(-1, group_size)
    adv = (groups - groups.mean(dim=1, keepdim=True)) / (groups.std(dim=1, keepdim=True) + eps)
    return adv.view(-1)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """log p(input_ids[:, t + 1]) under logits[:, t]: one value per predicted token."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def masked_mean(values: torch.Tensor, response_mask: torch.Tensor,
                tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over generated tokens only (response_mask marks them in input_ids); with `tokens`, the sum over them
    divided by `tokens` instead: a micro-batch's share of the mean over the whole batch (response_tokens)."""
    mask = response_mask[:, 1:].float()
    return (values * mask).sum() / (mask.sum().clamp(min=1) if tokens is None else tokens)


def response_tokens(response_mask: torch.Tensor) -> torch.Tensor:
    """The generated tokens a batch's token mean divides by."""
    return response_mask[:, 1:].float().sum().clamp(min=1)


def per_token(advantages: torch.Tensor) -> torch.Tensor:
    """Advantages laid out as token_logprobs: GRPO's one per row (broadcast over its tokens), or PPO's per token
    (GAE: [rows, sequence - 1]) as they are."""
    return advantages if advantages.dim() == 2 else advantages.unsqueeze(1)


def policy_loss(logits: torch.Tensor, input_ids: torch.Tensor, response_mask: torch.Tensor,
                advantages: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """On-policy GRPO (one update per batch, so the PPO ratio is 1): -A * log p(token), token mean."""
    return masked_mean(-per_token(advantages) * token_logprobs(logits, input_ids), response_mask, tokens)


def clipped_policy_loss(logits: torch.Tensor, input_ids: torch.Tensor, response_mask: torch.Tensor,
                        advantages: torch.Tensor, old_logp: torch.Tensor, clip: float,
                        tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate (Schulman et al. 2017; verl's vanilla policy loss, token mean): per token
    max(-A * r, -A * clip(r, 1 - clip, 1 + clip)), r the probability ratio to the policy that drew the step's
    samples (`old_logp`, its token log-probabilities). Returns the loss and the share of tokens whose clipped term
    is the loss (their gradient is 0)."""
    ratio = torch.exp(token_logprobs(logits, input_ids) - old_logp)
    adv = per_token(advantages)
    unclipped, clipped = -adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip)
    used = (clipped > unclipped).float()  # the clipped term is the loss: no gradient through the token (verl's)
    return masked_mean(torch.maximum(unclipped, clipped), response_mask, tokens), \
        masked_mean(used, response_mask, tokens).detach()


def kl_penalty(token_logp: torch.Tensor, ref_token_logp: torch.Tensor, response_mask: torch.Tensor,
               tokens: torch.Tensor | None = None) -> torch.Tensor:
    """GRPO's KL(policy || reference) estimate per token, exp(r - p) - (r - p) - 1 (k3, always >= 0)."""
    delta = ref_token_logp - token_logp
    return masked_mean(torch.exp(delta) - delta - 1, response_mask, tokens)
