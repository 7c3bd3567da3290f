"""GRPO's loss (llmtrain/train/grpo.py) against TRL's GRPOTrainer written out: group-normalised advantages, the
clipped ratio, the k3 KL term and each reduction; the token weights a step trains on are autograd's gradient of
that loss, and every rank's share of the global batch adds up to the whole batch's loss."""

from __future__ import annotations

import pytest
import torch

from llmtrain.train.grpo import SCALE_EPSILON, GlobalBatch, GRPOSettings, advantages, loss_and_weights

GROUP, PROMPTS, POSITIONS = 3, 2, 6


def _trl_loss(logps, old, ref, rewards, mask, settings: GRPOSettings, scale: bool, tokens_in_batch: int):
    """TRL's GRPOTrainer (_compute_loss and the advantages of _generate_and_score_completions), as it writes them."""
    mean_grouped = rewards.view(-1, GROUP).mean(dim=1).repeat_interleave(GROUP)
    std_grouped = rewards.view(-1, GROUP).std(dim=1).repeat_interleave(GROUP)
    advantage = rewards - mean_grouped
    if scale:
        advantage = advantage / (std_grouped + 1e-4)
    coef_1 = torch.exp(logps - old)
    coef_2 = torch.clamp(coef_1, 1 - settings.epsilon, 1 + settings.epsilon_high)
    per_token_loss = -torch.min(coef_1 * advantage.unsqueeze(1), coef_2 * advantage.unsqueeze(1))
    if settings.beta != 0.0:
        per_token_loss = per_token_loss + settings.beta * (torch.exp(ref - logps) - (ref - logps) - 1)
    if settings.loss == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean(), advantage
    if settings.loss == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * settings.max_new_tokens), advantage
    return (per_token_loss * mask).sum() / tokens_in_batch, advantage  # dapo


def _rollout(seed: int):
    generator = torch.Generator().manual_seed(seed)
    rows = GROUP * PROMPTS
    logps = -torch.rand(rows, POSITIONS, generator=generator, dtype=torch.float64) * 3
    old = logps + (torch.rand(rows, POSITIONS, generator=generator, dtype=torch.float64) - 0.5) * 0.8  # some clipped
    ref = logps + (torch.rand(rows, POSITIONS, generator=generator, dtype=torch.float64) - 0.5)
    rewards = torch.randint(0, 3, (rows,), generator=generator).double()
    lengths = torch.tensor([6, 2, 4, 1, 5, 3])
    mask = (torch.arange(POSITIONS)[None, :] < lengths[:, None]).double()
    return logps, old, ref, rewards, mask


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta, scale", [(0.0, True), (0.04, True), (0.04, False)])
def test_the_loss_and_its_token_weights_are_trls_and_its_gradients(loss, beta, scale):
    """On 2 prompts' 3 completions each, of 1 to 6 tokens, with old log-probabilities 0.4 either side of the current
    (so that the clip holds some tokens at each end): the loss is TRL's, and each token's weight is minus TRL's
    loss's gradient with respect to that token's log-probability."""
    logps, old, ref, rewards, mask = _rollout(0)
    settings = GRPOSettings(loss=loss, beta=beta, epsilon=0.2, epsilon_high=0.28, max_new_tokens=POSITIONS)
    current = logps.clone().requires_grad_()
    expected, trl_advantage = _trl_loss(current, old, ref, rewards, mask, settings, scale, int(mask.sum()))
    expected.backward()
    advantage = advantages(rewards, GROUP, scale)
    torch.testing.assert_close(advantage, trl_advantage, rtol=1e-12, atol=1e-12)
    batch = GlobalBatch(completions=GROUP * PROMPTS, tokens=int(mask.sum()))
    ours, weights = loss_and_weights(logps, old, ref, advantage, mask, settings, batch)
    torch.testing.assert_close(ours, expected.detach(), rtol=1e-12, atol=1e-12)
    assert current.grad is not None
    torch.testing.assert_close(weights, -current.grad, rtol=1e-10, atol=1e-12)
    ratio = torch.exp(logps - old)
    assert ((ratio > 1.28) & (mask > 0)).any() and ((ratio < 0.8) & (mask > 0)).any()  # both clips were exercised


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "dapo"])
def test_each_ranks_share_adds_up_to_the_whole_batchs_loss(loss):
    """The batch's prompts dealt to two ranks, each normalising by the global batch's completions and tokens: their
    losses add up to the whole batch's, and each rank's token weights are the whole's rows."""
    logps, old, ref, rewards, mask = _rollout(1)
    settings = GRPOSettings(loss=loss, beta=0.04, max_new_tokens=POSITIONS)
    advantage = advantages(rewards, GROUP, scale=True)
    batch = GlobalBatch(completions=GROUP * PROMPTS, tokens=int(mask.sum()))
    whole, whole_weights = loss_and_weights(logps, old, ref, advantage, mask, settings, batch)
    halves = [slice(0, GROUP), slice(GROUP, 2 * GROUP)]
    parts = [loss_and_weights(logps[h], old[h], ref[h], advantage[h], mask[h], settings, batch) for h in halves]
    torch.testing.assert_close(sum(part for part, _ in parts), whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([weights for _, weights in parts]), whole_weights)


def test_a_group_whose_rewards_are_all_equal_has_no_advantage():
    """Zero reward variance: every advantage 0 (scaled or not), so only the KL term moves the policy."""
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 2.0], dtype=torch.float64)
    for scale in (True, False):
        assert advantages(rewards, GROUP, scale)[:GROUP].abs().max() == 0


def test_an_unscored_completion_is_left_out_of_its_group_with_advantage_zero():
    """TRL's rule: a completion no reward scored (NaN) counts for nothing in its group's mean and deviation and gets
    advantage 0, instead of a reward of 0 and a spurious advantage; a group with one scored completion teaches
    nothing."""
    rewards = torch.tensor(
        [1.0, float("nan"), 0.0, 1.0, float("nan"), 2.0, float("nan"), float("nan")], dtype=torch.float64
    )
    scaled = advantages(rewards, 4, scale=True)
    kept = torch.tensor([1.0, 0.0, 1.0])
    expected = (kept - kept.mean()) / (kept.std() + SCALE_EPSILON)
    assert torch.allclose(scaled[[0, 2, 3]], expected.double()) and scaled[1] == 0
    assert scaled[4:].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert not advantages(rewards, 4, scale=False).isnan().any()
