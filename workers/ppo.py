"""PPO's formulas with a critic: the KL penalty in the token rewards and its adaptive coefficient, GAE, whitened
advantages, and the clipped value loss.

They follow verl's `trainer/ppo/core_algos.py` (compute_gae_advantage_return, AdaptiveKLController,
compute_value_loss) and `apply_kl_penalty`. Every per-token tensor here is laid out as `token_logprobs` lays
its own: [rows, sequence - 1], column t for the token at t + 1, so `response_mask[:, 1:]` marks the generated
tokens; prompts are left-padded, so a row's generated tokens are its last unpadded ones.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.grpo import masked_mean


def token_values(value_logits: torch.Tensor) -> torch.Tensor:
    """The critic's value of each state a generated token is drawn from: its one output at position t, the state
    before token t + 1 (a token-classification model with a single label; verl takes values[:, -len - 1:-1])."""
    return value_logits[:, :-1, 0].float()


def token_rewards(outcome: torch.Tensor, response_mask: torch.Tensor, kl: torch.Tensor | None = None,
                  beta: float = 0.0) -> torch.Tensor:
    """Each row's outcome reward on its last generated token, less beta times the per-token KL estimate to the
    reference (verl's apply_kl_penalty: log p - log p_ref) on every generated token."""
    mask = response_mask[:, 1:].float()
    last = mask.shape[1] - 1 - mask.flip(1).argmax(dim=1)  # a row's last generated token
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(len(mask)), last] = outcome.float() * (mask.sum(dim=1) > 0)
    return rewards if kl is None else rewards - beta * kl * mask


@torch.no_grad()  # the returns are the value loss's targets: no gradient flows into them (verl's, too)
def gae(rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) backwards over each row's generated tokens, the
    tokens outside the mask skipped (their values and TD errors count for nothing, as in verl); returns the
    advantages, whitened over the batch's generated tokens, and the returns (raw advantages + values), the value
    loss's targets."""
    mask = response_mask[:, 1:].float()
    values = values.float() * mask
    next_value = running = torch.zeros_like(mask[:, 0])
    advantages = torch.zeros_like(mask)
    for t in reversed(range(mask.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * running
        next_value = torch.where(mask[:, t] > 0, values[:, t], next_value)
        running = torch.where(mask[:, t] > 0, step, running)
        advantages[:, t] = running
    returns = (advantages + values) * mask
    return whiten(advantages, mask) * mask, returns


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked elements (the unbiased variance, as verl's masked_whiten, which also
    refuses fewer than two)."""
    n = mask.sum()
    if n < 2:
        raise ValueError(f"whitening needs at least two generated tokens in the batch, not {int(n)}")
    mean = (x * mask).sum() / n
    var = (((x - mean) ** 2) * mask).sum() / (n - 1)
    return (x - mean) * torch.rsqrt(var + eps)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor,
               clip: float, tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss (verl's compute_value_loss): 0.5 * token mean of max((V - R)^2, (V' - R)^2), V'
    the new value held within `clip` of the value at the step's start (`old_values`); with `tokens`, a
    micro-batch's share of the mean (masked_mean). Returns the loss and the share of tokens the clip decided."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    plain, held = (values - returns) ** 2, (clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(plain, held), response_mask, tokens)
    # a value within the clip is held by a rounding of itself: not counted (verl counts it when it rounds up)
    decided = (held > plain) & ((values - old_values).abs() > clip)
    return loss, masked_mean(decided.float(), response_mask, tokens).detach()


@dataclass(frozen=True)
class KLCoefficient:
    """The KL penalty's coefficient, part of the run's state (verl #2653: not saved, a resume starts it over).
    With a `target`, adaptive (Ziegler et al. 2019, verl's AdaptiveKLController): after each step it is multiplied
    by 1 + e * samples / horizon, e the step's KL relative to the target, less 1, clipped to +-0.2; without a
    target, fixed."""
    value: float
    target: float | None = None
    horizon: int = 10000

    def after(self, kl: float, samples: int) -> "KLCoefficient":
        """The coefficient for the next step, given the step's mean KL and its number of samples."""
        if self.target is None:
            return self
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        return KLCoefficient(self.value * (1.0 + error * samples / self.horizon), self.target, self.horizon)
