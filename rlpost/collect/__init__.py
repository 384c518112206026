"""Collection: run envs with an LLM policy into GRPO groups, stamped with the policy version.

- :class:`LLMCollector`: reset -> generate -> step until episodes end; whole groups out
  (all samples of a prompt generated in one engine call, REFERENCE.md pitfall 8).
- :class:`PolicyVersion`: which weights version served each engine call.
"""

from rlpost.collect.collector import CollectorStats, EngineCallRecorder, LLMCollector
from rlpost.collect.policy_version import PolicyVersion

__all__ = ["CollectorStats", "EngineCallRecorder", "LLMCollector", "PolicyVersion"]
