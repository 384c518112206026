"""IFEval's reward (Zhou et al. 2023): :class:`IfEvalScorer`, its result :class:`IFEvalScoreData`
with TorchRL's API; the env and its row record :class:`~rlpost.envs.ifeval.IFEvalData` are in
:mod:`rlpost.envs.ifeval`.

An IFEval row is a prompt with verifiable instructions: ``instruction_id_list`` (e.g.
``["punctuation:no_comma"]``) and ``kwargs``, one dict of arguments per instruction (e.g.
``{"relation": "at least", "num_words": 300}``). A response is checked against each instruction
strictly (as written) and loosely (followed when any of eight variants passes: without its first
line, its last line or both, each with and without ``*``, forgiving a chatty opening or markdown
bold). ``prompt_level_*_acc``: every instruction followed; ``inst_level_*_acc``: one flag per
instruction. The checkers are Google's own classes through the ``if-verifiable`` package
(``pip install 'rlpost[ifeval]'``); rlpost keeps no copy.

Trap: ``length_constraints:number_sentences`` and ``change_case:capital_word_frequency`` split
sentences with NLTK's punkt tables (``punkt_tab``), which no package ships. rlpost never
downloads at run time nor falls back to another splitter (the reward would silently differ from
the benchmark's): scoring them without the tables raises ``LookupError`` naming
``python -m nltk.downloader punkt_tab``, and a rewarding ``IFEvalEnv`` checks its dataset at
construction. The other 23 instructions need no data.

Deliberate deviations from TorchRL (each tested):

- Every input mode works (TorchRL: history only): "complete" (ended by the end-of-turn or
  end-of-sequence marker, not cut at the token limit) is ``History.is_complete`` in history mode,
  as in TorchRL, and the marker ending the raw response in text and tokens modes.
- The reward is float32 ``[B, 1]``, added to ``next["reward"]`` (TorchRL overwrites it with a
  ``[B, 1, 1]`` tensor), so it composes with other reward transforms.
- The configured ``instruction_ids_key`` / ``keyword_args_key`` are read (TorchRL's scoring
  reads ``"instruction_id_list"`` / ``"kwargs"`` whatever was passed).
- A checker taking a ``prompt`` (none of the 25 does today) gets the strings under
  ``prompt_key``, else the env's query; TorchRL passes the prompt history's last message, that
  query in a one-step episode.
- An unknown instruction id, a row whose kwargs do not match its instructions, or missing punkt
  data raise an error naming it (TorchRL: a ``KeyError`` or ``TypeError`` deep in the checkers).
- Only ``None`` arguments are dropped from ``kwargs`` (TorchRL drops every falsy value, so an
  explicit 0 would be replaced by a random value drawn by the checker).
- Language detection (``language:response_language``, ``change_case:english_capital`` and
  ``change_case:english_lowercase``) is made deterministic by fixing langdetect's random state
  at 0 when the user has not fixed it; otherwise the same response could score differently.
- :class:`IFEvalScoreData` fields are always bool tensors (a missing field is False, TorchRL's is
  a float 0), and its spec gives them their trailing dim (1 or the number of instructions).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tensordict import NonTensorStack, TensorClass, TensorDictBase, lazy_stack
from tensordict.utils import is_non_tensor

from rlpost.data import specs
from rlpost.envs.chat import ChatEnv, as_list
from rlpost.envs.rewards import add_reward, end_episodes
from rlpost.envs.transforms import Transform

__all__ = ["PUNKT_INSTRUCTIONS", "IFEvalScoreData", "IfEvalScorer", "require_punkt"]

logger = logging.getLogger(__name__)

# Instructions whose checkers split text with NLTK's punkt tokenizer (data: punkt_tab).
PUNKT_INSTRUCTIONS = frozenset({"length_constraints:number_sentences", "change_case:capital_word_frequency"})
PUNKT_RESOURCE = "tokenizers/punkt_tab/english/"
PUNKT_INSTALL = "python -m nltk.downloader punkt_tab"

_THINK_RE = re.compile(r"<think>(.*?)</think>", re.DOTALL)
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_FIELDS = ("prompt_level_strict_acc", "inst_level_strict_acc", "prompt_level_loose_acc", "inst_level_loose_acc")


# ---------------------------------------------------------------------------- the checkers


def _checkers() -> tuple[Mapping[str, type], Callable[[str], list[str]]]:
    """Google's instruction registry and the loose variants of a response, from ``if-verifiable``."""
    try:
        from if_verifiable.common import get_loose_transformations
        from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT
    except ImportError as exc:
        raise ImportError(
            "IFEval scoring uses Google's instruction checkers from the 'if-verifiable' package, which "
            f"could not be imported ({exc}); install it with: pip install 'rlpost[ifeval]'"
        ) from exc
    from langdetect import DetectorFactory

    if DetectorFactory.seed is None:  # see the module docstring: deterministic language detection
        DetectorFactory.seed = 0
    return INSTRUCTION_DICT, get_loose_transformations


