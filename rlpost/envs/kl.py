"""KL to a reference model, as env transforms (TorchRL's ``torchrl.envs.llm.transforms.kl``).

- :class:`RetrieveLogProb` scores a model (``generate=False``) on the full sequences of a step
  (``td[(mode, "full")]``) and writes its log-probs under ``next`` (zeroed outside the assistant
  tokens when ``assistant_only``), padded (``pad_output=True``, ``padding_side``) or, with
  ``pad_output=False``, one tensor per row: ``td.get(key, as_list=True)`` gives the rows back,
  as from TorchRL's transform (:func:`~rlpost.data.stacking.set_rows` says how they are stored).
- :class:`KLComputation` reads generation and reference log-probs from ``next`` and writes the
  per-token KL ``gen - ref`` under ``kl_key``; with ``add_to_reward`` the reward becomes
  per-token: ``reward - coeff * kl`` with shape ``[B, T, 1]`` (rows stored as RetrieveLogProb's
  when ragged).
- :class:`RetrieveKL` chains them (a :class:`~rlpost.envs.transforms.Compose`): generation
  log-probs (scored by ``gen_model``, or taken from the collector's policy with
  ``gen_model="from_collector"``), reference log-probs, then the KL.
- :class:`KLRewardTransform` is TorchRL's legacy one-step form: reference log-probs, and
  ``reward - coeff * (log_probs - ref_log_probs)`` per token, with ``kl_penalty`` and
  ``ref_log_prob`` beside it.
- ``use_ray_service=True`` (or :class:`RayRetrieveKL` / :class:`RayKLRewardTransform`) runs
  the transform in one named Ray actor shared by every env that asks for it
  (:class:`KLServiceActor`); rlpost's own ``reference`` actor is such an actor, so an env can
  attach to a running service's reference model with ``RayRetrieveKL(actor_name="reference")``.

As TorchRL, every transform also works on its own: ``transform(td)`` writes into
``td["next"]`` when there is one, else into ``td``; in an env, ``step`` calls it after the base
step. Reset does nothing (there is no action to score yet).

Deliberate deviations from TorchRL:

- rlpost's env rewards are ``[B, 1]`` (TorchRL's LLM reward parsers write ``[B, 1, 1]``); both
  are accepted by ``add_to_reward`` and give the same per-token ``[B, T, 1]`` result.
- ``gen_model=None`` (:class:`RetrieveKL`) uses the generation log-probs already in the data
  (e.g. the ones the inference engine returned): no second scoring pass.
- ``estimator="k3"`` (KLComputation, RetrieveKL) gives ``exp(r) - r - 1`` with
  ``r = ref - gen`` (:func:`rlpost.algo.kl_per_token`), a non-negative estimate; TorchRL has only
  ``gen - ref`` (k1, the default).
- KLComputation also accepts the spellings its TorchRL docstring example uses
  (``gen_log_probs_key``, ``ref_log_probs_key``, ``coef``).
- ``reward_per="sequence"`` (KLComputation, RetrieveKL) keeps one reward per sequence:
  ``reward - coeff * sum_t kl_t`` (RLHF's KL-shaped reward, which GRPO's group advantages need:
  one scalar per sample), where TorchRL's only form makes the reward per token. ``mask_key``
  zeroes the KL outside a mask of the data (e.g. the generated tokens, when the log-probs of
  the prompt are not zero), before it is written and summed. rlpost's ``reference`` actor
  penalises the rewards of ``reference.kl_in: reward`` this way.
- A remote call has a time limit (``timeout_s``): a dead or stuck service raises
  ``TimeoutError`` naming the actor instead of hanging the env.
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
from rlpost.envs.transforms import Compose, Transform

GEN_LOG_PROBS_FULL = ("log_probs", "full")
REF_LOG_PROBS_FULL = ("ref_log_probs", "full")
ASSISTANT_MASK = ("masks", "all_assistant_mask")
DEFAULT_RAY_TIMEOUT_S = 600.0


def _target(td: TensorDictBase) -> TensorDictBase:
    """Where a standalone call writes: ``td["next"]`` when present, else ``td`` itself."""
    next_td = td.get("next", None)
    return next_td if next_td is not None else td


def _entry(td: TensorDictBase, key: NestedKey) -> Any:
    """``td[key]``: a tensor, or a list of its rows when they are stored one per row (a lazy
    stack, even of rows of one length); None when absent."""
    if key not in td.keys(include_nested=True):
        return None
    if is_row_stacked(td, key):
        return td.get(key, as_list=True)
    return td.get(key)


def _write(td: TensorDictBase, key: NestedKey, rows: list[torch.Tensor], padded: bool, padding_side: str) -> None:
    """Write rows at ``key``: padded into one tensor, or one tensor per row (:func:`set_rows`)."""
    if padded:
        td.set(key, _pack(rows, True, padding_side))
    else:
        set_rows(td, key, rows)


def _rows(value: Any) -> list[torch.Tensor]:
    """Per-sample 1-D tensors of a padded [B, T] tensor, a nested tensor or a list."""
    if isinstance(value, (list, tuple)):
        return [torch.as_tensor(v) for v in value]
    if isinstance(value, torch.Tensor) and value.is_nested:
        return list(value.unbind(0))
    return list(value.unbind(0))


def _pack(rows: list[torch.Tensor], padded: bool, padding_side: str) -> torch.Tensor:
    """Rows of different lengths as one tensor: padded with 0 on ``padding_side``, or jagged."""
    if padded:
        return pad_sequence(rows, batch_first=True, padding_value=0.0, padding_side=padding_side)
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


# ---------------------------------------------------------------------------- RetrieveLogProb


class RetrieveLogProb(Transform):
    """Write ``model``'s log-probs of each full sequence under ``log_probs_full_key`` in ``next``.

    Args:
        model: a wrapper built with ``generate=False`` and ``return_log_probs=True``.

    Keyword Args:
        log_probs_full_key: where to write; default ``(model.log_probs_key, "full")``.
        assistant_only: zero the log-probs outside the assistant tokens (the model's
            ``masks.all_assistant_mask``); needs ``input_mode="history"``, as in TorchRL.
        tokenizer_kwargs: TorchRL's keyword (chat-template arguments for the assistant mask);
            recorded, the wrapper renders the chat itself.
        detach: score without gradients.
        device: the device the model's inputs are moved to (results come back to the data's).
        tokenizer: recorded for TorchRL compatibility (the model's tokenizer is used).
        padding_side: side of the padding of padded outputs.
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
        """The model's log-probs of ``td``'s full sequences, masked, as one tensor: padded, or
        jagged with ``pad_output=False`` (the transform itself stores such rows one per row)."""
        return _pack(self._rows(td), self.pad_output, self.padding_side)

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
    """Per-token KL from two log-prob entries of ``next``; optionally a per-token reward penalty.

    Args:
        gen_log_probs_full_key, ref_log_probs_full_key: the two log-prob entries.

    Keyword Args:
        kl_key: where the KL goes.
        add_to_reward: ``reward = reward - coeff * kl`` per token (``[B, T, 1]``), or per
            sequence with ``reward_per="sequence"``.
        coeff: the KL coefficient.
        reward_per: ``"token"`` (TorchRL's) or ``"sequence"``: ``reward - coeff * kl.sum()``
            per row, the reward keeping its shape (``[B]`` or ``[B, 1]``).
        mask_key: a boolean entry of the data (``[B, T]``); the KL is zero where it is False.
            None: every token's KL counts.
        padding_side: side of the padding when ragged rows are padded (padded inputs keep their
            layout; ragged ones are stored one tensor per row).
        estimator: ``"k1"`` (``gen - ref``, TorchRL's) or ``"k3"`` (see the module docstring).
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
        """The per-token KL of ``next_td``'s two entries as one tensor (padded in, padded out;
        else jagged)."""
        rows, padded = self._kl_rows(next_td)
        return _pack(rows, padded, self.padding_side)

    def _kl_rows(self, next_td: TensorDictBase) -> tuple[list[torch.Tensor], bool]:
        """The per-token KL of each row, and whether the inputs were padded tensors."""
        gen, ref = _entry(next_td, self.gen_log_probs_full_key), _entry(next_td, self.ref_log_probs_full_key)
        for key, value in ((self.gen_log_probs_full_key, gen), (self.ref_log_probs_full_key, ref)):
            if value is None:
                raise ValueError(
                    f"KLComputation needs log-probs under {key!r}; found keys "
                    f"{sorted(map(str, next_td.keys(include_nested=True, leaves_only=True)))}"
                )
        gen_rows, ref_rows = _rows(gen), _rows(ref)
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
            rows = [row.masked_fill(~mask.bool().to(row.device), 0.0) for row, mask in zip(rows, _rows(masks))]
        return rows, isinstance(gen, torch.Tensor) and not gen.is_nested

    def apply(self, next_td: TensorDictBase) -> TensorDictBase:
        """Write the KL (and the penalised reward) into ``next_td``."""
        kl_rows, padded = self._kl_rows(next_td)
        _write(next_td, self.kl_key, kl_rows, padded, self.padding_side)
        if self.add_to_reward:
            reward = _entry(next_td, "reward")
            if reward is not None:
                penalised = self._penalised(_rows(reward), kl_rows)
                if padded or self.reward_per == "sequence":  # one reward per row: a plain tensor
                    next_td.set("reward", torch.stack(penalised))
                else:
                    set_rows(next_td, "reward", penalised)
        return next_td

    def _penalised(self, reward_rows: list[torch.Tensor], kl_rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per row, ``reward - coeff * kl`` per token (``[T, 1]``), or with ``reward_per="sequence"``
        ``reward - coeff * kl.sum()`` (the reward's shape)."""
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

    Args:
        gen_model: the generating policy as a scoring wrapper (``generate=False``,
            ``return_log_probs=True``); ``"from_collector"`` (the default) builds it at first
            use from the policy of the collector this transform's env is registered with
            (``policy.get_new_version(generate=False, ...)``); None uses the generation
            log-probs already at ``gen_log_probs_full_key``.
        ref_model: the frozen reference as a scoring wrapper.

    Keyword Args:
        gen_model_factory, ref_model_factory: callables building the models (instead of the
            models themselves; what a Ray service runs remotely).
        assistant_only, tokenizer_kwargs, detach, device, tokenizer, padding_side: as
            :class:`RetrieveLogProb`.
        gen_log_probs_full_key, ref_log_probs_full_key, kl_key, add_to_reward, coeff, estimator,
        reward_per, mask_key: as :class:`KLComputation`.
        history_key: TorchRL's keyword (the history entry); recorded.
        use_ray_service: return a :class:`RayRetrieveKL` instead (one shared Ray actor);
            ``actor_name``, ``num_cpus``, ``num_gpus`` and ``timeout_s`` go to it.
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
        """``gen_model="from_collector"``: the scoring twin of the collector's policy.

        The twin writes to ``gen_log_probs_full_key`` and the reference to
        ``ref_log_probs_full_key``, so a reference with the default ``log_probs_key`` (the
        twin's too) is accepted, as in TorchRL, whose deferred build skips that check."""
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


