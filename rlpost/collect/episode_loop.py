"""The whole-episodes loop of :class:`~rlpost.collect.LLMCollector` (its ``whole_episodes``
mode; the pieces it uses, and what a batch is, in :mod:`rlpost.collect.episodes`)."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from tensordict import TensorDict, TensorDictBase

from rlpost.collect import episodes as ep
from rlpost.collect.episodes import WholeEpisodes
from rlpost.data.samples import Group

_FLAGS = ("done", "terminated", "truncated")


class WholeEpisodeLoop:
    """Mixin of :class:`~rlpost.collect.LLMCollector`: runs batches of whole episodes into GRPO
    groups; the attributes it reads (``env``, ``policy``, ``recorder``, ``episode_stats``...)
    are the collector's."""

    def collect_groups(self, num_groups: int | None = None) -> list[Group]:
        """One whole-episodes batch: ``num_groups`` prompts (default: ``dialog_turns_per_batch``'s
        worth) x ``group_size`` rows run to their end; their GRPO groups (fewer when filtered).
        Batch-level counts in ``Group.info`` sit on the first group, zero on the others, so
        summing them over groups is right.
        """
        settings = self._whole_episodes("collect_groups")
        if num_groups is None:
            num_groups = self.requested_frames_per_batch // settings.group_size
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        start = time.perf_counter()
        errors_before = Counter(getattr(self.env, "reward_errors", {}))
        truncated_before = (self.episode_stats.num_drift_truncated, self.episode_stats.num_length_truncated)
        episodes = self._run_episodes(num_groups * settings.group_size)
        fallback = self.policy_version_tracker.version
        samples = [e.to_sample(getattr(self.policy, "tokenizer", None), fallback) for e in episodes]
        if settings.reward_adjustment is not None:  # e.g. the KL penalty, before any advantage
            samples = settings.reward_adjustment(samples)
        groups, num_filtered = ep.assemble_groups(samples, settings)
        reward_errors = Counter(getattr(self.env, "reward_errors", {}))
        reward_errors.subtract(errors_before)
        reward_errors = Counter({k: v for k, v in reward_errors.items() if v})
        self._record(groups, num_groups, num_filtered, reward_errors, truncated_before)
        self.episode_stats.collect_s += time.perf_counter() - start
        return groups

    def _whole_episodes(self, caller: str) -> WholeEpisodes:
        if self.whole_episodes is None:
            raise RuntimeError(f"LLMCollector.{caller} needs whole_episodes=True (or a WholeEpisodes)")
        return self.whole_episodes

    def _check_whole_episode_counts(self) -> None:
        size = self.whole_episodes.group_size
        for name, value in (("dialog_turns_per_batch", self.requested_frames_per_batch),
                            ("total_dialog_turns", max(self.total_frames, 0))):  # fmt: skip
            if value % size:
                raise ValueError(
                    f"with whole_episodes, {name} counts episodes in whole groups: {value} is not a multiple "
                    f"of group_size {size}"
                )

    def _run_episodes(self, num_rows: int) -> list[ep.Episode]:
        settings = self.whole_episodes
        td = self.env.reset(TensorDict(batch_size=[num_rows]))
        ids = ep.prompt_ids(td, num_rows)
        ep.check_group_layout(ids, settings.group_size)
        episodes = [ep.Episode(pid, task=task) for pid, task in zip(ids, ep.row_tasks(td, num_rows))]
        active = list(range(num_rows))
        for turn in range(settings.max_turns):
            td = self._policy_turn(td, [episodes[i] for i in active])
            next_td = self.env.step(td).get("next")
            rewards = next_td.get("reward").view(-1).tolist()
            done = next_td.get("done").view(-1).tolist()
            tool_stats = ep.tool_stats(next_td, len(active))
            parts = ep.reward_parts(next_td, len(active))
            keep = []
            for j, i in enumerate(active):
                if episodes[i].frozen:  # this turn's response is not in its sample
                    continue
                episodes[i].reward += rewards[j]
                episodes[i].num_turns += 1
                episodes[i].tool_stats = [a + b for a, b in zip(episodes[i].tool_stats, tool_stats[j])]
                for name, value in parts[j].items():
                    episodes[i].reward_parts[name] = episodes[i].reward_parts.get(name, 0.0) + value
                if not done[j]:
                    keep.append(j)
            keep = self._drop_long_prompts(next_td, keep)
            if not keep or turn == settings.max_turns - 1:
                break
            keys = [self.env.input_mode, *self.env.state_keys, *_FLAGS]
            td = next_td.select(*keys, strict=False)[keep]
            active = [active[j] for j in keep]
        return episodes

    def _drop_long_prompts(self, next_td: TensorDictBase, keep: list[int]) -> list[int]:
        """``keep`` without the rows whose next prompt the engine could not take (counted)."""
        limit = self.whole_episodes.max_prompt_tokens
        if limit is None or not keep:
            return keep
        rows = self.env.prompt_rows(next_td)
        fits = [j for j in keep if ep.num_tokens(rows[j], self.env) <= limit]
        self.episode_stats.num_length_truncated += len(keep) - len(fits)
        return fits

    def _policy_turn(self, td: TensorDictBase, episodes: list[ep.Episode]) -> TensorDictBase:
        """One policy call over all active rows (whole groups), recorded into ``episodes``; a
        drifted row is still generated and stepped, but its episode is frozen and counted."""
        self.recorder.take()  # drop anything a previous, failed call left behind
        start = time.perf_counter()
        td = self.policy(td)
        self.episode_stats.generate_s += time.perf_counter() - start
        self.episode_stats.num_policy_calls += 1
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
        tracker = self.policy_version_tracker
        served = tracker.observe(self.recorder.client, completions, call.reported_version)
        for episode, prompt_ids, completion in zip(episodes, call.prompt_token_ids, completions):
            ids = list(completion.token_ids)
            versions = getattr(completion, "token_versions", None)
            if versions is None and served is not None:
                versions = [int(served)] * len(ids)
            if not episode.add_turn(prompt_ids, ids, ep.completion_logprobs(completion), versions):
                self.episode_stats.num_drift_truncated += 1
                episode.frozen = True
                continue
            self.episode_stats.num_generated_tokens += len(completion.token_ids)
            episode.finished = bool(completion.finished)
            episode.policy_version = tracker.merge(episode.policy_version, served)
        return td

    @staticmethod
    def _check_policy_tokens(td: TensorDictBase, prompts: list[list[int]], completions: list[Any]) -> None:
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

    def _record(
        self, groups: list[Group], num_groups: int, num_filtered: int, reward_errors: Counter,
        truncated_before: tuple[int, int],
    ) -> None:  # fmt: skip
        num_drift = self.episode_stats.num_drift_truncated - truncated_before[0]
        num_length = self.episode_stats.num_length_truncated - truncated_before[1]
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
        self.episode_stats.num_groups_collected += num_groups
        self.episode_stats.num_groups_emitted += len(groups)
        self.episode_stats.num_filtered_groups += num_filtered
        self.episode_stats.num_samples += sum(len(g.samples) for g in groups)
        self.episode_stats.reward_errors.update(reward_errors)
        self.last_batch_info = {
            "num_groups": len(groups), "num_filtered_groups": num_filtered,
            "reward_errors": dict(reward_errors), "num_drift_truncated": num_drift,
            "num_length_truncated": num_length,
        }  # fmt: skip


def whole_episodes_settings(whole_episodes: bool | WholeEpisodes | None, env: Any) -> WholeEpisodes | None:
    """The ``whole_episodes`` argument as resolved settings (None: the mode is off)."""
    if whole_episodes is None or whole_episodes is False:
        return None
    settings = WholeEpisodes() if whole_episodes is True else whole_episodes
    if not isinstance(settings, WholeEpisodes):
        raise TypeError(f"whole_episodes must be a bool or a WholeEpisodes, got {type(whole_episodes).__name__}")
    return settings.resolved(env)
