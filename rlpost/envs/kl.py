"""KL to a reference model, as env transforms (TorchRL's ``torchrl.envs.llm.transforms.kl``).

:class:`RetrieveLogProb` scores the full sequences of a step, :class:`KLComputation` writes
the per-token KL ``gen - ref`` (and penalises the reward), :class:`RetrieveKL` chains them;
``use_ray_service=True`` gives a :class:`RayRetrieveKL` (:mod:`rlpost.envs.kl_service`);
TorchRL's legacy ``KLRewardTransform`` is in :mod:`rlpost.envs.kl_reward`. Log-probs of rows of
different lengths are padded (``pad_output=True``) or stored one tensor per row
(:func:`~rlpost.data.stacking.set_rows`; ``td.get(key, as_list=True)`` gives them back, as from
TorchRL). As in TorchRL, ``transform(td)`` also works alone, writing into ``td["next"]`` when
there is one, else into ``td``.

Deliberate deviations from TorchRL:

- rlpost's env rewards are ``[B, 1]`` (TorchRL's reward parsers write ``[B, 1, 1]``); both give
  the same per-token ``[B, T, 1]`` result.
- ``gen_model=None`` (RetrieveKL) uses the generation log-probs already in the data (e.g. the
  inference engine's): no second scoring pass.
- ``estimator="k3"`` gives ``exp(r) - r - 1`` with ``r = ref - gen``
  (:func:`rlpost.algo.kl_per_token`), a non-negative estimate; TorchRL has only k1, ``gen - ref``.
- KLComputation also accepts its TorchRL docstring's spellings (``gen_log_probs_key``,
  ``ref_log_probs_key``, ``coef``).
- ``reward_per="sequence"`` keeps one reward per sequence, ``reward - coeff * sum_t kl_t``
  (RLHF's KL-shaped reward, one scalar per sample as GRPO's group advantages need); ``mask_key``
  zeroes the KL outside a mask of the data (e.g. the generated tokens) before it is written and
  summed. rlpost's ``reference`` actor penalises the rewards of ``reference.kl_in: reward`` so.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey
from torch.nn.utils.rnn import pad_sequence

from rlpost.algo import kl_per_token
from rlpost.data.stacking import get_rows, is_row_stacked, set_rows
from rlpost.envs.kl_service import DEFAULT_RAY_TIMEOUT_S, RayTransform
from rlpost.envs.transforms import Compose, Transform

GEN_LOG_PROBS_FULL = ("log_probs", "full")
REF_LOG_PROBS_FULL = ("ref_log_probs", "full")
ASSISTANT_MASK = ("masks", "all_assistant_mask")


def _target(td: TensorDictBase) -> TensorDictBase:
    """Where a standalone call writes: ``td["next"]`` when present, else ``td`` itself."""
    next_td = td.get("next", None)
    return next_td if next_td is not None else td


def _entry(td: TensorDictBase, key: NestedKey) -> Any:
    """``td[key]``: a tensor, or the list of its rows when stored one per row; None when absent."""
    if key not in td.keys(include_nested=True):
        return None
    if is_row_stacked(td, key):
        return td.get(key, as_list=True)
    return td.get(key)


def _write(td: TensorDictBase, key: NestedKey, rows: list[torch.Tensor], padded: bool, padding_side: str) -> None:
    """Write rows at ``key``: padded into one tensor, or one tensor per row (:func:`set_rows`)."""
    if padded:
        td.set(key, pack_rows(rows, True, padding_side))
    else:
        set_rows(td, key, rows)


def tensor_list(value: Any) -> list[torch.Tensor]:
    """Per-sample tensors of a padded [B, T] tensor, a nested tensor or a list."""
    if isinstance(value, (list, tuple)):
        return [torch.as_tensor(v) for v in value]
    return list(value.unbind(0))


def pack_rows(rows: list[torch.Tensor], padded: bool, padding_side: str) -> torch.Tensor:
    """Rows of different lengths as one tensor: padded with 0 on ``padding_side``, or jagged."""
    if padded:
        return pad_sequence(rows, batch_first=True, padding_value=0.0, padding_side=padding_side)
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


# ---------------------------------------------------------------------------- RetrieveLogProb


class RetrieveLogProb(Transform):
    """Write ``model``'s log-probs of each full sequence (``td[(mode, "full")]``) under
    ``log_probs_full_key`` in ``next``; ``model`` is a wrapper with ``generate=False``.

    ``assistant_only`` zeroes them outside the assistant tokens (needs ``input_mode="history"``,
    as in TorchRL); ``device``: where the model's inputs go (results come back to the data's);
    ``tokenizer_kwargs`` and ``tokenizer`` are recorded for TorchRL compatibility (the wrapper
    renders the chat with its own tokenizer).
    """

    def __init__(
        self,
        model: Any,
        *,
        log_probs_full_key: NestedKey | None = None,
        assistant_only: bool = True,
        tokenizer_kwargs: dict | None = None,
        detach: bool = True,
        device: torch.device | str | None = None,
        tokenizer: Any = None,
        padding_side: str = "left",
    ) -> None:
        super().__init__()
        # TorchRL's wording: its tests match these messages
        name = type(self).__name__
        if not getattr(model, "return_log_probs", True):
            raise ValueError(f"The model must have `return_log_probs=True` to use the `{name}` transform.")
        if getattr(model, "generate", True):
            raise ValueError(
                f"The model must have `generate=False` to use the `{name}` transform: it needs a scoring model"
            )
        input_mode = getattr(model, "input_mode", "history")
        if assistant_only and input_mode != "history":
            raise ValueError(
                f"The model must have `input_mode='history'` when `assistant_only=True`. Current input_mode is "
                f"'{input_mode}': only a history says which tokens are the assistant's. To use input_mode "
                f"'{input_mode}', set `assistant_only=False`."
            )
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        if log_probs_full_key is None:
            log_probs_full_key = (model.log_probs_key, "full")
        elif not (isinstance(log_probs_full_key, tuple) and log_probs_full_key[-1] == "full"):
            warnings.warn(
                f"log_probs_full_key {log_probs_full_key!r} does not end with 'full': KLComputation reads "
                "(<log_probs_key>, 'full') keys",
                stacklevel=2,
            )
        self.model, self.log_probs_full_key = model, log_probs_full_key
        self.assistant_only, self.detach = assistant_only, detach
        self.device = torch.device(device) if device is not None else None
        self.tokenizer, self.padding_side = tokenizer, padding_side
        self.tokenizer_kwargs = {
            "return_assistant_tokens_mask": True, "tokenize": True, "return_dict": True, "padding": False,
            "add_generation_prompt": False, **(tokenizer_kwargs or {}),
        }  # fmt: skip

    @property
    def pad_output(self) -> bool:
        return bool(getattr(self.model, "pad_output", True))

    def log_probs(self, td: TensorDictBase) -> torch.Tensor:
        """The masked log-probs as one tensor: padded, or jagged with ``pad_output=False``."""
        return pack_rows(self._rows(td), self.pad_output, self.padding_side)

    def _rows(self, td: TensorDictBase) -> list[torch.Tensor]:
        """The masked log-probs of each full sequence, on ``td``'s device."""
        source_device = td.device
        data = td.copy() if self.device is None else td.to(self.device)
        with torch.set_grad_enabled(not self.detach):
            scored = self.model(data)
        rows = get_rows(scored, (self.model.log_probs_key, "full"))
        if self.assistant_only:
            masks = get_rows(scored, (self.model.masks_key, "all_assistant_mask"))
            if masks is None:
                raise ValueError(
                    "assistant_only=True but the model returned no assistant mask "
                    f"({self.model.masks_key!r}, 'all_assistant_mask'): build it with return_masks=True"
                )
            rows = [row.masked_fill(~mask.bool(), 0.0) for row, mask in zip(rows, masks)]
        if self.detach:
            rows = [row.detach() for row in rows]
        if source_device is not None and self.device is not None:
            rows = [row.to(source_device) for row in rows]
        return rows

    def on_step(self, td: TensorDictBase, next_td: TensorDictBase) -> TensorDictBase:
        _write(next_td, self.log_probs_full_key, self._rows(td), self.pad_output, self.padding_side)
        return next_td

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        self.on_step(td, _target(td))
        return td

    forward = __call__

    def __repr__(self) -> str:
        return f"RetrieveLogProb(key={self.log_probs_full_key!r}, assistant_only={self.assistant_only})"


