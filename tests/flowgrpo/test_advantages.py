import math

import pytest
import torch

from serve_app.flowgrpo.advantages import group_advantages, tied_group_fraction

# Three groups of three: a spread group, a tied group and a skewed group.
REWARDS = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0, 0.0, 0.0, 30.0])
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])


def test_group_std_hand_computed():
    # group 0: mean 2, population std sqrt(2/3) -> +-1 / (0.816497 + 1e-4) = +-1.224595
    # group 2: mean 10, population std sqrt(200) -> -10/14.14224, 20/14.14224
    adv = group_advantages(REWARDS, GROUPS)
    expected = torch.tensor([-1.2245949, 0.0, 1.2245949, 0.0, 0.0, 0.0, -0.7071018, -0.7071018, 1.4142036])
    assert adv.dtype == torch.float32 and adv.shape == (9,)
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)


def test_global_std_hand_computed():
    # Centred on each group's mean, divided by the population std of all nine rewards (8.819171).
    adv = group_advantages(REWARDS, GROUPS, std_mode="global")
    s = 1.0 / (8.819171036881968 + 1e-4)
    expected = torch.tensor([-s, 0.0, s, 0.0, 0.0, 0.0, -10 * s, -10 * s, 20 * s])
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)
    assert adv[8].item() == pytest.approx(2.2677611, abs=1e-6)


def test_eps_enters_the_denominator():
    adv = group_advantages(REWARDS, GROUPS, eps=0.5)
    assert adv[2].item() == pytest.approx(1.0 / (math.sqrt(2 / 3) + 0.5), abs=1e-6)
    assert adv[2].item() == pytest.approx(0.7595918, abs=1e-6)


def test_clipping_at_five():
    # One success among 32: z = (31/32) / (sqrt(31)/32 + 1e-4) = 5.5646 > 5.
    rewards = torch.zeros(32)
    rewards[5] = 1.0
    groups = torch.zeros(32, dtype=torch.long)
    unclipped = group_advantages(rewards, groups, clip=None)
    assert unclipped[5].item() == pytest.approx(5.5645662, abs=1e-5)
    clipped = group_advantages(rewards, groups)
    assert clipped[5].item() == 5.0
    assert clipped[0].item() == pytest.approx(-0.1795021, abs=1e-6)
    assert group_advantages(rewards, groups, clip=2.0)[5].item() == 2.0


def test_groups_out_of_order_and_sparse_ids():
    perm = torch.tensor([8, 3, 0, 6, 4, 1, 7, 5, 2])
    ids = torch.tensor([42, 7, 1000])[GROUPS]  # arbitrary, unsorted group ids
    adv = group_advantages(REWARDS[perm], ids[perm])
    torch.testing.assert_close(adv, group_advantages(REWARDS, GROUPS)[perm])
    torch.testing.assert_close(
        group_advantages(REWARDS[perm], ids[perm], std_mode="global"),
        group_advantages(REWARDS, GROUPS, std_mode="global")[perm],
    )


def test_tied_group_is_exactly_zero_and_counted():
    rewards = torch.tensor([0.3, 0.3, 0.3, 0.1, 0.9, 0.5])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    adv = group_advantages(rewards, groups)
    assert torch.equal(adv[:3], torch.zeros(3))
    assert tied_group_fraction(rewards, groups) == 0.5
    assert tied_group_fraction(REWARDS, GROUPS) == pytest.approx(1 / 3)


def test_tied_group_fraction_atol():
    rewards = torch.tensor([1.0, 1.05, 2.0, 3.0])
    groups = torch.tensor([0, 0, 1, 1])
    assert tied_group_fraction(rewards, groups) == 0.0
    assert tied_group_fraction(rewards, groups, atol=0.1) == 0.5
    assert tied_group_fraction(rewards, groups, atol=1.0) == 1.0


def test_output_keeps_device_and_accepts_float64():
    adv = group_advantages(REWARDS.double(), GROUPS)
    assert adv.dtype == torch.float32 and adv.device == REWARDS.device


@pytest.mark.parametrize(
    ("rewards", "groups", "match"),
    [
        (torch.ones(3), torch.zeros(4, dtype=torch.long), "same length"),
        (torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.long), "1-D"),
        (torch.ones(0), torch.zeros(0, dtype=torch.long), "empty"),
        (torch.tensor([1.0, 2.0, float("nan")]), torch.zeros(3, dtype=torch.long), "index 2"),
        (torch.tensor([1.0, float("inf"), 0.0]), torch.zeros(3, dtype=torch.long), "index 1"),
        (torch.ones(3), torch.zeros(3), "integer"),
    ],
)
def test_bad_inputs_raise(rewards, groups, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, groups)
    with pytest.raises(ValueError, match=match):
        tied_group_fraction(rewards, groups)


def test_unknown_std_mode_and_bad_clip():
    with pytest.raises(ValueError, match="std_mode"):
        group_advantages(REWARDS, GROUPS, std_mode="batch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="clip"):
        group_advantages(REWARDS, GROUPS, clip=0.0)
