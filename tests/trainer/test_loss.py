"""The clipped-ratio objective on hand-computed values."""

import math

import pytest
import torch

from serve_app.trainer.loss import clipped_ratio_loss, loss_stats


def test_ratio_one_gives_minus_mean_advantage():
    logp = torch.tensor([-1.0, -2.0, -3.0])
    adv = torch.tensor([1.0, -0.5, 2.0])
    loss, ratio = clipped_ratio_loss(logp, logp.clone(), adv, 0.2)
    torch.testing.assert_close(ratio, torch.ones(3))
    assert loss.item() == pytest.approx(-(1.0 - 0.5 + 2.0) / 3)


def test_clipping_takes_the_pessimistic_term():
    e = 0.1
    old = torch.zeros(4)
    # ratios 1.5, 1.5, 0.5, 0.5 with advantages +1, -1, +1, -1
    logp = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5]))
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, ratio = clipped_ratio_loss(logp, old, adv, e)
    # max(-A r, -A clip(r)): A=+1,r=1.5 -> max(-1.5, -1.1) = -1.1 (clipped; no gain beyond 1+e)
    # A=-1,r=1.5 -> max(1.5, 1.1) = 1.5; A=+1,r=0.5 -> max(-0.5, -0.9) = -0.5; A=-1,r=0.5 -> max(0.5, 0.9) = 0.9
    assert loss.item() == pytest.approx((-1.1 + 1.5 - 0.5 + 0.9) / 4, abs=1e-6)
    stats = loss_stats(logp, old, ratio, e)
    assert stats.clip_frac == 1.0
    assert stats.ratio_min == pytest.approx(0.5) and stats.ratio_max == pytest.approx(1.5)
    assert stats.approx_kl == pytest.approx(0.5 * (2 * math.log(1.5) ** 2 + 2 * math.log(0.5) ** 2) / 4, rel=1e-5)


def test_gradient_is_zero_where_clipped_and_minus_a_on_policy():
    adv = torch.tensor([1.0, -1.0])
    logp = torch.log(torch.tensor([1.5, 1.0])).requires_grad_(True)
    loss, _ = clipped_ratio_loss(logp, torch.zeros(2), adv, 0.1)
    loss.backward()
    # row 0 is clipped (ratio 1.5 > 1.1 with A > 0): no gradient; row 1: d/dlogp (-A r)/2 = -A r / 2 = 0.5
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, 0.5]))


def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match="share a shape"):
        clipped_ratio_loss(torch.zeros(3), torch.zeros(3), torch.zeros(2), 0.1)