# ---------------------------------------------------------------------------- KLComputation


class KLComputation(Transform):
    """Per-token KL of two log-prob entries of ``next`` under ``kl_key``; with ``add_to_reward``
    ``reward - coeff * kl`` per token (``[B, T, 1]``), or with ``reward_per="sequence"``
    ``reward - coeff * kl.sum()`` per row (the reward keeps its shape, ``[B]`` or ``[B, 1]``).
    ``mask_key``: a boolean ``[B, T]`` entry, the KL zero where it is False; padded inputs give
    padded outputs, ragged ones are stored one tensor per row. ``estimator``: see the module
    docstring.
    """

    def __init__(
        self,
        gen_log_probs_full_key: NestedKey = GEN_LOG_PROBS_FULL,
        ref_log_probs_full_key: NestedKey = REF_LOG_PROBS_FULL,
        *,
        kl_key: NestedKey = "kl_penalty",
        add_to_reward: bool = True,
        coeff: float = 1.0,
        padding_side: str = "left",
        estimator: Literal["k1", "k3"] = "k1",
        reward_per: Literal["token", "sequence"] = "token",
        mask_key: NestedKey | None = None,
        gen_log_probs_key: NestedKey | None = None,
        ref_log_probs_key: NestedKey | None = None,
        coef: float | None = None,
    ) -> None:
        super().__init__()
        if estimator not in ("k1", "k3"):
            raise ValueError(f"estimator must be 'k1' or 'k3', got {estimator!r}")
        if reward_per not in ("token", "sequence"):
            raise ValueError(f"reward_per must be 'token' or 'sequence', got {reward_per!r}")
        self.gen_log_probs_full_key = gen_log_probs_key if gen_log_probs_key is not None else gen_log_probs_full_key
        self.ref_log_probs_full_key = ref_log_probs_key if ref_log_probs_key is not None else ref_log_probs_full_key
        self.kl_key, self.add_to_reward = kl_key, add_to_reward
        self.coeff = float(coef if coef is not None else coeff)
        self.padding_side, self.estimator = padding_side, estimator
        self.reward_per, self.mask_key = reward_per, mask_key

    def kl(self, next_td: TensorDictBase) -> torch.Tensor:
        """The per-token KL as one tensor (padded in, padded out; else jagged)."""
        rows, padded = self._kl_rows(next_td)
        return pack_rows(rows, padded, self.padding_side)

    def _kl_rows(self, next_td: TensorDictBase) -> tuple[list[torch.Tensor], bool]:
        """The per-token KL of each row, and whether the inputs were padded tensors."""
        gen, ref = _entry(next_td, self.gen_log_probs_full_key), _entry(next_td, self.ref_log_probs_full_key)
        for key, value in ((self.gen_log_probs_full_key, gen), (self.ref_log_probs_full_key, ref)):
            if value is None:
                raise ValueError(
                    f"KLComputation needs log-probs under {key!r}; found keys "
                    f"{sorted(map(str, next_td.keys(include_nested=True, leaves_only=True)))}"
                )
        gen_rows, ref_rows = tensor_list(gen), tensor_list(ref)
        if len(gen_rows) != len(ref_rows):
            raise ValueError(f"{len(gen_rows)} generation log-prob rows but {len(ref_rows)} reference rows")
        for i, (g, r) in enumerate(zip(gen_rows, ref_rows)):
            if g.shape != r.shape:
                raise ValueError(
                    f"sample {i}: generation log-probs {tuple(g.shape)} and reference log-probs {tuple(r.shape)} differ: "
                    "both must come from the same layout (same pad_output; keep the EOS token when pad == eos)"
                )
        rows = [kl_per_token(g, r.to(g.device), self.estimator) for g, r in zip(gen_rows, ref_rows)]
        if self.mask_key is not None:
            masks = _entry(next_td, self.mask_key)
            if masks is None:
                raise ValueError(f"KLComputation(mask_key={self.mask_key!r}) found no mask there")
            rows = [row.masked_fill(~mask.bool().to(row.device), 0.0) for row, mask in zip(rows, tensor_list(masks))]
        return rows, isinstance(gen, torch.Tensor) and not gen.is_nested

    def apply(self, next_td: TensorDictBase) -> TensorDictBase:
        """Write the KL (and the penalised reward) into ``next_td``."""
        kl_rows, padded = self._kl_rows(next_td)
        _write(next_td, self.kl_key, kl_rows, padded, self.padding_side)
        if self.add_to_reward:
            reward = _entry(next_td, "reward")
            if reward is not None:
                penalised = self._penalised(tensor_list(reward), kl_rows)
                if padded or self.reward_per == "sequence":  # one reward per row: a plain tensor
                    next_td.set("reward", torch.stack(penalised))
                else:
                    set_rows(next_td, "reward", penalised)
        return next_td

    def _penalised(self, reward_rows: list[torch.Tensor], kl_rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each row's penalised reward (see the class docstring)."""
        if self.reward_per == "sequence":
            return [r - self.coeff * k.to(r.dtype).sum() for r, k in zip(reward_rows, kl_rows)]
        out = []
        for i, (r, k) in enumerate(zip(reward_rows, kl_rows)):
            if r.ndim == k.ndim:  # rlpost's [1] per sample: one scalar for every token
                r = r.unsqueeze(-1)
            if r.ndim != k.ndim + 1:
                raise ValueError(
                    f"sample {i}: reward of shape {tuple(r.shape)} cannot take a per-token KL of shape {tuple(k.shape)}: "
                    "rewards must be [B, 1], [B, 1, 1] or [B, T, 1]"
                )
            out.append(r - self.coeff * k.unsqueeze(-1).to(r.dtype))
        return out

    def on_step(self, td: TensorDictBase, next_td: TensorDictBase) -> TensorDictBase:
        return self.apply(next_td)

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        self.apply(_target(td))
        return td

    forward = __call__

    def __repr__(self) -> str:
        per = "" if self.reward_per == "token" else f", reward_per={self.reward_per!r}"
        return f"KLComputation(kl_key={self.kl_key!r}, add_to_reward={self.add_to_reward}, coeff={self.coeff}{per})"


# ---------------------------------------------------------------------------- RetrieveKL


class RetrieveKL(Compose):
    """Generation log-probs, reference log-probs, then their KL (TorchRL's ``RetrieveKL``).

    ``gen_model``: a scoring wrapper of the generating policy; ``"from_collector"`` (default)
    builds it at first use from the policy of the collector the env is registered with; None
    uses the generation log-probs already at ``gen_log_probs_full_key``. The ``*_factory``
    arguments build the models instead (what a Ray service runs remotely); the other keywords
    are :class:`RetrieveLogProb`'s and :class:`KLComputation`'s (``history_key`` is recorded).
    ``use_ray_service``: a :class:`RayRetrieveKL` instead (``actor_name``, ``num_cpus``,
    ``num_gpus``, ``timeout_s`` go to it).
    """

    def __new__(cls, *args: Any, use_ray_service: bool = False, **kwargs: Any):
        if use_ray_service and cls is RetrieveKL:
            return RayRetrieveKL(*args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        gen_model: Any = "from_collector",
        ref_model: Any = None,
        *,
        gen_model_factory: Callable[[], Any] | None = None,
        ref_model_factory: Callable[[], Any] | None = None,
        assistant_only: bool = True,
        history_key: str = "history",
        tokenizer_kwargs: dict[str, Any] | None = None,
        detach: bool = True,
        device: torch.device | str | None = None,
        tokenizer: Any = None,
        padding_side: str = "left",
        gen_log_probs_full_key: NestedKey = GEN_LOG_PROBS_FULL,
        ref_log_probs_full_key: NestedKey = REF_LOG_PROBS_FULL,
        kl_key: NestedKey = "kl_penalty",
        add_to_reward: bool = True,
        coeff: float = 1.0,
        estimator: Literal["k1", "k3"] = "k1",
        reward_per: Literal["token", "sequence"] = "token",
        mask_key: NestedKey | None = None,
        use_ray_service: bool = False,
    ) -> None:
        super().__init__()
        if gen_model_factory is not None:
            if gen_model not in (None, "from_collector"):
                raise ValueError("Cannot provide both 'gen_model' and 'gen_model_factory'. Choose one.")
            gen_model = gen_model_factory()
        if ref_model_factory is not None:
            if ref_model is not None:
                raise ValueError("Cannot provide both 'ref_model' and 'ref_model_factory'. Choose one.")
            ref_model = ref_model_factory()
        if ref_model is None:
            raise ValueError("RetrieveKL needs a reference model: pass ref_model or ref_model_factory")
        self.history_key = history_key
        self._settings = dict(
            assistant_only=assistant_only, tokenizer_kwargs=tokenizer_kwargs, detach=detach, device=device,
            tokenizer=tokenizer, padding_side=padding_side,
        )  # fmt: skip
        self.gen_log_probs_full_key, self.ref_log_probs_full_key = gen_log_probs_full_key, ref_log_probs_full_key
        self.ref_model = ref_model
        self.kl_computation = KLComputation(
            gen_log_probs_full_key, ref_log_probs_full_key, kl_key=kl_key, add_to_reward=add_to_reward, coeff=coeff,
            padding_side=padding_side, estimator=estimator, reward_per=reward_per, mask_key=mask_key,
        )  # fmt: skip
        self._initialized = not (isinstance(gen_model, str) and gen_model == "from_collector")
        if self._initialized:
            self._build(gen_model)

    def _build(self, gen_model: Any, *, distinct_keys: bool = True) -> None:
        ref = self.ref_model
        if gen_model is not None:
            _check_pair(gen_model, ref, distinct_keys=distinct_keys)
            self.append(RetrieveLogProb(gen_model, log_probs_full_key=self.gen_log_probs_full_key, **self._settings))
        self.append(RetrieveLogProb(ref, log_probs_full_key=self.ref_log_probs_full_key, **self._settings))
        self.append(self.kl_computation)
        for transform in self:
            transform.parent = self.parent
        self._initialized = True

    def _init_deferred(self) -> None:
        """``gen_model="from_collector"``: the scoring twin of the collector's policy. The two
        write to distinct full keys, so one ``log_probs_key`` for both is accepted (as TorchRL's
        deferred build)."""
        collector = getattr(self, "collector", None)
        if collector is None and self.parent is not None:
            collector = getattr(self.parent, "collector", None)
        if collector is None:
            raise ValueError(
                "RetrieveKL(gen_model='from_collector') needs a collector: register the env with an LLMCollector "
                "(or set transform.collector) before the first step, or pass gen_model"
            )
        key = self.gen_log_probs_full_key
        if not (isinstance(key, tuple) and key[-1] == "full"):
            raise ValueError(f"gen_log_probs_full_key must be a tuple ending with 'full', got {key!r}")
        ref = self.ref_model
        gen_model = collector.policy.get_new_version(
            generate=False, return_log_probs=True, log_probs_key=key[0] if len(key) == 2 else key[:-1],
            input_mode=ref.input_mode, pad_output=getattr(ref, "pad_output", True),
        )  # fmt: skip
        self._build(gen_model, distinct_keys=False)

    def on_step(self, td: TensorDictBase, next_td: TensorDictBase) -> TensorDictBase:
        if not self._initialized:
            self._init_deferred()
        return super().on_step(td, next_td)

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        if not self._initialized:
            self._init_deferred()
        for transform in self:  # each writes into td["next"] (or td), the next one reads there
            transform(td)
        return td

    forward = __call__

    def __repr__(self) -> str:
        state = "" if self._initialized else ", gen_model='from_collector' (not built yet)"
        return f"RetrieveKL({', '.join(map(repr, self))}{state})"


def _check_pair(gen_model: Any, ref_model: Any, *, distinct_keys: bool = True) -> None:
    """TorchRL's checks of a (generation, reference) pair; ``distinct_keys`` also refuses one
    ``log_probs_key`` for both (TorchRL checks that for models given to the constructor only)."""
    for name, model in (("generation", gen_model), ("reference", ref_model)):
        if not getattr(model, "return_log_probs", True):
            raise ValueError(f"The {name} model must have return_log_probs=True to use RetrieveKL")
        if getattr(model, "generate", False):
            raise ValueError(f"The {name} model must have generate=False to use RetrieveKL")
    if getattr(gen_model, "pad_output", None) != getattr(ref_model, "pad_output", None):
        raise ValueError(
            f"pad_output mismatch: gen_model.pad_output={gen_model.pad_output}, ref_model.pad_output={ref_model.pad_output}; "
            "both models must use the same padding for the KL"
        )
    if distinct_keys and getattr(gen_model, "log_probs_key", "gen") == getattr(ref_model, "log_probs_key", "ref"):
        raise ValueError("The generation and reference models must have different log_probs_key values")


class RayRetrieveKL(RayTransform):
    """:class:`RetrieveKL` built in one shared Ray actor from the models or factories sent to it;
    with ``actor_name`` of a running actor (e.g. an rlpost run's ``"reference"``) no model is
    needed: the env attaches to it."""

    def __init__(
        self,
        gen_model: Any = "from_collector",
        ref_model: Any = None,
        *,
        gen_model_factory: Callable[[], Any] | None = None,
        ref_model_factory: Callable[[], Any] | None = None,
        num_cpus: float | None = None,
        num_gpus: float = 0,
        device: torch.device | str | None = None,
        actor_name: str | None = None,
        timeout_s: float = DEFAULT_RAY_TIMEOUT_S,
        **kwargs: Any,
    ) -> None:
        if gen_model_factory is not None and gen_model not in (None, "from_collector"):
            raise ValueError("Cannot provide both 'gen_model' and 'gen_model_factory'. Choose one.")
        if ref_model is not None and ref_model_factory is not None:
            raise ValueError("Cannot provide both 'ref_model' and 'ref_model_factory'. Choose one.")
        has_model = ref_model is not None or ref_model_factory is not None
        if gen_model == "from_collector" and gen_model_factory is None and has_model:
            raise ValueError(
                "RayRetrieveKL cannot reach the local collector from its actor: pass gen_model or gen_model_factory"
            )
        make = None
        if has_model:
            make = functools.partial(
                RetrieveKL, **kwargs, gen_model=gen_model, ref_model=ref_model, gen_model_factory=gen_model_factory,
                ref_model_factory=ref_model_factory, device=device,
            )  # fmt: skip
        super().__init__(make, num_cpus=num_cpus, num_gpus=num_gpus, device=device, actor_name=actor_name,
                         timeout_s=timeout_s)  # fmt: skip