def require_punkt(instruction_id: str) -> None:
    """Raise ``LookupError`` naming the data and its install command when NLTK's punkt tables,
    which ``instruction_id``'s checker needs, are not installed. Nothing is downloaded."""
    import nltk

    try:
        nltk.data.find(PUNKT_RESOURCE)
    except LookupError:
        raise LookupError(
            f"IFEval instruction {instruction_id!r} splits text with NLTK's punkt tokenizer, whose data "
            f"'punkt_tab' is not installed (NLTK looked in {list(nltk.data.path)}). rlpost never downloads "
            f"data at run time: install it once with `{PUNKT_INSTALL}` (or set NLTK_DATA to a folder "
            "holding tokenizers/punkt_tab)"
        ) from None


def _as_instruction_ids(value: Any, where: str) -> list[str]:
    if isinstance(value, str):  # a single id, as TorchRL's collate function accepts
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where}: the instruction ids must be a list of strings, got {value!r}")
    if not value:
        raise ValueError(f"{where}: the row lists no instructions")
    return list(value)


def _as_kwargs_list(value: Any, num: int, where: str) -> list[dict[str, Any]]:
    if value is None:
        value = [{}] * num
    elif isinstance(value, Mapping):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(v is None or isinstance(v, Mapping) for v in value):
        raise ValueError(f"{where}: kwargs must be a list of dicts (one per instruction), got {value!r}")
    if len(value) != num:
        raise ValueError(f"{where}: {num} instructions but {len(value)} kwargs dicts (one per instruction is needed)")
    return [{k: v for k, v in (d or {}).items() if v is not None} for d in value]


def build_checker(registry: Mapping[str, type], instruction_id: str, kwargs: dict[str, Any], prompt: str,
                   where: str) -> Any:  # fmt: skip
    checker = registry[instruction_id](instruction_id)
    try:
        checker.build_description(**kwargs)
    except (TypeError, ValueError) as exc:  # an unknown argument name, or a value the checker refuses
        raise ValueError(f"{where}: bad kwargs {kwargs!r} for IFEval instruction {instruction_id!r}: {exc}") from exc
    args = checker.get_instruction_args()
    if args and "prompt" in args:
        checker.build_description(prompt=prompt)
    return checker


def _follows(checker: Any, text: str, instruction_id: str) -> bool:
    if not text.strip():
        return False
    try:
        return bool(checker.check_following(text))
    except LookupError:  # NLTK data vanished after the check (e.g. NLTK_DATA changed)
        require_punkt(instruction_id)
        raise


# ---------------------------------------------------------------------------- the score


class IFEvalScoreData(TensorClass["nocast"]):
    """The IFEval score of a response (TorchRL's ``IFEvalScoreData``): bool tensors, ``[*batch, 1]``
    at prompt level and ``[*batch, n]`` (one per instruction) at instruction level.

    A field without its trailing dim gets it and a missing one is ``False`` ``[*batch, 1]``, as in
    TorchRL. The scorer writes one 0-d score per row, lazily stacked into ``[B]`` (rows differ in
    instruction count: read instruction-level fields with ``as_list=True`` or
    ``as_padded_tensor=True``).
    """

    prompt_level_strict_acc: Any = None
    inst_level_strict_acc: Any = None
    prompt_level_loose_acc: Any = None
    inst_level_loose_acc: Any = None

    def __post_init__(self):
        for name in _FIELDS:
            value = self._tensordict.get(name, None)
            if value is None:
                value = torch.zeros((*self.batch_size, 1), dtype=torch.bool, device=self.device)
            else:
                if is_non_tensor(value):
                    value = value.tolist() if isinstance(value, NonTensorStack) else value.data
                value = torch.as_tensor(value, device=self.device).bool()
                if value.ndim == self.batch_dims:
                    value = value.unsqueeze(-1)
            setattr(self, name, value)

    @classmethod
    def default_spec(cls, shape=(), device: torch.device | str | None = None) -> specs.Composite:
        """The spec of a score of batch ``shape`` (``-1``: any number of instructions)."""
        shape = tuple(shape)
        entries = {
            name: specs.Unbounded((*shape, 1 if name.startswith("prompt") else -1), dtype=torch.bool, device=device)
            for name in _FIELDS
        }
        return specs.Composite(entries, shape=shape, device=device, data_cls=cls, step_mdp_static=True)


