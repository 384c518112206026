"""TorchRL's legacy KL reward, :class:`KLRewardTransform` (:class:`~rlpost.envs.kl.RetrieveKL`
is the recommended form), and :class:`RayKLRewardTransform`, the same in one shared Ray actor
(:mod:`rlpost.envs.kl_service`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey

from rlpost.data.stacking import get_rows
from rlpost.envs.kl import GEN_LOG_PROBS_FULL, pack_rows, tensor_list
from rlpost.envs.kl_service import DEFAULT_RAY_TIMEOUT_S, RayTransform
from rlpost.envs.transforms import Transform


class KLRewardTransform(Transform):
    """TorchRL's legacy KL reward: reference log-probs of the action, and per token
    ``reward - coef * (log_probs - ref_log_probs)`` (``RetrieveKL`` is the recommended form).

    ``ref_model``: a scoring wrapper (``generate=False``, input_mode "tokens"). The legacy form
    of TorchRL's docstring, ``KLRewardTransform(gen_model, ref_model)``, is accepted too (TorchRL's
    signature rejects it): ``gen_model`` then only says where its log-probs are (unless
    ``log_prob_key`` is given), and a reference in another input mode is scored through its
    tokens-mode twin. ``out_keys`` default to ``[reward, "kl_penalty", "ref_log_prob"]``; with
    ``assistant_only`` only the response tokens (after the prompt) count; ``use_ray_service``
    returns a :class:`RayKLRewardTransform`.
    """

    DEFAULT_IN_KEYS = ["reward"]

    def __new__(cls, *args: Any, use_ray_service: bool = False, **kwargs: Any):
        if use_ray_service and cls is KLRewardTransform:
            return RayKLRewardTransform(*args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        ref_model: Any = None,
        *legacy_ref_model: Any,
        ref_model_factory: Callable[[], Any] | None = None,
        coef: float = 1.0,
        in_keys: list | None = None,
        out_keys: list | None = None,
        log_prob_key: NestedKey | None = None,
        device: torch.device | str | None = None,
        add_to_reward: bool = True,
        tokenizer: Any = None,
        assistant_only: bool = True,
        padding_side: str = "left",
        use_ray_service: bool = False,
    ) -> None:
        super().__init__()
        if legacy_ref_model:  # KLRewardTransform(gen_model, ref_model)
            if len(legacy_ref_model) != 1 or ref_model_factory is not None:
                raise TypeError(
                    "KLRewardTransform takes the reference model, or (gen_model, ref_model) in the legacy form; "
                    f"got {1 + len(legacy_ref_model)} models{' and a ref_model_factory' if ref_model_factory else ''}"
                )
            gen_model, ref_model = ref_model, legacy_ref_model[0]
            if log_prob_key is None:
                log_prob_key = (getattr(gen_model, "log_probs_key", "log_probs"), "full")
            if getattr(ref_model, "input_mode", "tokens") != "tokens" and hasattr(ref_model, "get_new_version"):
                ref_model = ref_model.get_new_version(input_mode="tokens")
        log_prob_key = GEN_LOG_PROBS_FULL if log_prob_key is None else log_prob_key
        if ref_model_factory is not None:
            if ref_model is not None:
                raise ValueError("Cannot provide both 'ref_model' and 'ref_model_factory'. Choose one.")
            ref_model = ref_model_factory()
        elif ref_model is None:
            raise ValueError("Must provide exactly one of 'ref_model' or 'ref_model_factory'.")
        if getattr(ref_model, "generate", False):
            raise ValueError("The actor is configured to generate text, not compute the log-probs.")
        if getattr(ref_model, "input_mode", "tokens") != "tokens":
            raise ValueError(
                "The ref_model must be configured to use tokens as input. Please set the `input_mode` argument to `tokens`."
            )
        in_keys = list(in_keys or self.DEFAULT_IN_KEYS)
        out_keys = list(out_keys or in_keys)
        if len(out_keys) == len(in_keys):
            out_keys = out_keys + ["kl_penalty", "ref_log_prob"]
        if len(in_keys) != 1 or len(out_keys) != 3:
            raise ValueError(f"Only one in_key/out_key is allowed, got in_keys={in_keys}, out_keys={out_keys}.")
        self.in_keys, self.out_keys = in_keys, out_keys
        self.ref_model, self.coef, self.log_prob_full_key = ref_model, float(coef), log_prob_key
        self.device = torch.device(device) if device is not None else None
        self.add_to_reward, self._tokenizer = add_to_reward, tokenizer
        self.assistant_only, self.padding_side = assistant_only, padding_side

    @property
    def pad_output(self) -> bool:
        return bool(getattr(self.ref_model, "pad_output", True))

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer if self._tokenizer is not None else getattr(self.ref_model, "tokenizer", None)

    def _response_masks(self, td: TensorDictBase, lengths: list[int]) -> list[torch.Tensor]:
        """Per row: the tokens after the prompt (and not padding) count."""
        prompts = get_rows(td, ("tokens", "prompt"))
        attention = get_rows(td, ("masks", "all_attention_mask"))
        masks = []
        for i, length in enumerate(lengths):
            mask = torch.ones(length, dtype=torch.bool)
            if attention is not None:
                mask = torch.as_tensor(attention[i]).bool().clone()
            if prompts is not None:
                prompt_len = int(torch.as_tensor(prompts[i]).numel())
                real = mask.nonzero().flatten()
                mask[real[: min(prompt_len, len(real))]] = False
            masks.append(mask)
        return masks

    def apply(self, td: TensorDictBase, next_td: TensorDictBase) -> TensorDictBase:
        if ("tokens", "full") not in td.keys(include_nested=True):
            raise ValueError(
                "KLRewardTransform needs the sequence to score under ('tokens', 'full') "
                "(the policy's output in tokens mode)"
            )
        data = td.copy() if self.device is None else td.to(self.device)
        with torch.no_grad():
            scored = self.ref_model(data)
        ref_rows = get_rows(scored, (self.ref_model.log_probs_key, "full"))
        cur = get_rows(td, self.log_prob_full_key)
        if cur is None:
            raise ValueError(f"KLRewardTransform needs the generation log-probs under {self.log_prob_full_key!r}")
        cur_rows = [row.to(ref_rows[0].device) for row in cur]
        if self.assistant_only:
            masks = self._response_masks(td, [len(r) for r in ref_rows])
            ref_rows = [r.masked_fill(~m, 0.0) for r, m in zip(ref_rows, masks)]
            cur_rows = [c.masked_fill(~m, 0.0) for c, m in zip(cur_rows, masks)]
        for i, (c, r) in enumerate(zip(cur_rows, ref_rows)):
            if c.shape != r.shape:
                raise ValueError(
                    f"the log-probability tensor shapes must match, got cur_log_prob.shape={tuple(c.shape)} and "
                    f"log_prob.shape={tuple(r.shape)} (sample {i}); the padding token may equal the EOS token"
                )
        kl = pack_rows([(c - r).unsqueeze(-1) for c, r in zip(cur_rows, ref_rows)], self.pad_output, self.padding_side)
        ref = pack_rows([r.unsqueeze(-1) for r in ref_rows], self.pad_output, self.padding_side)
        if self.add_to_reward:
            reward = next_td.get(self.in_keys[0], None)
            rewards = [torch.zeros(())] * len(ref_rows) if reward is None else tensor_list(reward)
            penalised = []
            for r, k in zip(rewards, tensor_list(kl)):
                r = r.reshape(1, 1) if r.numel() == 1 else r  # one reward per sample: every token gets it
                penalised.append(r.to(k.dtype) - self.coef * k)
            next_td.set(self.out_keys[0], pack_rows(penalised, self.pad_output, self.padding_side))
        next_td.set(self.out_keys[1], kl)
        next_td.set(self.out_keys[2], ref)
        return next_td

    def on_step(self, td: TensorDictBase, next_td: TensorDictBase) -> TensorDictBase:
        return self.apply(td, next_td)

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        next_td = td.get("next", None)
        if next_td is None:
            raise ValueError("KLRewardTransform(td) needs td['next'] holding the step's reward")
        self.apply(td, next_td)
        return td

    forward = __call__

    def __repr__(self) -> str:
        return f"KLRewardTransform(coef={self.coef}, out_keys={self.out_keys})"


class RayKLRewardTransform(RayTransform):
    """:class:`KLRewardTransform` in one shared Ray actor (what
    ``KLRewardTransform(..., use_ray_service=True)`` returns)."""

    def __init__(
        self,
        ref_model: Any = None,
        *,
        ref_model_factory: Callable[[], Any] | None = None,
        num_cpus: float | None = None,
        num_gpus: float = 0,
        device: torch.device | str | None = None,
        actor_name: str | None = None,
        timeout_s: float = DEFAULT_RAY_TIMEOUT_S,
        **kwargs: Any,
    ) -> None:
        if ref_model is not None and ref_model_factory is not None:
            raise ValueError("Cannot provide both 'ref_model' and 'ref_model_factory'. Choose one.")
        make = None
        if ref_model is not None or ref_model_factory is not None:
            make = functools.partial(
                KLRewardTransform, **kwargs, ref_model=ref_model, ref_model_factory=ref_model_factory, device=device
            )
        elif actor_name is None:
            raise ValueError(
                "Must provide exactly one of 'ref_model' or 'ref_model_factory' (or the actor_name of a running one)."
            )
        super().__init__(make, num_cpus=num_cpus, num_gpus=num_gpus, device=device, actor_name=actor_name,
                         timeout_s=timeout_s)  # fmt: skip
