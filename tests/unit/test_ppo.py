"""PPO's formulas with a critic (workers/ppo.py), against verl's as written and against what they mean."""
from __future__ import annotations

import pytest
import torch

from workers.ppo import KLCoefficient, gae, token_rewards, token_values, value_loss, whiten

# three rows of 7 tokens (6 predicted): left-padded prompts, completions of 3, 1 and 2 tokens, the last one
# followed by padding (the third row's generated tokens are columns 2 and 3 of the predicted ones)
RESPONSE = torch.tensor([[0, 0, 0, 0, 1, 1, 1],
                         [0, 0, 0, 0, 0, 0, 1],
                         [0, 0, 0, 1, 1, 0, 0]])
MASK = RESPONSE[:, 1:].float()


def verl_gae(rewards, values, mask, gamma, lam):
    """verl's compute_gae_advantage_return (core_algos.py, observation tokens skipped), transcribed."""
    nextvalues, lastgaelam, reversed_ = 0, 0, []
    for t in reversed(range(rewards.shape[-1])):
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * mask[:, t] + (1 - mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * mask[:, t] + (1 - mask[:, t]) * lastgaelam
        reversed_.append(lastgaelam)
    advantages = torch.stack(reversed_[::-1], dim=1)
    returns = advantages + values
    mean = (advantages * mask).sum() / mask.sum()
    var = (((advantages - mean) ** 2) * mask).sum() / mask.sum() * (mask.sum() / (mask.sum() - 1))
    return (advantages - mean) * torch.rsqrt(var + 1e-8), returns


def test_the_value_of_a_token_is_the_critics_output_at_the_position_before_it():
    logits = torch.arange(12.0).view(2, 6, 1)
    assert torch.equal(token_values(logits), torch.tensor([[0.0, 1, 2, 3, 4], [6, 7, 8, 9, 10]]))


def test_the_outcome_lands_on_each_rows_last_generated_token_and_the_kl_on_every_generated_one():
    rewards = token_rewards(torch.tensor([1.0, 2.0, 3.0]), RESPONSE)
    assert torch.equal(rewards, torch.tensor([[0.0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 2], [0, 0, 0, 3, 0, 0]]))
    kl = torch.full(MASK.shape, 0.5)
    assert torch.equal(token_rewards(torch.tensor([1.0, 2.0, 3.0]), RESPONSE, kl, beta=0.1),
                       rewards - 0.05 * MASK)
    assert torch.equal(token_rewards(torch.tensor([4.0]), torch.zeros(1, 7)), torch.zeros(1, 6))  # nothing generated


# as RESPONSE, and a fourth row whose completion has gaps (tokens that are not the policy's, as a tool's output
# in a multi-turn rollout): GAE steps over them to the next generated token
GAPPED = torch.cat([RESPONSE, torch.tensor([[0, 1, 1, 0, 1, 0, 1]])])


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (1.0, 0.95), (0.99, 0.9), (0.9, 0.0)])
def test_gae_is_verls_on_every_generated_token(gamma, lam):
    g = torch.Generator().manual_seed(0)
    mask = GAPPED[:, 1:].float()
    rewards = token_rewards(torch.randn(4, generator=g), GAPPED, torch.randn(4, 6, generator=g).abs(), 0.1)
    values = torch.randn(4, 6, generator=g, requires_grad=True)  # the critic's, where the gaps have values too
    advantages, returns = gae(rewards, values, GAPPED, gamma, lam)
    want_adv, want_ret = verl_gae(rewards, values.detach(), mask, gamma, lam)
    assert torch.allclose(advantages, want_adv * mask, atol=1e-6) and torch.allclose(returns, want_ret * mask)
    assert torch.equal(advantages * (1 - mask), torch.zeros(4, 6))  # the prompt and the padding carry nothing
    assert not returns.requires_grad  # targets: no gradient flows into them


def test_gae_steps_over_a_gap_to_the_next_generated_token():
    response = torch.tensor([[0, 1, 0, 1]])  # generated: columns 0 and 2, a gap at column 1
    rewards, values = torch.tensor([[0.0, 5.0, 1.0]]), torch.tensor([[0.5, 9.0, 0.25]])
    _, returns = gae(rewards, values, response, 1.0, 0.0)
    assert torch.equal(returns, torch.tensor([[0.25, 0.0, 1.0]]))  # column 0 bootstraps from column 2's value


