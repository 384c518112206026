"""Tasks: the synthetic arithmetic task, user reward functions, and :func:`make_env`.

A task is a :class:`DatasetChatEnv` with a system prompt and reward transforms, which add to
``next["reward"]`` (0 after the base step), so several compose (the answer reward plus a user's).
GSM8K lives in :mod:`rlpost.envs.gsm8k` and is re-exported here.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from tensordict import TensorDictBase

from rlpost.envs.arithmetic import (
    ARITHMETIC_SYSTEM_PROMPT,
    TOOL_ARITHMETIC_SYSTEM_PROMPT,
    make_arithmetic_rows,
    make_tool_arithmetic_rows,
)
from rlpost.envs.chat import DatasetChatEnv, as_list
from rlpost.envs.function_pool import FunctionPool
from rlpost.envs.gsm8k import GSM8K_SYSTEM_PROMPT, GSM8KEnv, GSM8KRewardParser  # noqa: F401  (re-exported)
from rlpost.envs.rewards import (
    add_reward,
    answer_reward,
    count_failure,
    end_episodes,
    has_answer,
    load_reward_fn,
    reward_value,
)
from rlpost.envs.sandbox import SandboxUnavailable
from rlpost.envs.tool_transforms import (
    HermesToolCallParser,
    PythonInterpreter,
    SimpleToolTransform,
    StopWithoutToolCall,
    ToolTransformBase,
)
from rlpost.envs.transforms import Transform

if TYPE_CHECKING:
    from rlpost.config import DataConfig, RewardModelConfig, RolloutConfig, ToolsConfig


class EnvSections(Protocol):
    """The job config sections an env is made from: a whole ``JobConfig`` or an env pool's
    ``EnvPoolSettings``."""

    data: DataConfig
    tools: ToolsConfig
    rollout: RolloutConfig
    reward_model: RewardModelConfig | None


logger = logging.getLogger(__name__)


class AnswerRewardParser(Transform):
    """``reward += answer_reward(latest response, parse_target(td[answer_key]))``: 1.0 correct,
    0.1 answer tag present but wrong, 0.0 without one (:mod:`rlpost.envs.rewards`). A
    ``parse_target`` failure (a malformed row) gives 0, counted in ``errors``.
    """

    def __init__(
        self,
        *,
        answer_key: str = "answer",
        parse_target: Callable[[Any], str] = str,
        set_done_if_answer: bool = True,
    ) -> None:
        super().__init__()
        self.answer_key, self.parse_target, self.set_done_if_answer = answer_key, parse_target, set_done_if_answer
        self.errors: Counter = Counter()

    def on_step(self, td: TensorDictBase, next_td: TensorDictBase) -> TensorDictBase:
        num_envs = td.batch_size[0]
        if self.answer_key not in td.keys():
            raise ValueError(
                f"{type(self).__name__} needs the reference answer under {self.answer_key!r} in the step input"
            )
        completions = self._chat_env().last_responses(td)
        answers = as_list(td.get(self.answer_key), num_envs)
        rewards = [self._reward(completion, answer) for completion, answer in zip(completions, answers)]
        add_reward(next_td, rewards)
        if self.set_done_if_answer:
            end_episodes(next_td, [has_answer(c) for c in completions])
        return next_td

    def _reward(self, completion: str, answer: Any) -> float:
        try:
            target = self.parse_target(answer)
        except ValueError as exc:
            message = "%s: bad reference answer, reward 0 (counted in reward_errors): %s"
            count_failure(self.errors, type(exc).__name__, logger, message, type(self).__name__, exc)
            return 0.0
        return answer_reward(completion, target)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(answer_key={self.answer_key!r}, set_done_if_answer={self.set_done_if_answer})"


class UserReward(Transform):
    """``reward += fn(latest response, row)`` for a user function (callable or dotted path).

    ``row``: the dataset row dict under ``row_key``. The function runs in a worker of ``pool``
    (:class:`~rlpost.envs.function_pool.FunctionPool`, shared with the tool functions) within
    ``timeout_s`` (a hung one is killed). A failure (exception, timeout, non-finite result) gives
    the sample 0, counted by type in ``errors`` (summed in ``env.reward_errors``; the first of
    each logged with its traceback). Deviation from the peer systems: a bad reward function never
    stops collection.
    """

    def __init__(self, fn: str | Callable[[str, Any], float], *, row_key: str = "row", timeout_s: float = 30.0,
                 pool: FunctionPool | None = None) -> None:  # fmt: skip
        super().__init__()
        if timeout_s <= 0:
            raise ValueError(f"UserReward timeout_s must be > 0, got {timeout_s}")
        self.name = fn if isinstance(fn, str) else getattr(fn, "__qualname__", repr(fn))
        if isinstance(fn, str):
            load_reward_fn(fn)  # a bad path fails here, naming it, not at the first sample
        self.fn, self.row_key, self.timeout_s = fn, row_key, timeout_s
        self.pool = pool if pool is not None else FunctionPool()
        self.errors: Counter = Counter()

    def on_step(self, td: TensorDictBase, next_td: TensorDictBase) -> TensorDictBase:
        num_envs = td.batch_size[0]
        if self.row_key not in td.keys():
            raise ValueError(f"UserReward needs the dataset row under {self.row_key!r} in the step input")
        rows = as_list(td.get(self.row_key), num_envs)
        rewards = [self._score(completion, row) for completion, row in zip(self._chat_env().last_responses(td), rows)]
        return add_reward(next_td, rewards)

    def _score(self, completion: str, row: Any) -> float:
        result = self.pool.call(self.fn, (completion, row), timeout_s=self.timeout_s)
        if result.ok:
            reward, error = reward_value(result.value)
            detail = f"it returned {result.value!r}"
        else:
            reward, error, detail = 0.0, result.error, result.traceback or result.message
        if error is not None:
            message = "reward function %s failed with %s; reward 0 (counted in reward_errors; logged once per error type):\n%s"
            count_failure(self.errors, error, logger, message, self.name, error, detail)
        return reward

    def __repr__(self) -> str:
        return f"UserReward({self.name!r}, timeout_s={self.timeout_s})"


class ArithmeticEnv(DatasetChatEnv):
    """The tiny model's synthetic task: "What is a + b?" -> ``<answer>c</answer>``, offline.

    Without ``dataset``, :attr:`make_rows` generates ``num_rows`` rows from ``row_seed``
    (default ``seed``, else 0) and ``split``: "train" never draws the held-out questions, "test"
    only them, None all. Reward: :class:`AnswerRewardParser` against ``answer``.
    """

    SYSTEM_PROMPT = ARITHMETIC_SYSTEM_PROMPT
    make_rows = staticmethod(make_arithmetic_rows)

    def __init__(
        self, *, dataset: Any = None, num_rows: int = 2000, row_seed: int | None = None,
        compute_reward: bool = True, max_steps: int | None = 1, **kwargs: Any,
    ) -> None:  # fmt: skip
        if dataset is None:
            seed = kwargs.get("seed")
            split = kwargs.pop("split", "train")
            dataset = self.make_rows(num_rows, seed=row_seed if row_seed is not None else (seed or 0), split=split)
        super().__init__(dataset=dataset, max_steps=max_steps, **kwargs)
        if compute_reward:
            self.append_transform(AnswerRewardParser())


class ToolArithmeticEnv(ArithmeticEnv):
    """The tiny model's tool-use task: products too large for the head ("What is 4821 * 937?").
    Two steps by default: with a :class:`~rlpost.envs.tool_transforms.PythonInterpreter` appended
    (``make_env`` does), the model computes in one turn and answers in the next.
    """

    SYSTEM_PROMPT = TOOL_ARITHMETIC_SYSTEM_PROMPT
    make_rows = staticmethod(make_tool_arithmetic_rows)

    def __init__(self, *, max_steps: int | None = 2, **kwargs: Any) -> None:
        super().__init__(max_steps=max_steps, **kwargs)


def make_env(
    cfg: EnvSections, tokenizer: Any, batch_size: int, *, input_mode: str = "history",
    num_shards: int = 1, shard_index: int = 0, reward_scorer: Any = None,
) -> DatasetChatEnv:  # fmt: skip
    """The env of ``cfg.data`` with ``batch_size`` conversations (``repeats`` = group size):
    the task's env (GSM8K with ``strict_format=True``; "custom": a DatasetChatEnv whose reward is
    ``data.reward_fn``, which otherwise adds to the task's), then the tools, then with a
    ``reward_model`` section a :class:`RewardModelReward` scoring each episode's final response
    through ``reward_scorer`` (default: the run's ``reward`` actor). ``num_shards``/``shard_index``
    split the prompt order between env pools. Mistakes in the data section raise ``ConfigError``
    naming it.
    """
    from rlpost.config import ConfigError

    data = cfg.data
    common = dict(
        num_envs=batch_size, repeats=data.group_size, seed=data.seed, shuffle=data.shuffle,
        tokenizer=tokenizer, input_mode=input_mode, system_prompt=data.system_prompt,
        prompt_column=data.prompt_column, answer_column=data.answer_column,
        max_steps=cfg.rollout.max_turns, num_shards=num_shards, shard_index=shard_index,
    )  # fmt: skip
    try:
        if data.task in ("arithmetic", "tool_arithmetic"):
            env_class = ToolArithmeticEnv if data.task == "tool_arithmetic" else ArithmeticEnv
            env = env_class(
                dataset=data.dataset, name=data.subset, split=data.split, num_rows=data.num_synthetic_rows, **common
            )
        elif data.task == "gsm8k":  # strict: text after </answer> scores 0 (the trap in rlpost.envs.rewards)
            env = GSM8KEnv(dataset=data.dataset, name=data.subset, split=data.split, strict_format=True, **common)
        elif data.task == "reasoning_gym":
            from rlpost.envs.reasoning_gym import ReasoningGymEnv

            gym = data.reasoning_gym
            try:
                env = ReasoningGymEnv(tasks=gym.tasks, size=gym.size, row_seed=gym.seed, split=data.split, **common)
            except ValueError as exc:
                raise ConfigError(f"data.reasoning_gym.tasks ({data.split} split): {exc}") from exc
        elif data.task == "code":
            from rlpost.envs.code import CodeEnv

            code = data.code
            require_tag = code.require_answer_tag if code.require_answer_tag is not None else cfg.tools.python.enabled
            common["answer_column"] = None  # graded by the row's tests, not against an answer
            env = CodeEnv(
                dataset=data.dataset, name=data.subset, split=data.split, reward=code.reward, timeout_s=code.timeout_s,
                call_timeout_s=code.call_timeout_s, memory_mb=code.memory_mb, sandbox=cfg.tools.sandbox,
                require_answer_tag=require_tag, **common,
            )  # fmt: skip
        else:
            env = DatasetChatEnv(dataset=data.dataset, name=data.subset, split=data.split, **common)
        pool = FunctionPool() if data.reward_fn or cfg.tools.functions else None
        if data.reward_fn:
            env.append_transform(UserReward(data.reward_fn, timeout_s=data.reward_timeout_s, pool=pool))
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(f"data (task={data.task}, dataset={data.dataset!r}): {exc}") from exc
    add_tools(env, cfg.tools, pool)
    rm = getattr(cfg, "reward_model", None)
    if rm is not None:
        from rlpost.envs.reward_model import RemoteRewardModel, RewardModelReward

        scorer = reward_scorer or RemoteRewardModel(timeout_s=rm.timeout_s, restart_wait_s=rm.restart_wait_s)
        env.append_transform(RewardModelReward(scorer, weight=rm.weight, rule_weight=rm.rule_weight))
    return env


@dataclass(frozen=True)
class PromptFit:
    """Which rows' first prompts leave the engine room for the completion (:func:`prompt_fit`)."""

    kept: list[int]  # row indices whose prompt fits
    too_long: list[int]  # row indices whose prompt does not
    room: int  # tokens a prompt may have: max_model_len - max_tokens
    longest: int  # tokens of the longest prompt
    longest_row: int  # its row


def prompt_fit(
    env: DatasetChatEnv, *, max_model_len: int, max_tokens: int, rows: int | None = None
) -> PromptFit | None:
    """Each row's first prompt (of the first ``rows`` rows; None: all) against the engine's
    length: a prompt fits when ``max_tokens`` new tokens still fit after it. None when the env's
    source is a dataloader (its rows are not known ahead)."""
    lengths = env.prompt_lengths()
    if lengths is None:
        return None
    lengths = lengths[:rows] if rows is not None else lengths
    room = max_model_len - max_tokens
    longest_row = max(range(len(lengths)), key=lengths.__getitem__)
    return PromptFit(kept=[i for i, n in enumerate(lengths) if n <= room],
                     too_long=[i for i, n in enumerate(lengths) if n > room], room=room,
                     longest=lengths[longest_row], longest_row=longest_row)  # fmt: skip


def fit_prompts(env: DatasetChatEnv, cfg: EnvSections, *, max_tokens: int | None = None, rows: int | None = None,
                what: str = "data") -> PromptFit | None:  # fmt: skip
    """Check the env's prompts against ``rollout.engine.max_model_len`` before anything is
    generated (``max_tokens`` default ``rollout.max_tokens``; ``rows``: the first rows only, as an
    evaluation draws them). Prompts without room are dropped with a warning under
    ``data.drop_long_prompts``, else ConfigError names the keys, the count and the longest.
    Returns the fit (None for a dataloader source)."""
    from rlpost.config import ConfigError

    max_tokens = cfg.rollout.max_tokens if max_tokens is None else max_tokens
    max_model_len = cfg.rollout.engine.max_model_len
    try:
        fit = prompt_fit(env, max_model_len=max_model_len, max_tokens=max_tokens, rows=rows)
    except ConfigError:
        raise
    except Exception as exc:  # the tokenizer's chat template (jinja) or a row it cannot render
        raise ConfigError(
            f"the prompts of {what} cannot be rendered with the tokenizer's chat template "
            f"({type(exc).__name__}: {exc}); check model.chat_template and data.prompt_column"
        ) from exc
    if fit is None or not fit.too_long:
        return fit
    total = len(fit.kept) + len(fit.too_long)
    source = cfg.data.dataset if cfg.data.dataset is not None else env.primer.description
    why = (f"{len(fit.too_long)} of {total} prompts of {what} ({source!r}) are too long for the engine: "
           f"rollout.engine.max_model_len={max_model_len} less {max_tokens} tokens to generate leaves {fit.room} "
           f"for a prompt, and the longest has {fit.longest} (row {fit.longest_row})")  # fmt: skip
    if not fit.kept:
        raise ConfigError(f"{why}; none fits: raise rollout.engine.max_model_len (the model's context allowing)")
    if not cfg.data.drop_long_prompts:
        raise ConfigError(f"{why}; raise rollout.engine.max_model_len, lower the tokens to generate, or set "
                          f"data.drop_long_prompts=true to use the {len(fit.kept)} that fit")  # fmt: skip
    logger.warning("data.drop_long_prompts: %s; they are left out, %d prompts remain", why, len(fit.kept))
    env.primer.keep_rows(fit.kept)
    return fit


def add_tools(env: DatasetChatEnv, tools: ToolsConfig, pool: FunctionPool | None = None) -> DatasetChatEnv:
    """Append a ``tools`` config section's tools: the sandboxed Python tool, the user's functions
    (in ``pool``'s workers), then :class:`StopWithoutToolCall`; a function that does not load or a
    sandbox that cannot start raises ``ConfigError`` naming the key."""
    from rlpost.config import ConfigError

    if not tools.enabled:
        return env
    python = tools.python
    try:
        if python.enabled:
            env.append_transform(PythonInterpreter(
                persistent=python.persistent, max_workers=python.max_workers, timeout_s=python.timeout_s,
                memory_mb=python.memory_mb, max_output_bytes=python.max_output_bytes, sandbox=tools.sandbox,
            ))  # fmt: skip
    except SandboxUnavailable as exc:
        raise ConfigError(f"tools.sandbox={tools.sandbox}: {exc}") from exc
    if tools.functions:
        from transformers.utils import get_json_schema

        functions, schemas = {}, []
        for path in tools.functions:
            try:
                fn = load_reward_fn(path)
                schemas.append(get_json_schema(fn))
            except ValueError as exc:
                raise ConfigError(f"tools.functions: {str(exc).replace('reward function', 'tool function')}") from exc
            except Exception as exc:  # transformers' schema errors: no docstring, an untyped argument
                raise ConfigError(
                    f"tools.functions: {path!r} cannot be described to the model ({exc}); give it type hints and "
                    "a docstring with an Args section"
                ) from exc
            name = getattr(fn, "__name__", path.rpartition(":")[2])
            if name in functions:
                raise ConfigError(f"tools.functions: two functions are named {name!r} ({functions[name]!r}, {path!r})")
            functions[name] = path
        # the chat template lists them in the system prompt (Qwen/Hermes templates do; others ignore it)
        env.template_kwargs = {**env.template_kwargs, "tools": schemas}
        env.append_transform(SimpleToolTransform(
            functions, parser=HermesToolCallParser(), timeout=tools.function_timeout_s,
            pool=pool if pool is not None else FunctionPool(),
        ))  # fmt: skip
    tool_names = [repr(t) for t in env.transforms if isinstance(t, ToolTransformBase)]
    logger.info("tools: %s (sandbox %s)", tool_names, tools.sandbox)
    if tools.sandbox == "guard" and python.enabled:
        logger.warning(
            "tools.sandbox=guard: model-written code runs behind the in-process guard only, which is "
            "NOT a security boundary (ctypes or a re-imported module get past it)"
        )
    return env.append_transform(StopWithoutToolCall())
