"""What a policy loss reads from its TensorDict batch and its arguments (shared by
:class:`~rlpost.objectives.grpo.GRPOLoss` and its variants): entries read through lazy stacks and
nested tensors, left-padded; per-token and per-sequence shapes checked; TorchRL's argument checks;
the scoring twin of the actor; TorchRL's ``set_keys``."""

from __future__ import annotations

from dataclasses import fields
from numbers import Real

import torch
from tensordict import NestedKey, TensorDict, TensorDictBase
from torch.nn.utils.rnn import pad_sequence

from rlpost.policies.inputs import is_lazy


def set_accepted_keys(loss, **kwargs) -> None:
    """TorchRL's ``set_keys`` of a loss with ``_AcceptedKeys``: None restores a key's default;
    ``ValueError`` for a name it does not accept."""
    accepted = {f.name for f in fields(loss._AcceptedKeys)}
    for name, value in kwargs.items():
        if name not in accepted:
            raise ValueError(f"{name} is not an accepted tensordict key. Accepted keys are: {sorted(accepted)}.")
        setattr(loss._tensor_keys, name, getattr(loss.default_keys(), name) if value is None else value)


def scoring_twin(actor):
    """A twin of ``actor`` on the same model that scores token ids and returns log-probs only."""
    if actor is None:
        return None
    if not hasattr(actor, "get_new_version"):
        raise TypeError(
            f"actor_network must be an rlpost LLM wrapper (e.g. TransformersWrapper(model, generate=False)), "
            f"got {type(actor).__name__}"
        )
    if getattr(actor, "generate", False):
        raise ValueError("GRPOLoss needs a scoring actor (generate=False); use actor.get_new_version(generate=False)")
    if getattr(actor, "input_mode", "tokens") != "tokens":
        actor = actor.get_new_version(input_mode="tokens")
    return actor.get_new_version(
        pad_output=False, return_text=False, return_tokens=False, return_masks=False, inplace="empty"
    )


def clip_bounds(clip_epsilon) -> tuple[float, float]:
    """TorchRL's validation: a number, or a pair (low, high); non-negative; low < 1."""
    if isinstance(clip_epsilon, (tuple, list)):
        if len(clip_epsilon) != 2:
            raise ValueError(f"clip_epsilon tuple must have length 2, got {clip_epsilon!r}.")
        values = tuple(clip_epsilon)
    else:
        values = (clip_epsilon, clip_epsilon)
    for value in values:
        check_number("clip_epsilon", value)
    eps_low, eps_high = (float(v) for v in values)
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"clip_epsilon values must be non-negative, got ({eps_low}, {eps_high}).")
    if eps_low >= 1.0:
        raise ValueError(f"clip_epsilon low must be < 1 (to keep 1 - eps_low > 0), got {eps_low}.")
    return eps_low, eps_high


def check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, Real) or value != value:
        raise ValueError(f"{name} must be a real number, got {value!r}")


def lazy_part(td: TensorDictBase, key: NestedKey):
    """``(the outermost lazy stack on the way to key, the rest of the key)``, or ``(None, None)``
    when the entry is not read through a lazy stack."""
    path = (key,) if isinstance(key, str) else tuple(key)
    for i in range(len(path)):
        node = td if i == 0 else td.get(path[:i], None)
        if node is None or isinstance(node, torch.Tensor):
            return None, None
        if is_lazy(node):
            rest = path[i:]
            return node, rest[0] if len(rest) == 1 else rest
    return None, None


def lazy_rows(td: TensorDictBase, key: NestedKey) -> list[torch.Tensor] | None:
    """The per-row tensors of an entry read through a lazy stack; None for a dense entry."""
    node, rest = lazy_part(td, key)
    return None if node is None else node.get(rest, as_list=True)


def read_padded(td: TensorDictBase, key: NestedKey, padding_value):
    """``td[key]`` as one tensor (None when absent): a lazy stack's rows and a nested tensor's
    are left-padded with ``padding_value``."""
    node, rest = lazy_part(td, key)
    if node is None:
        value = td.get(key, None)
    else:
        value = node.get(rest, None, as_padded_tensor=True, padding_side="left", padding_value=padding_value)
    if isinstance(value, torch.Tensor) and value.is_nested:
        value = pad_sequence(list(value.unbind(0)), batch_first=True, padding_value=padding_value, padding_side="left")
    return value


