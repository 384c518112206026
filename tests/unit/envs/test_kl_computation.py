"""KLComputation's sequence-level reward (``reward_per="sequence"``, rlpost's addition for the
KL-shaped reward of ``reference.kl_in: reward``) and its mask, on plain tensors."""

import pytest
import torch
from tensordict import TensorDict

from rlpost.envs.kl import ASSISTANT_MASK, KLComputation

pytestmark = pytest.mark.unit

GEN = torch.tensor([[-0.5, -1.0, -2.0, 0.0], [-0.3, -0.2, -0.1, -0.4]])
REF = torch.tensor([[-0.9, -1.5, -1.0, -3.0], [-0.3, -0.6, -0.1, -0.9]])
MASK = torch.tensor([[False, True, True, False], [True, True, True, True]])


def batch(reward: torch.Tensor) -> TensorDict:
    return TensorDict({("log_probs", "full"): GEN, ("ref_log_probs", "full"): REF, ASSISTANT_MASK: MASK,
                       "reward": reward}, batch_size=[2])  # fmt: skip


def test_a_sequence_reward_loses_coeff_times_the_kl_summed_over_the_masked_tokens():
    out = KLComputation(add_to_reward=True, coeff=0.5, reward_per="sequence", mask_key=ASSISTANT_MASK)(
        batch(torch.tensor([1.0, 0.25], dtype=torch.float64))
    )
    kl = torch.where(MASK, GEN - REF, torch.zeros(()))  # k1 on the generated tokens only
    assert torch.equal(out.get("kl_penalty"), kl)
    expected = torch.tensor([1.0, 0.25], dtype=torch.float64) - 0.5 * kl.sum(-1).double()
    reward = out.get("reward")
    assert reward.shape == (2,) and reward.dtype == torch.float64
    assert torch.allclose(reward, expected)  # [1 - 0.5 * (0.5 - 1.0), 0.25 - 0.5 * (0.4 + 0.5)]
    assert reward.tolist() == pytest.approx([1.25, -0.2])


def test_a_b_by_1_reward_keeps_its_shape_and_the_token_form_stays_torchrls():
    per_sequence = KLComputation(coeff=1.0, reward_per="sequence")(batch(torch.tensor([[1.0], [0.0]])))
    assert per_sequence.get("reward").shape == (2, 1)
    assert torch.allclose(per_sequence.get("reward").squeeze(-1), torch.tensor([1.0, 0.0]) - (GEN - REF).sum(-1))
    per_token = KLComputation(coeff=1.0)(batch(torch.tensor([[1.0], [0.0]])))
    assert per_token.get("reward").shape == (2, 4, 1)  # TorchRL's: the reward becomes per token


def test_bad_settings_and_a_missing_mask_are_named():
    with pytest.raises(ValueError, match="reward_per must be 'token' or 'sequence', got 'row'"):
        KLComputation(reward_per="row")
    td = batch(torch.zeros(2)).exclude(ASSISTANT_MASK)
    with pytest.raises(ValueError, match=r"mask_key=\('masks', 'all_assistant_mask'\)\) found no mask"):
        KLComputation(mask_key=ASSISTANT_MASK, reward_per="sequence")(td)
