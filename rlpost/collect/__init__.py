"""Collection: run envs with an LLM policy into batches or GRPO groups, stamped with the policy version.

- :class:`LLMCollector`: TorchRL's collector, yielding batches of dialog turns (or finished
  trajectories) from any env and policy, into a buffer or a queue if given. With
  ``whole_episodes`` (settings: :class:`WholeEpisodes`) it runs the service's batches: all
  episodes of a batch start together and end inside it, each turn's rows in one engine call,
  and whole GRPO groups come out (what ``rlpost train``'s env pools and evaluation run).
- :class:`RayLLMCollector`: an LLMCollector in a Ray actor (TorchRL's).
- :class:`vLLMUpdater`: the collector's ``weight_updater`` for vLLM workers (over the bus).
- :class:`PolicyVersion`: which weights version served each engine call.
"""

from rlpost.collect.episodes import CollectorStats, EngineCallRecorder, WholeEpisodes
from rlpost.collect.llm_collector import LLMCollector
from rlpost.collect.policy_version import PolicyVersion
from rlpost.collect.ray_collector import RayLLMCollector
from rlpost.collect.weight_update import vLLMUpdater

__all__ = ["CollectorStats", "EngineCallRecorder", "LLMCollector", "PolicyVersion", "RayLLMCollector", "WholeEpisodes",
           "vLLMUpdater"]  # fmt: skip