# ---------------------------------------------------------------------------- the scorer


class IfEvalScorer(Transform):
    """Score each latest response against its row's IFEval instructions (module docstring).

    As in TorchRL only the first ``<answer>...</answer>`` block is checked (none: the empty
    response, which follows nothing). ``next[score_key]`` gets an :class:`IFEvalScoreData` per row
    (lazily stacked); with ``aggregate_reward`` the reward is added to ``next["reward"]``; with
    ``set_done_if_answer`` a row whose response holds an answer block is terminated.

    Keyword Args:
        prompt_key: the prompt handed to checkers that take one, when it holds strings;
            otherwise the env's query.
        id_key: the row's identifier, shown in error messages.
        response_column: TorchRL 0.9's response key, accepted for compatibility (the scorer
            reads the env's latest policy message, as current TorchRL does).
        aggregate_reward: True for :meth:`default_reward_aggregator`, a callable
            ``f(score, think_blocks=..., answer_blocks=..., complete=...)`` returning one value
            per row, or False for no reward.
        format_weights: the default aggregator's weights of the four score fields, in
            :class:`IFEvalScoreData`'s order.
        verbose: log each row's response and score at INFO level.

    A step input without the instruction ids or kwargs raises ``ValueError`` naming the key.
    """

    def __init__(
        self,
        *,
        instruction_ids_key: str | tuple[str, ...] = "instruction_id_list",
        prompt_key: str | tuple[str, ...] = "text",
        keyword_args_key: str | tuple[str, ...] = "kwargs",
        id_key: str | tuple[str, ...] = "key",
        response_column: str | tuple[str, ...] = "text_response",
        score_key: str | tuple[str, ...] = "ifeval_score",
        aggregate_reward: bool | Callable[..., Any] = True,
        format_weights: Sequence[float] | None = None,
        verbose: bool = False,
        set_done_if_answer: bool = True,
    ) -> None:
        super().__init__()
        self.registry, self._loose_variants = _checkers()
        self.instruction_ids_key, self.prompt_key = instruction_ids_key, prompt_key
        self.keyword_args_key, self.id_key = keyword_args_key, id_key
        self.response_key, self.score_key = response_column, score_key
        self.aggregate_reward, self.verbose, self.set_done_if_answer = aggregate_reward, verbose, set_done_if_answer
        weights = [0.4, 0.3, 0.2, 0.1] if format_weights is None else [float(w) for w in format_weights]
        if len(weights) != 4:
            raise ValueError(
                f"IfEvalScorer format_weights needs 4 weights (one per score field), got {format_weights!r}"
            )
        self.format_weights = weights
        self._stop_markers: list[str] | None = None

    @property
    def expected_keys(self) -> list:
        """The keys the scorer reads (TorchRL's property)."""
        return [self.instruction_ids_key, self.prompt_key, self.keyword_args_key, self.id_key, self.response_key]

    # ------------------------------------------------------------------ checking one response

    def check_instructions(self, instruction_ids: Any, kwargs: Any = None, *, where: str = "IFEval row") -> tuple:
        """``(ids, kwargs_list)`` of one row, normalised (``None`` arguments dropped), after checking
        the ids are known, one kwargs dict per id, and the punkt data where needed (``ValueError``,
        ``LookupError`` for the data)."""
        ids = _as_instruction_ids(instruction_ids, where)
        kwargs_list = _as_kwargs_list(kwargs, len(ids), where)
        for instruction_id in ids:
            if instruction_id not in self.registry:
                raise ValueError(
                    f"{where}: unknown IFEval instruction id {instruction_id!r}; "
                    f"the known ids are {sorted(self.registry)}"
                )
            if instruction_id in PUNKT_INSTRUCTIONS:
                require_punkt(instruction_id)
        return ids, kwargs_list

    def score(self, response: str, instruction_ids: Any, kwargs: Any = None, prompt: str = "", *,
              where: str = "IFEval row") -> IFEvalScoreData:  # fmt: skip
        """The strict and loose score of ``response`` (the text checked, e.g. an answer block)
        against one row's instructions: an :class:`IFEvalScoreData` of batch ``[]``."""
        ids, kwargs_list = self.check_instructions(instruction_ids, kwargs, where=where)
        variants = self._loose_variants(response)
        strict, loose = [], []
        for instruction_id, arguments in zip(ids, kwargs_list):
            checker = build_checker(self.registry, instruction_id, arguments, prompt, where)
            strict.append(_follows(checker, response, instruction_id))
            loose.append(any(_follows(checker, text, instruction_id) for text in variants))
        return IFEvalScoreData(
            prompt_level_strict_acc=torch.tensor([all(strict)]),
            inst_level_strict_acc=torch.tensor(strict, dtype=torch.bool),
            prompt_level_loose_acc=torch.tensor([all(loose)]),
            inst_level_loose_acc=torch.tensor(loose, dtype=torch.bool),
            batch_size=[],
        )

    # ------------------------------------------------------------------ the reward

    def default_reward_aggregator(
        self,
        score: IFEvalScoreData,
        think_blocks: list[str] | None = None,
        answer_blocks: list[str] | None = None,
        complete: bool | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """TorchRL's reward of one row, in ``[0, 1.15]`` with the default weights (sum 1), shape
        ``score.batch_size + (1,)``, default float dtype:

            reward = format_weights . (prompt strict, mean inst strict, prompt loose, mean inst loose)
                     + 0.1 [exactly one answer block] + 0.05 [exactly one think block]

        ``complete`` is accepted and, as in TorchRL, unused. A reply without an answer block
        earns at most the think bonus.
        """
        dtype = torch.get_default_dtype()
        fields = [getattr(score, name).to(dtype) for name in _FIELDS]
        components_b4 = torch.stack(
            [fields[0].sum(-1), fields[1].mean(-1), fields[2].sum(-1), fields[3].mean(-1)], dim=-1
        )
        weights = torch.tensor(self.format_weights, dtype=dtype, device=components_b4.device)
        metrics = (components_b4 * weights).sum(-1, keepdim=True)
        bonus = 0.0
        if answer_blocks and len(answer_blocks) == 1:
            bonus += 0.1
        if think_blocks and len(think_blocks) == 1:
            bonus += 0.05
        return metrics + bonus

    def _reward(self, score: IFEvalScoreData, think: list[str], answer: list[str], complete: bool, where: str) -> float:
        aggregate = self.aggregate_reward if callable(self.aggregate_reward) else self.default_reward_aggregator
        value = aggregate(score, think_blocks=think, answer_blocks=answer, complete=complete)
        value = torch.as_tensor(value)
        if value.numel() != 1:
            raise ValueError(
                f"{where}: the reward aggregator must return one value per row, got shape {tuple(value.shape)}"
            )
        return float(value.reshape(()))

    # ------------------------------------------------------------------ the step

    def on_step(self, td: TensorDictBase, next_td: TensorDictBase) -> TensorDictBase:
        env = self._chat_env()
        num_envs = td.batch_size[0]
        ids_per_row = self._column(td, self.instruction_ids_key, "the instruction ids")
        kwargs_per_row = self._column(td, self.keyword_args_key, "the instruction kwargs")
        row_ids = self._row_ids(td, num_envs)
        prompts = self._prompts(env, td, num_envs)
        responses = env.last_responses(td)
        completes = self._completed(env, td, num_envs)
        scores, rewards, answered = [], [], []
        for i in range(num_envs):
            where = f"IfEvalScorer, row {i}" + (f" ({self.id_key}={row_ids[i]!r})" if row_ids[i] is not None else "")
            think, answer = _THINK_RE.findall(responses[i]), _ANSWER_RE.findall(responses[i])
            score = self.score(answer[0] if answer else "", ids_per_row[i], kwargs_per_row[i], prompts[i], where=where)
            scores.append(score)
            answered.append(bool(answer))
            if self.aggregate_reward:
                rewards.append(self._reward(score, think, answer, completes[i], where))
            if self.verbose:
                logger.info("%s: response %r -> %s, reward %s", where, responses[i], score.to_dict(),
                            rewards[-1] if rewards else None)  # fmt: skip
        stacked = lazy_stack(scores)
        next_td.set(self.score_key, stacked.to(next_td.device) if next_td.device is not None else stacked)
        if self.aggregate_reward:
            add_reward(next_td, rewards)
        if self.set_done_if_answer:
            end_episodes(next_td, answered)
        return next_td

    def _column(self, td: TensorDictBase, key: Any, what: str) -> list:
        if key not in td.keys(include_nested=isinstance(key, tuple)):
            raise ValueError(
                f"IfEvalScorer needs {what} under {key!r} in the step input (IFEvalEnv puts each row's "
                f"columns there; on another env, pass them in the reset input); "
                f"the step input has keys {sorted(map(str, td.keys()))}"
            )
        return as_list(td.get(key), td.batch_size[0])

    def _row_ids(self, td: TensorDictBase, num_envs: int) -> list:
        value = td.get(self.id_key, None)
        if value is None:
            return [None] * num_envs
        if isinstance(value, torch.Tensor) and not is_non_tensor(value):
            return value.reshape(num_envs, -1)[:, 0].tolist()
        return as_list(value, num_envs)

    def _prompts(self, env: ChatEnv, td: TensorDictBase, num_envs: int) -> list[str]:
        for key in (self.prompt_key, env.data_key):
            value = td.get(key, None)
            if is_non_tensor(value):
                values = as_list(value, num_envs)
                if all(isinstance(v, str) for v in values):
                    return values
        return [""] * num_envs

    def _completed(self, env: ChatEnv, td: TensorDictBase, num_envs: int) -> list[bool]:
        """Whether each latest response ended with the end-of-turn / end-of-sequence marker."""
        if env.input_mode == "history":
            rows = td.get("history").full.to_chats(include_state=True)
            return [bool(row) and row[-1]["role"] == env.policy_role and bool(row[-1].get("is_complete", True))
                    for row in rows]  # fmt: skip
        markers = self._markers(env)
        if env.input_mode == "text":
            raw = self._raw_texts(env, td, num_envs)
        else:
            pad = env.tokenizer.pad_token
            responses = [row.response.tolist() for row in td.get("tokens").unbind(0)]
            raw = [env.tokenizer.decode(ids, skip_special_tokens=False) for ids in responses]
            if pad and pad not in markers:  # a padded row: its padding follows the marker
                raw = [_strip_suffix(text, pad) for text in raw]
        return [any(text.rstrip().endswith(marker) for marker in markers) for text in raw]

    def _markers(self, env: ChatEnv) -> list[str]:
        if self._stop_markers is None:
            from rlpost.envs.turns import TurnRenderer

            markers = [env.tokenizer.eos_token or ""]
            try:
                markers.append(TurnRenderer(env.tokenizer, env.policy_role, env.template_kwargs).turn_end().strip())
            except (ValueError, TypeError):  # a template that does not render message by message
                pass
            self._stop_markers = sorted({m for m in markers if m})
        return self._stop_markers

    @staticmethod
    def _raw_texts(env: ChatEnv, td: TensorDictBase, num_envs: int) -> list[str]:
        response = td.get(("text", "response"), None)
        if response is not None:
            return as_list(response, num_envs)
        fulls = as_list(td.get(("text", "full")), num_envs)
        prompts = as_list(td.get(("text", "prompt")), num_envs)
        return [full[len(p) :] if full.startswith(p) else "" for full, p in zip(fulls, prompts)]

    def __repr__(self) -> str:
        return (
            f"IfEvalScorer(instruction_ids_key={self.instruction_ids_key!r}, "
            f"keyword_args_key={self.keyword_args_key!r}, "
            f"score_key={self.score_key!r}, aggregate_reward={self.aggregate_reward!r}, "
            f"set_done_if_answer={self.set_done_if_answer})"
        )


def _strip_suffix(text: str, suffix: str) -> str:
    stripped = text.rstrip()
    while stripped.endswith(suffix):
        stripped = stripped[: -len(suffix)].rstrip()
    return stripped
