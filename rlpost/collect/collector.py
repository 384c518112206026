"""GroupCollector: run a ChatEnv and an LLM policy until every episode ends; return GRPO groups.

The service's collector (each env pool runs one): unlike TorchRL's
:class:`~rlpost.collect.LLMCollector`, which yields steps, it yields whole GRPO groups of
finished samples. One ``collect(G)``::

    env.reset(G * group_size rows)     the env's DataLoadingPrimer (repeats = group_size) gives
                                       each prompt group_size consecutive rows, one prompt_id
    repeat up to max_turns:
        policy(active rows)            ONE engine call for all active rows: every group is
                                       generated in one place (REFERENCE.md pitfall 8)
        env.step(active rows)          rewards, done, tool turns -> next prompts
    rows -> Samples                    full sequences built from the engine's own token ids
    Samples -> Groups                  MCAdvantage (+ "batch" scaling, DAPO filter)

What a Sample holds (rlpost.types): ``token_ids`` = the first prompt's ids + for each turn
(the ids the env added since the last turn, e.g. a tool message) + (the ids the engine
generated); ``loss_mask`` is True exactly on generated ids; ``logprobs`` are the engine's
behaviour log-probs there and 0.0 elsewhere; ``reward`` is the sum of the env's step rewards
(the Monte-Carlo return); ``policy_version`` the oldest version that served any of its turns;
``finished`` whether its last completion stopped on EOS / a stop condition (False: it hit
max_tokens); ``completion_text`` everything after the prompt, decoded without special tokens.

Train on generated ids, never re-tokenised text (DESIGN invariant): the collector records each
engine call (the policy's client is wrapped by :class:`EngineCallRecorder`), builds samples
from the recorded ids, and checks that the policy's output tokens are those ids. A multi-turn
prompt must extend the sequence so far; in history mode the policy re-renders the chat each
turn and a re-rendering that differs from the generated ids ("drift") ends that episode there
(counted in ``num_drift_truncated``). Tokens mode never drifts: use it for multi-turn tasks.

Deliberate deviations from TorchRL: episodes of one ``collect`` start together and all end
inside it (no trajectories carried between calls, no ``dialog_turns_per_batch``); the output is
``list[Group]`` (plain dataclasses that cross processes) instead of a TensorDict; no replay
buffer or weight updater inside the collector (the env pool pushes to the buffer, the weight
bus updates the engines).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from rlpost.algo import group_advantages
from rlpost.collect.policy_version import PolicyVersion
from rlpost.envs.transforms import TOOL_STAT_KEYS
from rlpost.objectives.mc_advantage import MCAdvantage
from rlpost.types import Group, Sample

_FLAGS = ("done", "terminated", "truncated")
ADVANTAGE_SCALES = ("group", "batch", "none")


@dataclass
class EngineCall:
    """One ``generate`` call as the engine answered it."""

    prompt_token_ids: list[list[int]]
    completions: list[list[Any]]  # [prompts][n] Completion
    reported_version: int | None  # the client's last_policy_version read right after the call


class EngineCallRecorder:
    """Forwards every attribute to an engine client and records its ``generate`` calls.

    Installed by the collector as the policy's ``client``. It reads ``last_policy_version``
    right after each call, so the version belongs to that call.
    """

    def __init__(self, client: Any) -> None:
        self.client = client
        self.calls: list[EngineCall] = []

    def generate(self, prompt_token_ids: list[list[int]], sampling: dict[str, Any]) -> list[list[Any]]:
        completions = self.client.generate(prompt_token_ids, sampling)
        version = getattr(self.client, "last_policy_version", None)
        self.calls.append(EngineCall([list(p) for p in prompt_token_ids], completions, version))
        return completions

    def take(self) -> list[EngineCall]:
        calls, self.calls = self.calls, []
        return calls

    def __getattr__(self, name: str) -> Any:
        if name == "client":  # not set yet (e.g. during unpickling): avoid infinite recursion
            raise AttributeError(name)
        return getattr(self.client, name)


@dataclass
class _Episode:
    """One env row being built into a Sample."""

    prompt_id: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    prompt_len: int = 0
    reward: float = 0.0
    policy_version: int | None = None
    finished: bool = False
    frozen: bool = False  # drifted: the sequence ends at the previous turn
    num_turns: int = 0
    tool_stats: list[float] = field(default_factory=lambda: [0, 0, 0.0])  # calls, errors, seconds

    def add_turn(self, prompt_ids: list[int], generated: list[int], logprobs: list[float]) -> bool:
        """Append one turn; False (nothing appended) when ``prompt_ids`` does not extend the
        sequence so far (re-tokenisation drift)."""
        if not self.token_ids:
            self.prompt_len = len(prompt_ids)
            added = prompt_ids
        elif prompt_ids[: len(self.token_ids)] == self.token_ids:
            added = prompt_ids[len(self.token_ids) :]
        else:
            return False
        self.token_ids += added + generated
        self.logprobs += [0.0] * len(added) + logprobs
        self.loss_mask += [False] * len(added) + [True] * len(generated)
        return True


@dataclass
class CollectorStats:
    """Running totals of one collector (the env pool reports them)."""

    num_groups_collected: int = 0  # prompts collected, before the DAPO filter
    num_groups_emitted: int = 0
    num_filtered_groups: int = 0  # DAPO: dropped because all rewards were equal
    num_samples: int = 0  # samples emitted (in emitted groups)
    num_generated_tokens: int = 0  # every generated token, filtered groups included
    num_policy_calls: int = 0
    num_drift_truncated: int = 0  # episodes ended early by history-mode re-tokenisation drift
    num_length_truncated: int = 0  # episodes ended early: the next prompt was past max_prompt_tokens
    generate_s: float = 0.0  # seconds inside policy calls
    collect_s: float = 0.0  # seconds inside collect()
    reward_errors: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "reward_errors"}
        out["reward_errors"] = dict(self.reward_errors)
        return out


class GroupCollector:
    """Collect whole GRPO groups from ``env`` with ``policy``; see the module docstring.

    Args:
        env: a :class:`~rlpost.envs.ChatEnv` whose reset draws prompts (a DatasetChatEnv with
            ``repeats == group_size``, e.g. from :func:`rlpost.envs.make_env`); its rows must
            carry ``prompt_id``.
        policy: a :class:`~rlpost.policies.vLLMWrapper` (anything with an engine ``client``) in
            the env's input mode, with ``generate=True``, ``return_log_probs=True``,
            ``return_tokens=True``, ``pad_output=False`` and no ``num_samples``. Its ``client``
            is wrapped in an :class:`EngineCallRecorder` (in place).

    Keyword Args:
        group_size: samples per prompt (the GRPO group).
        groups_per_batch: groups per iteration of ``for groups in collector``.
        total_groups: prompts the iterator collects before stopping (None: forever).
        max_turns: most policy turns per episode; defaults to ``env.max_steps``.
        advantage_scale: "group", "batch" (std over the groups kept in one collect) or "none".
        advantage_eps: added to the std (see :func:`rlpost.algo.group_advantages`).
        filter_equal_rewards: DAPO dynamic sampling: drop (and count) groups whose rewards are
            all equal.
        track_policy_version: a :class:`PolicyVersion` to share (e.g. with the owner that
            sets the version after a weight load); True or None makes a new one.
        group_info: extra entries put in every emitted ``Group.info`` (e.g. the env pool index).
        max_prompt_tokens: the longest prompt the engine takes (its context length less one). An
            episode whose next prompt would be longer (a long tool output, many turns) ends at the
            turn before, counted in ``num_length_truncated``; None: no check.
    """

    def __init__(
        self,
        env: Any,
        policy: Any,
        *,
        group_size: int,
        groups_per_batch: int = 1,
        total_groups: int | None = None,
        max_turns: int | None = None,
        advantage_scale: str = "group",
        advantage_eps: float = 1e-4,
        filter_equal_rewards: bool = False,
        track_policy_version: bool | PolicyVersion | None = True,
        group_info: dict[str, Any] | None = None,
        max_prompt_tokens: int | None = None,
    ) -> None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
        if groups_per_batch < 1:
            raise ValueError(f"groups_per_batch must be >= 1, got {groups_per_batch}")
        if advantage_scale not in ADVANTAGE_SCALES:
            raise ValueError(f"advantage_scale must be one of {ADVANTAGE_SCALES}, got {advantage_scale!r}")
        max_turns = max_turns if max_turns is not None else getattr(env, "max_steps", None)
        if max_turns is None or max_turns < 1:
            raise ValueError(
                f"GroupCollector needs a bound on the turns of an episode: pass max_turns >= 1 or give "
                f"the env max_steps (got max_turns={max_turns})"
            )
        repeats = getattr(getattr(env, "primer", None), "repeats", group_size)
        if repeats != group_size:
            raise ValueError(
                f"the env repeats each prompt {repeats} times but group_size is {group_size}; "
                "build the env with repeats=group_size (make_env does)"
            )
        self.env, self.policy = env, policy
        self.recorder = _install_recorder(policy)
        _check_policy(policy, env)
        self.group_size, self.groups_per_batch, self.total_groups = group_size, groups_per_batch, total_groups
        self.max_turns = max_turns
        self.advantage_scale, self.advantage_eps = advantage_scale, advantage_eps
        self.filter_equal_rewards = filter_equal_rewards
        self.policy_version = (
            track_policy_version if isinstance(track_policy_version, PolicyVersion) else PolicyVersion()
        )
        self.group_info = dict(group_info or {})
        self.max_prompt_tokens = max_prompt_tokens
        self.stats = CollectorStats()
        self._num_batches = 0

    # ------------------------------------------------------------------ public API

    def collect(self, num_groups: int) -> list[Group]:
        """Generate ``num_groups`` prompts x ``group_size`` rows to the end; return their groups.

        Fewer groups come back when the DAPO filter drops some (counted). Every group's samples
        were generated together. Batch-level counts in ``Group.info`` (``reward_errors``,
        ``num_filtered_groups``, ``num_drift_truncated``, ``num_length_truncated``) sit on the
        batch's first group and are zero on the others, so summing them over groups is right.
        """
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        start = time.perf_counter()
        errors_before = Counter(self.env.reward_errors)
        truncated_before = (self.stats.num_drift_truncated, self.stats.num_length_truncated)
        episodes = self._run_episodes(num_groups * self.group_size)
        samples = [self._to_sample(ep) for ep in episodes]
        groups, num_filtered = self._assemble(samples)
        reward_errors = Counter(self.env.reward_errors)
        reward_errors.subtract(errors_before)
        reward_errors = Counter({k: v for k, v in reward_errors.items() if v})
        self._record(groups, num_groups, num_filtered, reward_errors, truncated_before)
        self.stats.collect_s += time.perf_counter() - start
        return groups

    def __iter__(self) -> Iterator[list[Group]]:
        """Yield ``collect(groups_per_batch)`` until ``total_groups`` prompts were collected."""
        collected = 0
        while self.total_groups is None or collected < self.total_groups:
            num_groups = self.groups_per_batch
            if self.total_groups is not None:
                num_groups = min(num_groups, self.total_groups - collected)
            groups = self.collect(num_groups)
            collected += num_groups
            yield groups

    def get_policy_version(self) -> int:
        """The latest weights version seen (TorchRL's name)."""
        return self.policy_version.version

    def increment_version(self) -> int:
        return self.policy_version.increment_version()

    def state_dict(self) -> dict[str, Any]:
        """The env's state (the prompt stream's position) and the version tracker."""
        return {"env": self.env.state_dict(), "policy_version": self.policy_version.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.env.load_state_dict(state["env"])
        self.policy_version.load_state_dict(state["policy_version"])

    # ------------------------------------------------------------------ episodes

    def _run_episodes(self, num_rows: int) -> list[_Episode]:
        td = self.env.reset(TensorDict(batch_size=[num_rows]))
        prompt_ids = _prompt_ids(td, num_rows)
        self._check_group_layout(prompt_ids)
        episodes = [_Episode(pid) for pid in prompt_ids]
        active = list(range(num_rows))
        for turn in range(self.max_turns):
            td = self._policy_turn(td, [episodes[i] for i in active])
            next_td = self.env.step(td).get("next")
            rewards = next_td.get("reward").view(-1).tolist()
            done = next_td.get("done").view(-1).tolist()
            tool_stats = _tool_stats(next_td, len(active))
            keep = []
            for j, i in enumerate(active):
                if episodes[i].frozen:  # this turn's response is not in its sample
                    continue
                episodes[i].reward += rewards[j]
                episodes[i].num_turns += 1
                episodes[i].tool_stats = [a + b for a, b in zip(episodes[i].tool_stats, tool_stats[j])]
                if not done[j]:
                    keep.append(j)
            keep = self._drop_long_prompts(next_td, keep)
            if not keep or turn == self.max_turns - 1:
                break
            keys = [self.env.input_mode, *self.env.state_keys, *_FLAGS]
            td = next_td.select(*keys, strict=False)[keep]
            active = [active[j] for j in keep]
        return episodes

    def _drop_long_prompts(self, next_td: TensorDictBase, keep: list[int]) -> list[int]:
        """``keep`` without the rows whose next prompt the engine could not take (counted)."""
        if self.max_prompt_tokens is None or not keep:
            return keep
        rows = self.env.prompt_rows(next_td)
        fits = [j for j in keep if _num_tokens(rows[j], self.env) <= self.max_prompt_tokens]
        self.stats.num_length_truncated += len(keep) - len(fits)
        return fits

    def _policy_turn(self, td: TensorDictBase, episodes: list[_Episode]) -> TensorDictBase:
        """One policy call over ``td`` (all active rows: whole groups), recorded into ``episodes``.

        A row whose prompt does not extend its sequence (drift) is still generated and stepped
        with the others, but its episode is frozen (ends at its previous turn) and counted."""
        self.recorder.take()  # drop anything a previous, failed call left behind
        start = time.perf_counter()
        td = self.policy(td)
        self.stats.generate_s += time.perf_counter() - start
        self.stats.num_policy_calls += 1
        calls = self.recorder.take()
        if len(calls) != 1 or len(calls[0].prompt_token_ids) != len(episodes):
            raise RuntimeError(
                f"one policy call over {len(episodes)} rows made {len(calls)} engine calls of "
                f"{[len(c.prompt_token_ids) for c in calls]} prompts; the collector needs exactly one "
                "call with one prompt per row (a group must be generated in one place)"
            )
        call = calls[0]
        if any(len(c) != 1 for c in call.completions):
            raise RuntimeError(f"expected one completion per row, got {[len(c) for c in call.completions]}")
        completions = [c[0] for c in call.completions]
        self._check_policy_tokens(td, call.prompt_token_ids, completions)
        served = self.policy_version.observe(self.recorder.client, completions, call.reported_version)
        for ep, prompt_ids, completion in zip(episodes, call.prompt_token_ids, completions):
            if not ep.add_turn(prompt_ids, list(completion.token_ids), _logprobs(completion)):
                self.stats.num_drift_truncated += 1
                ep.frozen = True
                continue
            self.stats.num_generated_tokens += len(completion.token_ids)
            ep.finished = bool(completion.finished)
            ep.policy_version = PolicyVersion.merge(ep.policy_version, served)
        return td

    def _check_policy_tokens(self, td: TensorDictBase, prompts: list[list[int]], completions: list[Any]) -> None:
        """The policy's output tokens are the engine's (the wrapper did not re-tokenise)."""
        tokens = td.get("tokens")
        response = [t.tolist() for t in tokens.get("response", as_list=True)]
        prompt = [t.tolist() for t in tokens.get("prompt", as_list=True)]
        for i, (c, p) in enumerate(zip(completions, prompts)):
            if response[i] != list(c.token_ids) or prompt[i] != p:
                raise RuntimeError(
                    f"row {i}: the policy's tokens differ from the ids the engine generated / was sent; "
                    "samples must be built from the engine's own ids"
                )

    def _check_group_layout(self, prompt_ids: list[int]) -> None:
        size = self.group_size
        chunks = [prompt_ids[i : i + size] for i in range(0, len(prompt_ids), size)]
        heads = [chunk[0] for chunk in chunks]
        if any(len(set(chunk)) != 1 for chunk in chunks) or len(set(heads)) != len(heads):
            raise RuntimeError(
                f"the env's reset did not give {size} consecutive rows per prompt (prompt ids {prompt_ids}); "
                "was the prompt stream left mid-group?"
            )

    # ------------------------------------------------------------------ samples and groups

    def _to_sample(self, ep: _Episode) -> Sample:
        tokenizer = self.policy.tokenizer
        generated = ep.token_ids[ep.prompt_len :]
        text = tokenizer.decode(generated, skip_special_tokens=True) if tokenizer is not None else ""
        version = ep.policy_version if ep.policy_version is not None else self.policy_version.version
        return Sample(
            prompt_id=ep.prompt_id,
            token_ids=ep.token_ids,
            logprobs=ep.logprobs,
            loss_mask=ep.loss_mask,
            prompt_len=ep.prompt_len,
            reward=float(ep.reward),
            policy_version=int(version),
            finished=bool(ep.finished),
            completion_text=text,
            num_turns=ep.num_turns,
            num_tool_calls=int(ep.tool_stats[0]),
            num_tool_errors=int(ep.tool_stats[1]),
            tool_time_s=float(ep.tool_stats[2]),
        )

    def _assemble(self, samples: list[Sample]) -> tuple[list[Group], int]:
        """Group by prompt with MCAdvantage; "batch" scaling is done here over the kept groups
        (MCAdvantage refuses it: it sees groups one at a time)."""
        mc_scale = "none" if self.advantage_scale == "batch" else self.advantage_scale
        mc = MCAdvantage(
            self.group_size, scale=mc_scale, eps=self.advantage_eps, filter_equal_rewards=self.filter_equal_rewards
        )
        scored = mc.add({"prompt_id": s.prompt_id, "reward": s.reward, "sample": s} for s in samples)
        assert mc.num_pending == 0, f"{mc.num_pending} samples left in incomplete groups"
        advantages = [[m["advantage"] for m in members] for members in scored]
        if self.advantage_scale == "batch" and scored:
            rewards_gn = torch.tensor([[m["reward"] for m in members] for members in scored], dtype=torch.float64)
            advantages = group_advantages(rewards_gn, scale="batch", eps=self.advantage_eps).tolist()
        groups = []
        for members, advantages_n in zip(scored, advantages):
            group_samples = [m["sample"] for m in members]
            groups.append(
                Group(
                    prompt_id=group_samples[0].prompt_id,
                    samples=group_samples,
                    advantages=[float(a) for a in advantages_n],
                    policy_version=min(s.policy_version for s in group_samples),
                    info=dict(self.group_info),
                )
            )
        return groups, mc.num_dropped_equal

    def _record(
        self, groups: list[Group], num_groups: int, num_filtered: int, reward_errors: Counter,
        truncated_before: tuple[int, int],
    ) -> None:  # fmt: skip
        num_drift = self.stats.num_drift_truncated - truncated_before[0]
        num_length = self.stats.num_length_truncated - truncated_before[1]
        for i, group in enumerate(groups):
            first = i == 0
            group.info.update(
                collect_batch=self._num_batches,
                reward_errors=dict(reward_errors) if first else {},
                num_filtered_groups=num_filtered if first else 0,
                num_drift_truncated=num_drift if first else 0,
                num_length_truncated=num_length if first else 0,
            )
        self._num_batches += 1
        self.stats.num_groups_collected += num_groups
        self.stats.num_groups_emitted += len(groups)
        self.stats.num_filtered_groups += num_filtered
        self.stats.num_samples += sum(len(g.samples) for g in groups)
        self.stats.reward_errors.update(reward_errors)
        self.last_batch_info = {
            "num_groups": len(groups), "num_filtered_groups": num_filtered,
            "reward_errors": dict(reward_errors), "num_drift_truncated": num_drift,
            "num_length_truncated": num_length,
        }  # fmt: skip


# ---------------------------------------------------------------------------- helpers


def _install_recorder(policy: Any) -> EngineCallRecorder:
    client = getattr(policy, "client", None)
    if client is None:
        raise ValueError(
            f"GroupCollector needs a vLLMWrapper-like policy with an engine `client`, got {type(policy).__name__}"
        )
    if not isinstance(client, EngineCallRecorder):
        client = EngineCallRecorder(client)
        policy.client = client
    return client


def _check_policy(policy: Any, env: Any) -> None:
    wanted = {"generate": True, "return_log_probs": True, "return_tokens": True, "pad_output": False}
    wrong = {k: getattr(policy, k, None) for k, v in wanted.items() if getattr(policy, k, None) != v}
    if getattr(policy, "num_samples", None) is not None:
        wrong["num_samples"] = policy.num_samples
    if wrong:
        raise ValueError(f"GroupCollector needs a policy with {wanted} and num_samples=None; it has {wrong}")
    if getattr(policy, "input_mode", None) != env.input_mode:
        raise ValueError(f"policy input_mode {policy.input_mode!r} differs from the env's {env.input_mode!r}")


def _prompt_ids(td: TensorDictBase, num_rows: int) -> list[int]:
    if "prompt_id" not in td.keys():
        raise ValueError("the env's reset output has no 'prompt_id': use a DatasetChatEnv (DataLoadingPrimer)")
    ids = td.get("prompt_id").view(-1).tolist()
    if len(ids) != num_rows:
        raise RuntimeError(f"reset of {num_rows} rows gave {len(ids)} prompt ids")
    return ids


def _num_tokens(prompt: Any, env: Any) -> int:
    """Length in tokens of one of ``env.prompt_rows``: ids, rendered text, or messages."""
    if isinstance(prompt, torch.Tensor):
        return prompt.numel()
    tokenizer = env.tokenizer
    if isinstance(prompt, str):
        return len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    ids = tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, return_dict=True,
                                        **env.template_kwargs)["input_ids"]  # fmt: skip
    return len(ids)


def _tool_stats(next_td: TensorDictBase, num_rows: int) -> list[tuple[float, float, float]]:
    """Per row: the tool calls, tool errors and tool seconds of this step (the tool transforms
    write them; zeros without tools)."""
    columns = []
    for key in TOOL_STAT_KEYS:
        value = next_td.get(key, None)
        columns.append(value.view(-1).tolist() if value is not None else [0] * num_rows)
    return list(zip(*columns))


def _logprobs(completion: Any) -> list[float]:
    if completion.logprobs is None or len(completion.logprobs) != len(completion.token_ids):
        raise RuntimeError("the engine returned no (or misaligned) log-probs; the policy must ask for them")
    return [float(lp) for lp in completion.logprobs]
