"""GSM8K (Cobbe et al. 2021) with TorchRL's API: :class:`GSM8KEnv`, :func:`make_gsm8k_env`,
:class:`GSM8KPrepareQuestion` and :class:`GSM8KRewardParser`.

The reward is TorchRL's GRPO one; :class:`GSM8KRewardParser` writes in ``next``:
``reward_answer`` (1.0 for a non-empty <answer>...</answer>), ``reward_think`` (1.0 for a non-empty
<think>...</think>), ``reward_right`` (correct_reward 1.0 if right, format_reward 0.1 if wrong, 0.0
without an answer), ``reward`` (reward_right, added to what ``next["reward"]`` holds) and
``success`` (right).

An answer is right when it equals the reference (the text after the last ``####``) once both are
normalised (TorchRL's :meth:`GSM8KRewardParser.normalize_answer`) or, unless
``use_math_verify=False``, when math-verify finds them equivalent (``\\boxed{1/2}`` and ``0.5``;
two plain numbers are compared by value, as math-verify would). Trap: math-verify's own time
limits use ``signal.alarm`` (main thread only), so they are off and it runs in a worker process
with a wall-clock limit.

Deliberate deviations from TorchRL:

- Answers math-verify accepts are right: equivalent forms (``\\frac{1}{2}`` for ``0.5``) and a
  number in words (``<answer>36 snakes</answer>`` for 36), which TorchRL scores 0.1.
  ``use_math_verify=False`` gives TorchRL's comparison exactly.
- A verification past ``verify_timeout_s`` scores 0 (``success`` False), counted in
  ``errors["Timeout"]`` (the env's ``reward_errors``); it never hangs.
- The fields are ``[B, 1]`` like every ChatEnv reward (TorchRL: ``[B, 1, 1]``).
- The reference follows the *last* ``####`` (TorchRL splits on ``"#### "`` and needs exactly
  one). A row without one scores 0, counted in ``errors["ValueError"]`` (TorchRL stops with an
  unpacking error); a missing or empty reference raises, naming the key.
- ``strict_format=True`` keeps rlpost's answer rule (:func:`~rlpost.envs.rewards.final_answer`:
  the last ``<answer>``, possibly unclosed at the end, nothing but whitespace after
  ``</answer>``); :func:`~rlpost.envs.tasks.make_env` uses it for training runs.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import re
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal
from typing import Any, Literal

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDictBase

from rlpost.envs.chat import DatasetChatEnv, as_list
from rlpost.envs.function_pool import FunctionPool
from rlpost.envs.rewards import count_failure, end_episodes, final_answer, gsm8k_target
from rlpost.envs.rewards import has_answer as has_answer_tag
from rlpost.envs.transforms import Transform

logger = logging.getLogger(__name__)

# TorchRL's GSM8KEnv.SYSTEM_PROMPT, word for word (line breaks included).
GSM8K_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it.\n"
    "The assistant first thinks about the reasoning process in the mind and then provides the user with "
    "the answer.\n"
    "The reasoning process and answer are enclosed within <think></think> and <answer></answer> tags, "
    "respectively,\n"
    "i.e., <think>reasoning process here</think> <answer>answer here</answer>. The answer should be a number."
)

# TorchRL's template of GSM8KPrepareQuestion (``%s`` is the question).
BASE_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user with "
    "the answer. The reasoning process and answer are enclosed within <think></think> and <answer></answer> "
    "tags, respectively, i.e., <think>reasoning process here</think> <answer>answer here</answer>. "
    "User: %s. Assistant: <think>"
)

GSM8K_HUB_NAMES = ("openai/gsm8k", "gsm8k")
REWARD_KEYS = ("reward_answer", "reward_think", "reward_right", "reward", "success")
MATH_VERIFY_REQUIREMENT = "math-verify>=0.9,<0.10"

_RESPONSE_KEYS = {(mode, field) for mode in ("history", "text", "tokens") for field in ("full", "response")}
_RESPONSE_KEYS.add("text_response")  # TorchRL 0.9's action key: its make_gsm8k_env names it in in_keys
_PLAIN_NUMBER = re.compile(r"-?\d+(\.\d+)?")
_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_TURN_END = "<|im_end|>"
_MATH_VERIFY_EQUAL = "rlpost.envs.math_verify_check:math_verify_equal"  # imported by the worker only
_POOL_LOCK = threading.Lock()  # module-level, so that parsers (and the envs holding them) stay picklable
_DATASET_ENV_KEYWORDS = tuple(inspect.signature(DatasetChatEnv.__init__).parameters)[1:]


def task_env_kwargs(arguments: Mapping[str, Any], **overrides: Any) -> dict[str, Any]:
    """The :class:`~rlpost.envs.chat.DatasetChatEnv` keywords among a task env's arguments (its
    ``locals()``), with ``overrides``; ``max_steps=0`` means no limit (None), as in TorchRL."""
    kwargs = {key: arguments[key] for key in _DATASET_ENV_KEYWORDS if key in arguments}
    kwargs.update(overrides)
    kwargs["max_steps"] = kwargs.get("max_steps") or None
    return kwargs


# ---------------------------------------------------------------------------- the reward


class GSM8KRewardParser(Transform):
    """TorchRL's GSM8K reward (see the module docstring for the fields and the deviations).

    Args (TorchRL's, in its order):
        tokenizer: only its ``eos_token`` is used (default of ``eos_token``, cut from responses).
        in_keys: ``[response key, answer key]``. The response is always read from the env's
            ``input_mode`` (:meth:`~rlpost.envs.chat.ChatEnv.last_responses`), so the first must
            be one of TorchRL's response keys (``("history", "full")``, ``"text_response"``, ...).
        out_keys: the names of the five fields, in the module docstring's order.
        set_done_if_answer: end the episode once a response holds an answer.
        input_mode: read from the env when None, and an error if it differs.
        format_reward: ``reward_right`` of a wrong answer. correct_reward: that of a right one.

    Keyword Args (rlpost's):
        answer_key: the reference answer's key (default ``in_keys[1]``, else ``"answer"``).
        strict_format: rlpost's answer rule (module docstring); the episode then ends on any
            ``<answer>`` tag, as rlpost's other answer rewards do.
        use_math_verify: False gives TorchRL's string comparison.
        verify_timeout_s: wall-clock limit of one math-verify check.
        pool: the :class:`~rlpost.envs.function_pool.FunctionPool` of the checks (default: one
            worker, started on the first check).

    ``errors`` counts the samples scored 0 by a failure, by type: ``"ValueError"`` (no ``####``),
    ``"Timeout"``, or the worker's error; the env sums them in ``reward_errors``.
    """

    def __init__(
        self,
        tokenizer: Any = None,
        in_keys: Sequence[Any] | None = None,
        out_keys: Sequence[Any] | None = None,
        eos_token: str | None = None,
        set_done_if_answer: bool = True,
        input_mode: Literal["history", "text", "tokens"] | None = None,
        format_reward: float = 0.1,
        correct_reward: float = 1.0,
        *,
        answer_key: str | None = None,
        strict_format: bool = False,
        use_math_verify: bool = True,
        verify_timeout_s: float = 5.0,
        pool: FunctionPool | None = None,
    ) -> None:
        super().__init__()
        response_key, answer_key = self._check_in_keys(in_keys, answer_key)
        self.in_keys = [response_key, answer_key]
        self.answer_key = answer_key
        self.state_keys = (answer_key,)  # carried step to step: a later turn is scored against it
        if out_keys is None:
            out_keys = REWARD_KEYS
        if len(out_keys) != len(REWARD_KEYS):
            raise ValueError(
                f"GSM8KRewardParser out_keys must name the {len(REWARD_KEYS)} fields {list(REWARD_KEYS)} "
                f"in that order; got {list(out_keys)}"
            )
        self.out_keys = list(out_keys)
        self._out = dict(zip(REWARD_KEYS, self.out_keys))
        if input_mode not in (None, "history", "text", "tokens"):
            raise ValueError(f"GSM8KRewardParser input_mode must be 'history', 'text' or 'tokens', got {input_mode!r}")
        if verify_timeout_s <= 0:
            raise ValueError(f"GSM8KRewardParser verify_timeout_s must be > 0, got {verify_timeout_s}")
        if use_math_verify and importlib.util.find_spec("math_verify") is None:
            raise ImportError(
                f"GSM8KRewardParser checks answers with math-verify, which is not installed: pip install "
                f"'{MATH_VERIFY_REQUIREMENT}' (or pass use_math_verify=False for TorchRL's string comparison)"
            )
        self.tokenizer = tokenizer
        self.eos_token = eos_token if eos_token is not None else getattr(tokenizer, "eos_token", None)
        self.set_done_if_answer, self.input_mode = set_done_if_answer, input_mode
        self.format_reward, self.correct_reward = float(format_reward), float(correct_reward)
        self.strict_format, self.use_math_verify = strict_format, use_math_verify
        self.verify_timeout_s = float(verify_timeout_s)
        self._pool = pool
        self.errors: Counter = Counter()

    @staticmethod
    def _check_in_keys(in_keys: Sequence[Any] | None, answer_key: str | None) -> tuple[Any, str]:
        if in_keys is None:
            return None, answer_key or "answer"
        in_keys = list(in_keys)
        if len(in_keys) != 2:
            raise ValueError(f"GSM8KRewardParser in_keys must be [response key, answer key], got {in_keys}")
        response_key, key = in_keys
        response_key = tuple(response_key) if isinstance(response_key, (list, tuple)) else response_key
        if response_key not in _RESPONSE_KEYS:
            raise ValueError(
                f"GSM8KRewardParser in_keys[0]={in_keys[0]!r} is not a response key: the response is read "
                f"from the env's input_mode; use one of {sorted(map(str, _RESPONSE_KEYS))}"
            )
        if answer_key is not None and answer_key != key:
            raise ValueError(f"GSM8KRewardParser: answer_key={answer_key!r} contradicts in_keys[1]={key!r}")
        return response_key, key

    # ------------------------------------------------------------------ TorchRL's helpers

    @staticmethod
    def extract_tags(text: str) -> tuple[str, str]:
        """``(think, answer)``: the stripped contents of the first ``<think>...</think>`` and the
        first ``<answer>...</answer>``, "" for a tag that is absent (or never closed)."""
        think, answer = _THINK.search(text), _ANSWER.search(text)
        return (think.group(1).strip() if think else "", answer.group(1).strip() if answer else "")

    @staticmethod
    def normalize_answer(answer: str) -> str:
        """TorchRL's comparable form of a numeric answer: stripped, without ``,``, ``$`` and ``%``
        or a trailing ``.``, and without trailing decimal zeros (``"$1,234.50"`` -> ``"1234.5"``,
        ``"120.0"`` -> ``"120"``)."""
        text = answer.strip()
        for char in ",$%":
            text = text.replace(char, "")
        text = text.rstrip(".")
        if "." in text:
            text = text.rstrip("0").rstrip(".")
        return text

    # ------------------------------------------------------------------ scoring

    def check_answer(self, answer: str, true_answer: str) -> bool:
        """Whether ``answer`` is right for ``true_answer``; a failed or timed-out check is False
        and counted in ``errors``. Safe from any thread."""
        return self.judge(answer, true_answer)[0]

    def score(self, completion: str, answer_field: Any) -> dict[str, Any]:
        """The reward fields of one response against one dataset answer field, plus
        ``"answered"``: whether the response ends the episode (``set_done_if_answer``)."""
        text = self._strip_end(completion)
        think, answer = self.extract_tags(text)
        if self.strict_format:
            answer = final_answer(text)
            has_answer, answered = answer is not None, has_answer_tag(text)
        else:
            has_answer = answered = bool(answer)
        correct, error = False, None
        if has_answer:
            try:
                target = self.reference(answer_field)
            except ValueError as exc:
                error = self._count("ValueError", f"bad reference answer: {exc}")
            else:
                correct, error = self.judge(answer, target)
        if correct:
            right = self.correct_reward
        elif has_answer and error is None:
            right = self.format_reward
        else:
            right = 0.0
        return {
            "reward_answer": float(has_answer), "reward_think": float(bool(think)), "reward_right": right,
            "reward": right, "success": correct, "answered": answered,
        }  # fmt: skip

    def reference(self, answer_field: Any) -> Any:
        """The reference read from the dataset's answer field (GSM8K: the text after ``####``);
        ``ValueError`` for a malformed row (scored 0, counted). MATH and Countdown override it."""
        return gsm8k_target(answer_field)

    def judge(self, answer: str, reference: Any) -> tuple[bool, str | None]:
        """``(right, error type or None)`` of the answer against :meth:`reference`'s value."""
        return self._verify(answer, reference)

    def _strip_end(self, completion: str) -> str:
        text = completion
        if self.eos_token:
            text = text.removesuffix(self.eos_token)
        return text.removesuffix(_TURN_END)

    def _verify(self, answer: str, target: str) -> tuple[bool, str | None]:
        """Cheap cases decided here; the rest by math-verify in a worker with a deadline."""
        mine, theirs = self.normalize_answer(answer), self.normalize_answer(target)
        if not mine:
            return False, None
        if mine == theirs:
            return True, None
        if not self.use_math_verify:
            return False, None
        if _PLAIN_NUMBER.fullmatch(mine) and _PLAIN_NUMBER.fullmatch(theirs):
            return Decimal(mine) == Decimal(theirs), None  # what math-verify decides, without a worker
        result = self.pool.call(_MATH_VERIFY_EQUAL, (answer, target), timeout_s=self.verify_timeout_s)
        if result.ok:
            return bool(result.value), None
        return False, self._count(result.error or "Error", f"{result.message}\n{result.traceback}".strip())

    def _count(self, error: str, detail: str) -> str:
        message = "%s: %s; the sample scores 0 (counted in reward_errors; logged once per error type): %s"
        return count_failure(self.errors, error, logger, message, type(self).__name__, error, detail)

    @property
    def pool(self) -> FunctionPool:
        """The worker pool of the math-verify checks (created on first use)."""
        with _POOL_LOCK:
            if self._pool is None:
                self._pool = FunctionPool()
        return self._pool

    def close(self) -> None:
        """Stop the math-verify worker (it starts again when needed)."""
        if self._pool is not None:
            self._pool.close()

    # ------------------------------------------------------------------ the env hook

    def on_step(self, td: TensorDictBase, next_td: TensorDictBase) -> TensorDictBase:
        env = self._chat_env()
        if self.input_mode is not None and self.input_mode != env.input_mode:
            raise ValueError(
                f"GSM8KRewardParser(input_mode={self.input_mode!r}) is attached to an env with "
                f"input_mode={env.input_mode!r}"
            )
        num_envs = td.batch_size[0]
        answers = self._reference_answers(td, num_envs)
        scores = [self.score(text, answer) for text, answer in zip(env.last_responses(td), answers)]
        reward = next_td.get("reward")
        for name in REWARD_KEYS:
            dtype = torch.bool if name == "success" else reward.dtype
            values = torch.tensor([s[name] for s in scores], dtype=dtype, device=reward.device).view(num_envs, 1)
            current = next_td.get(self._out[name], None)
            if current is not None:  # add to what is there, as TorchRL does (e.g. reward from another transform)
                values = current | values.view_as(current) if dtype is torch.bool else current + values.view_as(current)
            next_td.set(self._out[name], values)
        if self.set_done_if_answer:
            end_episodes(next_td, [s["answered"] for s in scores])
        return next_td

    def _reference_answers(self, td: TensorDictBase, num_envs: int) -> list[Any]:
        if self.answer_key not in td.keys():
            raise ValueError(
                f"GSM8KRewardParser needs the reference answer under {self.answer_key!r} in the step input; it has "
                f"keys {sorted(map(str, td.keys()))} (a DatasetChatEnv writes it from answer_column, or pass it "
                "in the reset input)"
            )
        answers = as_list(td.get(self.answer_key), num_envs)
        for row, answer in enumerate(answers):
            if answer is None or (isinstance(answer, str) and not answer.strip()):
                raise ValueError(
                    f"GSM8KRewardParser: the reference answer under {self.answer_key!r} is empty in row {row} "
                    f"({answer!r}); check the dataset's answer column"
                )
        return answers

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(answer_key={self.answer_key!r}, strict_format={self.strict_format}, "
            f"use_math_verify={self.use_math_verify}, verify_timeout_s={self.verify_timeout_s})"
        )


# ---------------------------------------------------------------------------- the question


class GSM8KPrepareQuestion(Transform):
    """TorchRL's transform that turns each question (``in_keys`` of the reset input) into the
    R1-style prompt :data:`BASE_PROMPT` before the reset builds the first prompt; ``out_keys``
    default to in place. Append it after the DataLoadingPrimer that draws the questions.

    Deviations from TorchRL: ``in_keys`` defaults to the env's ``data_key`` rather than ``"text"``
    (the same in :func:`make_gsm8k_env`). A question already in the template is left as it is, so
    a query carried into an automatic reset is not wrapped twice. A missing key or a non-string
    raises ``ValueError`` naming it.
    """

    _PREFIX, _SUFFIX = BASE_PROMPT.split("%s")

    def __init__(self, in_keys: Sequence[Any] | None = None, out_keys: Sequence[Any] | None = None) -> None:
        super().__init__()
        self._in_keys = None if in_keys is None else list(in_keys)
        self._out_keys = None if out_keys is None else list(out_keys)
        if self._in_keys is not None and self._out_keys is not None and len(self._in_keys) != len(self._out_keys):
            raise ValueError(
                f"GSM8KPrepareQuestion needs as many out_keys as in_keys, got {self._in_keys} and {self._out_keys}"
            )
        if self._in_keys is None and self._out_keys is not None and len(self._out_keys) != 1:
            raise ValueError(f"GSM8KPrepareQuestion: out_keys={self._out_keys} without in_keys must name one key")

    @property
    def in_keys(self) -> list[Any]:
        return self._in_keys if self._in_keys is not None else [self._env().data_key]

    @property
    def out_keys(self) -> list[Any]:
        return self._out_keys if self._out_keys is not None else self.in_keys

    @classmethod
    def prepare(cls, question: str) -> str:
        """``BASE_PROMPT % question``; a question already in that form is returned as it is."""
        if question.startswith(cls._PREFIX) and question.endswith(cls._SUFFIX):
            return question
        return BASE_PROMPT % question

    def reset_preprocess(self, td: TensorDictBase) -> TensorDictBase:
        num_envs = td.batch_size[0]
        for in_key, out_key in zip(self.in_keys, self.out_keys):
            if in_key not in td.keys(include_nested=True):
                raise ValueError(
                    f"GSM8KPrepareQuestion: no question under {in_key!r} in the reset input (keys "
                    f"{sorted(map(str, td.keys()))}); append it after the transform that loads the questions"
                )
            questions = as_list(td.get(in_key), num_envs)
            for row, question in enumerate(questions):
                if not isinstance(question, str):
                    raise ValueError(
                        f"GSM8KPrepareQuestion: row {row} of {in_key!r} holds a {type(question).__name__}, "
                        "expected a string"
                    )
            prompts = [self.prepare(q) for q in questions]
            td.set(out_key, NonTensorStack(*[NonTensorData(p) for p in prompts], batch_size=td.batch_size))
        return td

    def __repr__(self) -> str:
        return f"GSM8KPrepareQuestion(in_keys={self._in_keys}, out_keys={self._out_keys})"


# ---------------------------------------------------------------------------- the env


class GSM8KEnv(DatasetChatEnv):
    """GSM8K as a chat env, with TorchRL's keywords; ``openai/gsm8k`` (subset ``main``) by default.

    Keywords are :class:`~rlpost.envs.chat.DatasetChatEnv`'s, plus TorchRL's ``compute_reward``
    (append a :class:`GSM8KRewardParser`), ``max_steps`` (default 1; 0 or None: no limit),
    ``ray_backend`` (draw prompts from one shared Ray actor,
    :class:`~rlpost.envs.datasets.RayDataLoadingPrimer`, so envs in several collectors never serve
    a prompt twice) and ``dataloader_actor_name`` (default ``"gsm8k_dataloader"`` with
    ``ray_backend``, as in TorchRL); and rlpost's ``strict_format`` (for the parser).
    ``system_prompt`` defaults to TorchRL's :data:`GSM8K_SYSTEM_PROMPT`; ``prompt_column`` to the
    query column a ``collate_fn`` wrote, else ``"question"``.

    ``dataset``: a hub name, a local json/jsonl/parquet file or folder, a list of rows, a
    ``datasets.Dataset`` or a DataLoader, with ``question`` and ``answer`` columns. ``"gsm8k"``
    (TorchRL's default) and ``"openai/gsm8k"`` both load subset ``main``.
    """

    SYSTEM_PROMPT = GSM8K_SYSTEM_PROMPT

    def __init__(
        self, *, dataset: Any = "openai/gsm8k", shuffle: bool = True, num_envs: int = 1, repeats: int | None = None,
        batch_size_dl: int = 1, seed: int | None = None, group_repeats: bool = False, tokenizer: Any = None,
        device: torch.device | str | None = None, template_kwargs: dict[str, Any] | None = None,
        apply_template: bool | None = False, compute_reward: bool = True, collate_fn: Callable | None = None,
        max_steps: int | None = 1, input_mode: Literal["history", "text", "tokens"] = "history",
        ray_backend: bool = False, dataloader_actor_name: str | None = None, name: str | None = None,
        split: str | None = "train", data_key: str | None = None, system_prompt: str | None = None,
        prompt_column: str | None = None, answer_column: str | None = "answer", num_shards: int = 1,
        shard_index: int = 0, strict_format: bool = False,
    ) -> None:  # fmt: skip
        if ray_backend and dataloader_actor_name is None:
            dataloader_actor_name = "gsm8k_dataloader"
        if name is None and isinstance(dataset, str) and dataset in GSM8K_HUB_NAMES:
            name = "main"  # the hub dataset's configurations are "main" and "socratic"
        super().__init__(**task_env_kwargs(locals()))
        if compute_reward:
            self.append_transform(GSM8KRewardParser(tokenizer=tokenizer, strict_format=strict_format))


def make_gsm8k_env(
    dataset: Any = "openai/gsm8k",
    num_envs: int = 1,
    repeats: int | None = None,
    batch_size_dl: int = 1,
    seed: int | None = None,
    group_repeats: bool = False,
    tokenizer: Any = None,
) -> DatasetChatEnv:
    """TorchRL's older GSM8K builder, deprecated as in TorchRL (prefer :class:`GSM8KEnv`).

    As in TorchRL: shuffled train split, the question under ``"text"`` turned into
    :data:`BASE_PROMPT` (no system prompt), one step per episode, and a :class:`GSM8KRewardParser`
    only with a ``tokenizer`` (else a warning). Actions may use TorchRL 0.9's ``"text_response"``.

    Deviations: the env is a history-mode :class:`~rlpost.envs.chat.DatasetChatEnv` (the prompt
    is also in ``history.prompt``), and without a tokenizer ``next["reward"]`` is still written
    (zeros).
    """
    warnings.warn("This constructor is to be deprecated. Use GSM8KEnv instead.", UserWarning, stacklevel=2)
    env = DatasetChatEnv(
        dataset=dataset, name="main" if isinstance(dataset, str) and dataset in GSM8K_HUB_NAMES else None,
        split="train", shuffle=True, num_envs=num_envs, repeats=repeats, batch_size_dl=batch_size_dl, seed=seed,
        group_repeats=group_repeats, tokenizer=tokenizer, data_key="text", prompt_column="question",
        answer_column="answer", max_steps=1,
    )  # fmt: skip
    env = env.append_transform(GSM8KPrepareQuestion())
    if tokenizer is not None:
        env = env.append_transform(GSM8KRewardParser(tokenizer=tokenizer))
    else:
        warnings.warn("No tokenizer specified - reward will not be assigned.", UserWarning, stacklevel=2)
    return env