# ---------------------------------------------------------------------------- KLRewardTransform


class KLRewardTransform(Transform):
    """TorchRL's legacy KL reward: reference log-probs of the action, and per token
    ``reward - coef * (log_probs - ref_log_probs)`` (``RetrieveKL`` is the recommended form).

    Args:
        ref_model: the reference as a scoring wrapper (``generate=False``, input_mode "tokens").
            The legacy form of TorchRL's docstring, ``KLRewardTransform(gen_model, ref_model)``,
            is accepted too (TorchRL's own signature rejects it): the generation model then only
            says where its log-probs are (``(gen_model.log_probs_key, "full")``, unless
            ``log_prob_key`` is given), and a reference in another input mode is scored through
            its tokens-mode twin (``ref_model.get_new_version(input_mode="tokens")``).

    Keyword Args:
        ref_model_factory: a callable building it instead.
        coef: the KL coefficient.
        in_keys, out_keys: ``["reward"]`` and ``[reward, "kl_penalty", "ref_log_prob"]`` by
            default (the two extra keys may be named).
        log_prob_key: the generation log-probs in the step input (``("log_probs", "full")``).
        device, add_to_reward, tokenizer, assistant_only, padding_side: as TorchRL; with
            ``assistant_only`` only the response tokens (after the prompt) count.
        use_ray_service: return a :class:`RayKLRewardTransform` (one shared Ray actor).
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
        kl = _pack([(c - r).unsqueeze(-1) for c, r in zip(cur_rows, ref_rows)], self.pad_output, self.padding_side)
        ref = _pack([r.unsqueeze(-1) for r in ref_rows], self.pad_output, self.padding_side)
        if self.add_to_reward:
            reward = next_td.get(self.in_keys[0], None)
            rewards = [torch.zeros(())] * len(ref_rows) if reward is None else _rows(reward)
            penalised = []
            for r, k in zip(rewards, _rows(kl)):
                r = r.reshape(1, 1) if r.numel() == 1 else r  # one reward per sample: every token gets it
                penalised.append(r.to(k.dtype) - self.coef * k)
            packed = (
                torch.stack(penalised)
                if self.pad_output
                else torch.nested.as_nested_tensor(penalised, layout=torch.jagged)
            )
            next_td.set(self.out_keys[0], packed)
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


# ---------------------------------------------------------------------------- the shared Ray service


class KLServiceActor:
    """The body of a shared KL actor: one transform, called by any number of envs.

    ``RayRetrieveKL`` / ``RayKLRewardTransform`` create it (or find it by name) with
    ``ray.remote``; rlpost's ``reference`` actor subclasses it, so envs can attach to it.
    """

    def __init__(self, transform: Transform | None = None, *, transform_factory: Callable[[], Transform] | None = None):
        if (transform is None) == (transform_factory is None):
            raise ValueError("KLServiceActor needs a transform or a transform_factory")
        self.transform = transform if transform is not None else transform_factory()

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        return self.transform(td)

    def on_step(self, td: TensorDictBase, next_td: TensorDictBase) -> TensorDictBase:
        return self.transform.on_step(td, next_td)

    def describe(self) -> str:
        return repr(self.transform)


class RayTransform(Transform):
    """A transform that runs in a named Ray actor (:class:`KLServiceActor`) shared by the envs
    that ask for the same ``actor_name`` (the first creates it; the others attach).

    Every call waits at most ``timeout_s`` seconds, then raises ``TimeoutError`` naming the
    actor; Ray's own errors (the actor died) propagate with the actor's name.
    """

    def __init__(
        self,
        make_transform: Callable[[], Transform] | None,
        *,
        num_cpus: float | None = None,
        num_gpus: float = 0,
        device: torch.device | str | None = None,
        actor_name: str | None = None,
        timeout_s: float = DEFAULT_RAY_TIMEOUT_S,
    ) -> None:
        super().__init__()
        import ray

        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True)
        self._ray, self.actor_name, self.timeout_s = ray, actor_name, timeout_s
        self.device = torch.device(device) if device is not None else None
        self._actor = self._find_actor(actor_name) if actor_name is not None else None
        if self._actor is None:
            if make_transform is None:
                raise ValueError(f"no Ray actor named {actor_name!r} is running and no model was given to start one")
            options: dict[str, Any] = {"num_cpus": 1 if num_cpus is None else num_cpus, "num_gpus": num_gpus}
            if actor_name is not None:
                options.update(name=actor_name, get_if_exists=True)
            self._actor = ray.remote(KLServiceActor).options(**options).remote(transform_factory=make_transform)

    def _find_actor(self, name: str) -> Any:
        try:
            return self._ray.get_actor(name)
        except ValueError:
            return None

    def _call(self, method: str, *args: TensorDictBase) -> TensorDictBase:
        from ray.exceptions import GetTimeoutError

        source_device = args[0].device
        ref = getattr(self._actor, method).remote(*[arg.cpu() for arg in args])
        try:
            out = self._ray.get(ref, timeout=self.timeout_s)
        except GetTimeoutError:
            raise TimeoutError(
                f"the KL service actor {self.actor_name or self._actor} did not answer within {self.timeout_s} s"
            ) from None
        return out.to(source_device) if source_device is not None else out

    def on_step(self, td: TensorDictBase, next_td: TensorDictBase) -> TensorDictBase:
        out = self._call("on_step", td, next_td)
        next_td.update(out)
        return next_td

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        return self._call("forward", td)

    forward = __call__

    def __repr__(self) -> str:
        return f"{type(self).__name__}(actor_name={self.actor_name!r})"


class RayRetrieveKL(RayTransform):
    """:class:`RetrieveKL` in one shared Ray actor (what ``RetrieveKL(..., use_ray_service=True)``
    returns). Models or factories are sent to the actor, which builds the RetrieveKL there.
    With ``actor_name`` of a running actor (e.g. ``"reference"`` in an rlpost run's namespace)
    no model is needed: the env attaches to it."""

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
