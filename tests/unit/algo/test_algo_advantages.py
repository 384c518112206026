"""group_advantages: hand-computed values for each scale, and the all-equal-group rule."""

import math

import pytest
import torch

from rlpost.algo import group_advantages, scale_by_batch_std

pytestmark = pytest.mark.unit


def test_group_scale_uses_bessel_std_and_eps():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 2.0, 3.0, 4.0]], dtype=torch.float64)
    # row 0: mean 0.5, Bessel std sqrt(4 * 0.25 / 3); row 1: mean 2.5, std sqrt(5 / 3).
    std0, std1 = math.sqrt(1 / 3), math.sqrt(5 / 3)
    expected = torch.tensor(
        [
            [0.5 / (std0 + 1e-4), -0.5 / (std0 + 1e-4), -0.5 / (std0 + 1e-4), 0.5 / (std0 + 1e-4)],
            [-1.5 / (std1 + 1e-4), -0.5 / (std1 + 1e-4), 0.5 / (std1 + 1e-4), 1.5 / (std1 + 1e-4)],
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(group_advantages(rewards), expected, rtol=1e-12, atol=0)


def test_group_scale_eps_zero_gives_unit_std():
    rewards = torch.tensor([[1.0, 2.0, 3.0]])
    assert torch.equal(group_advantages(rewards, eps=0.0), torch.tensor([[-1.0, 0.0, 1.0]]))


def test_batch_scale_divides_by_std_of_all_rewards():
    rewards = torch.tensor([[0.0, 2.0], [1.0, 3.0]], dtype=torch.float64)
    # all rewards [0, 2, 1, 3]: mean 1.5, Bessel variance (2.25 + 0.25 + 0.25 + 2.25) / 3 = 5/3.
    batch_std = math.sqrt(5 / 3)
    expected = torch.tensor([[-1.0, 1.0], [-1.0, 1.0]], dtype=torch.float64) / (batch_std + 0.01)
    out = group_advantages(rewards, scale="batch", eps=0.01)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=0)


def test_none_scale_only_centres():
    rewards = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 4.0]], dtype=torch.float64)
    expected = torch.tensor([[-1.0, 0.0, 1.0], [-4 / 3, -4 / 3, 8 / 3]], dtype=torch.float64)
    torch.testing.assert_close(group_advantages(rewards, scale="none"), expected)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_all_equal_group_gets_exact_zeros(scale):
    # 0.1 is not exactly representable: the naive r - mean(r) leaves a residue here.
    rewards = torch.tensor([[0.1, 0.1, 0.1], [0.0, 1.0, 0.0]])
    out = group_advantages(rewards, scale=scale)
    assert torch.equal(out[0], torch.zeros(3))
    assert (out[1] != 0).all()


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_of_one_is_zero_not_nan(scale):
    out = group_advantages(torch.tensor([[3.0], [5.0]]), scale=scale)
    assert torch.equal(out, torch.zeros(2, 1))


def test_integer_rewards_become_float_and_shape_is_kept():
    out = group_advantages(torch.tensor([[0, 1], [1, 1]]), eps=0.0)
    assert out.dtype == torch.get_default_dtype()
    half_over_std = 0.5 / math.sqrt(0.5)
    torch.testing.assert_close(out, torch.tensor([[-half_over_std, half_over_std], [0.0, 0.0]]))


def test_invalid_scale_names_the_value():
    with pytest.raises(ValueError, match="'bogus'"):
        group_advantages(torch.zeros(2, 2), scale="bogus")


def test_wrong_rank_names_the_shape():
    with pytest.raises(ValueError, match=r"\(4,\)"):
        group_advantages(torch.zeros(4))


def test_negative_eps_is_rejected():
    with pytest.raises(ValueError, match="eps"):
        group_advantages(torch.zeros(2, 2), eps=-1.0)


def test_batch_scaling_centred_groups_of_one_size_matches_the_batch_scale():
    rewards = [[1.0, 0.0, 0.5], [0.2, 0.2, 0.2], [0.0, 1.0, 1.0]]
    centred = group_advantages(torch.tensor(rewards, dtype=torch.float64), scale="none").tolist()
    expected = group_advantages(torch.tensor(rewards, dtype=torch.float64), scale="batch").tolist()
    out = scale_by_batch_std(centred, rewards)
    assert [a for row in out for a in row] == pytest.approx([a for row in expected for a in row], abs=1e-12)


def test_batch_scaling_of_ragged_groups_divides_by_the_std_of_every_reward():
    rewards = [[1.0, 0.0], [0.5, 0.5, 0.5], [3.0]]
    centred = [[0.5, -0.5], [0.0, 0.0, 0.0], [0.0]]
    std = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.5, 3.0], dtype=torch.float64).std().item()
    out = scale_by_batch_std(centred, rewards, eps=0.0)
    assert out[0] == pytest.approx([0.5 / std, -0.5 / std])
    assert out[1] == [0.0, 0.0, 0.0] and out[2] == [0.0]  # all-equal groups and a group of one carry no signal
    assert scale_by_batch_std([[0.0, 0.0]], [[2.0, 2.0]], eps=0.0) == [[0.0, 0.0]]  # std 0: no 0/0
    with pytest.raises(ValueError, match="same groups"):
        scale_by_batch_std(centred, rewards[:2])