def per_token_bt(value, key: NestedKey, tokens_bt: torch.Tensor) -> torch.Tensor:
    """``value`` as ``[B, T]`` like the tokens (a trailing dim of 1 is dropped)."""
    if isinstance(value, torch.Tensor) and value.ndim == 3 and value.shape[-1] == 1:
        value = value.squeeze(-1)
    if not isinstance(value, torch.Tensor) or value.shape != tokens_bt.shape:
        raise ValueError(
            f"{key!r} is {describe(value)} but the tokens are {tuple(tokens_bt.shape)}: per-token entries must "
            "be [B, T] in the tokens' layout"
        )
    return value


def advantage_bt(value, key: NestedKey, tokens_bt: torch.Tensor) -> torch.Tensor:
    """One advantage per sequence ``[B]`` (from [B], [B, 1] or [B, 1, 1]) or per token ``[B, T]``
    (from [B, T] or [B, T, 1])."""
    num_rows, width = tokens_bt.shape
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        shape = tuple(value.shape)
        if shape in ((num_rows,), (num_rows, 1), (num_rows, 1, 1)):
            return value.reshape(num_rows)
        if shape in ((num_rows, width), (num_rows, width, 1)):
            return value.reshape(num_rows, width)
    raise ValueError(
        f"{key!r} must be a float tensor of shape [B], [B, 1] (one per sequence) or [B, T], [B, T, 1] (one per "
        f"token) with B, T = {num_rows}, {width}; got {describe(value)}"
    )


def key_list(td: TensorDictBase) -> str:
    """The batch's keys for an error message (no quotes of its own: a KeyError reprs it)."""
    return ", ".join(sorted(str(key) for key in td.keys(True, True)))


def describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def score_and_entropy(actor, tokens_bt: torch.Tensor, attention_bt: torch.Tensor):
    """``actor``'s log-probs and exact entropies ``[B, T]`` from one forward pass, in the batch's layout,
    0 where there is no prediction: through the actor's ``log_probs_and_entropy`` where it
    has one (rlpost's TransformersWrapper: chunked, no ``[B, T, vocab]`` tensor), else from
    its distribution (``get_dist``)."""
    if hasattr(actor, "log_probs_and_entropy"):
        rows = [row[mask].tolist() for row, mask in zip(tokens_bt.cpu(), attention_bt.cpu())]
        logprob_rows, entropy_rows = actor.log_probs_and_entropy(rows)

        def to_batch(values: list[torch.Tensor]) -> torch.Tensor:
            out = torch.zeros(tokens_bt.shape, dtype=values[0].dtype)
            return out.index_put((attention_bt.cpu(),), torch.cat(values))

        return to_batch(logprob_rows), to_batch(entropy_rows)
    try:
        dist = actor.get_dist(actor_input(actor, tokens_bt, attention_bt))
    except NotImplementedError as err:
        raise NotImplementedError(
            f"entropy_estimator='exact' needs the logits of the actor ({type(actor).__name__}.get_dist): {err}. "
            "Build the loss with entropy_estimator='sampled' or entropy_bonus=False."
        ) from err
    logits_device = dist.logits.device
    lengths = attention_bt.sum(dim=1).to(logits_device)
    # the actor's rows are right-padded: row i holds its real tokens at 0 .. len_i - 1
    real_right = torch.arange(dist.logits.shape[1], device=logits_device)[None, :] < lengths[:, None]
    ids_right = torch.zeros(real_right.shape, dtype=torch.long, device=logits_device)
    ids_right = ids_right.index_put((real_right,), tokens_bt[attention_bt].to(logits_device))
    predicted = dist.mask.to(logits_device)
    logprobs_right = torch.where(predicted, dist.log_prob(ids_right), 0.0)
    entropy_right = torch.where(predicted, dist.entropy(), 0.0)

    def to_batch_layout(x_right: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(tokens_bt.shape, dtype=x_right.dtype, device=attention_bt.device)
        return out.index_put((attention_bt,), x_right[real_right].to(attention_bt.device))

    return to_batch_layout(logprobs_right), to_batch_layout(entropy_right)


def actor_input(actor, tokens_bt: torch.Tensor, attention_bt: torch.Tensor) -> TensorDict:
    """The actor's input: the token ids and the attention mask at its keys."""
    td = TensorDict({}, batch_size=tokens_bt.shape[:1])
    td.set(actor.input_key, tokens_bt)
    td.set(actor.attention_mask_key, attention_bt)
    return td
