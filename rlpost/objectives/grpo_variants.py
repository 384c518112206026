"""DAPO and CISPO: :class:`~rlpost.objectives.grpo.GRPOLoss` with DAPO's clip-higher default and with
CISPO's per-token objective (TorchRL's ``DAPO`` and ``CISPOLoss``)."""

from __future__ import annotations

from rlpost.objectives.grpo import GRPOLoss
from rlpost.objectives.loss_output import CISPOLossOutput, DAPOLossOutput

__all__ = ["CISPOLoss", "DAPO"]


class DAPO(GRPOLoss):
    """DAPO's loss (Yu et al. 2025, arXiv:2503.14476): :class:`GRPOLoss` with clip-higher
    (``clip_epsilon=(0.2, 0.28)`` by default, the paper's Eq. 10) and the token-level mean
    (``aggregation="token_mean"``). Its other two parts act on the data, not the loss: dynamic
    sampling is ``MCAdvantage(filter_equal_rewards=True)`` (or ``keep_return_bounds``), and
    overlong shaping is a reward transform.

    Deliberate deviation: TorchRL's ``DAPO`` cannot be built (at pytorch/rl ae9719f its
    ``__init__`` is a misplaced KL helper); this one takes :class:`GRPOLoss`'s arguments, with
    those two defaults, and refuses ``eps_high < eps_low`` (a clip that is tighter upward than
    downward is not clip-higher).
    """

    output_type = DAPOLossOutput

    def __init__(self, actor_network=None, *, clip_epsilon: float | tuple[float, float] = (0.2, 0.28), **kwargs):
        super().__init__(actor_network, clip_epsilon=clip_epsilon, **kwargs)
        if float(self.clip_epsilon_high) < float(self.clip_epsilon_low):
            raise ValueError(
                f"DAPO's clip-higher needs eps_high >= eps_low, got clip_epsilon={clip_epsilon!r} "
                "(recommended: (0.2, 0.28))"
            )


class CISPOLoss(GRPOLoss):
    """CISPO's loss (MiniMax-M1, arXiv:2506.13585): :class:`GRPOLoss` whose per-token objective
    is the clipped importance weight, held constant, times the log-prob's gradient::

        loss = -sg(clip(ratio, 1 - eps_low, 1 + eps_high)) * A    (gradient: that times grad log p)

    Deliberate deviation: TorchRL's ``CISPOLoss`` clamps the log-ratio inside the graph, so a
    clipped token has no gradient at all (PPO's clip without its min), which is the very thing
    CISPO was made to avoid; here every counted token keeps its gradient, scaled by its clipped
    weight. The reported value is TorchRL's (``-clip(ratio) * A``, aggregated), and
    ``clip_fraction`` is the share of counted tokens whose weight was clipped, as in TorchRL.
    The arguments are :class:`GRPOLoss`'s.
    """

    output_type = CISPOLossOutput
    objective = "cispo"