def test_whitening_fewer_than_two_generated_tokens_is_refused():
    with pytest.raises(ValueError, match="at least two generated tokens"):
        gae(torch.zeros(1, 3), torch.zeros(1, 3), torch.tensor([[0, 0, 0, 1]]), 1.0, 1.0)


def test_with_lambda_one_the_returns_are_the_rewards_to_go_and_with_lambda_zero_the_td_errors():
    rewards = token_rewards(torch.tensor([1.0, -1.0, 2.0]), RESPONSE)
    values = torch.tensor([[9.0, 9, 9, 0.5, 0.25, 0.75], [9, 9, 9, 9, 9, 0.5], [9, 9, 0.5, 0.25, 9, 9]])
    _, returns = gae(rewards, values, RESPONSE, 1.0, 1.0)
    # every generated token's return is its row's outcome, whatever the critic says
    assert torch.equal(returns, torch.tensor([[0.0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, -1], [0, 0, 2, 2, 0, 0]]))
    raw = returns - values * MASK
    advantages, _ = gae(rewards, values, RESPONSE, 1.0, 1.0)
    assert torch.allclose(advantages, whiten(raw, MASK) * MASK)
    # lambda 0: the return is r_t + V of the next generated token (the advantage, less V_t: the TD error)
    _, returns = gae(rewards, values, RESPONSE, 1.0, 0.0)
    assert torch.equal(returns, torch.tensor([[0.0, 0, 0, 0.25, 0.75, 1], [0, 0, 0, 0, 0, -1], [0, 0, 0.25, 2, 0, 0]]))


def test_whitened_advantages_have_mean_zero_and_unit_variance_over_the_generated_tokens():
    advantages, _ = gae(token_rewards(torch.tensor([1.0, 0.0, 3.0]), RESPONSE), torch.zeros(3, 6), RESPONSE, 1.0, 1.0)
    picked = advantages[MASK > 0]
    assert abs(float(picked.mean())) < 1e-6 and float(picked.var()) == pytest.approx(1.0, rel=1e-6)


def test_the_value_loss_is_half_the_squared_error_until_the_clip_holds_the_value_back():
    returns, old = torch.ones(1, 6), torch.zeros(1, 6)
    mask = torch.tensor([[0, 0, 0, 0, 1, 1, 1]])
    near = torch.full((1, 6), 0.1, requires_grad=True)  # within the clip: plain regression
    loss, clipped = value_loss(near, old, returns, mask, clip=0.2)
    assert float(loss.detach()) == pytest.approx(0.5 * 0.9 ** 2) and float(clipped) == 0
    far = torch.full((1, 6), -0.5, requires_grad=True)  # moved away from the returns past the clip: held at 0.2 off
    loss, clipped = value_loss(far, old, returns, mask, clip=0.2)
    assert float(loss.detach()) == pytest.approx(0.5 * 1.5 ** 2) and float(clipped) == 0  # the worse of the two: unclipped
    past = torch.full((1, 6), 0.5, requires_grad=True)  # moved towards the returns past the clip: no gradient
    loss, clipped = value_loss(past, old, returns, mask, clip=0.2)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(0.5 * 0.8 ** 2) and float(clipped) == 1 and float(past.grad.abs().sum()) == 0
    # a micro-batch's share: its sum over the whole batch's generated tokens
    share, _ = value_loss(near, old, returns, mask, 0.2, tokens=torch.tensor(6.0))
    assert float(share.detach()) == pytest.approx(0.5 * 0.9 ** 2 / 2)


def test_a_fixed_kl_coefficient_stays_and_an_adaptive_one_follows_its_target_by_at_most_a_fifth():
    assert KLCoefficient(0.05).after(kl=3.0, samples=128) == KLCoefficient(0.05)
    adaptive = KLCoefficient(0.1, target=0.02, horizon=1000)
    assert adaptive.after(kl=0.022, samples=100).value == pytest.approx(0.1 * (1 + 0.1 * 0.1))
    assert adaptive.after(kl=1.0, samples=100).value == pytest.approx(0.1 * (1 + 0.2 * 0.1))  # the error capped
    assert adaptive.after(kl=0.0, samples=100).value == pytest.approx(0.1 * (1 - 0.2 * 0.1))
    # the whole state is the value: a resumed run that restores it continues the same sequence
    run = [adaptive]
    for kl in (0.03, 0.01, 0.05):
        run.append(run[-1].after(kl, 64))
    resumed = KLCoefficient(run[1].value, 0.02, 1000).after(0.01, 64).after(0.05, 64)
    assert resumed == run[-1]
