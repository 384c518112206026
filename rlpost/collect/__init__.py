"""Collection: run envs with an LLM policy into GRPO groups, stamped with the policy version.

- :class:`LLMCollector`: TorchRL's collector, yielding batches of dialog turns (or finished
  trajectories) from any env and policy, into a buffer or a queue if given.
- :class:`RayLLMCollector`: an LLMCollector in a Ray actor (TorchRL's).
- :class:`vLLMUpdater`: the collector's ``weight_updater`` for vLLM workers (over the bus).
- :class:`GroupCollector`: the service's collector: reset -> generate -> step until episodes end;
  whole GRPO groups out
  (all samples of a prompt generated in one engine call, so one set of weights made them).
- :class:`PolicyVersion`: which weights version served each engine call.
"""

from rlpost.collect.collector import CollectorStats, EngineCallRecorder, GroupCollector
from rlpost.collect.llm_collector import LLMCollector
from rlpost.collect.policy_version import PolicyVersion
from rlpost.collect.ray_collector import RayLLMCollector
from rlpost.collect.weight_update import vLLMUpdater

__all__ = ["CollectorStats", "EngineCallRecorder", "GroupCollector", "LLMCollector", "PolicyVersion", "RayLLMCollector",
           "vLLMUpdater"]  # fmt: skip
