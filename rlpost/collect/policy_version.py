"""PolicyVersion: which weights version generated the tokens of each sample.

The class is TorchRL's ``PolicyVersion`` transform, defined in
:mod:`rlpost.envs.policy_version` and re-exported here; this module describes how rlpost's
collector in its whole-episodes mode (:class:`~rlpost.collect.LLMCollector`, the service's) uses it. Integer versions
only there: the learner bumps the version at every weight publication; inference workers load
the new weights and report the version they served with. Contract with engine clients
(:class:`rlpost.policies.VLLMEngineClient` implementations):

- a client MAY expose ``last_policy_version: int``: the version that served its latest
  ``generate`` call. When one call is served by several workers, it must be the *oldest* of
  their versions. The remote client of the inference workers does this; LocalVLLMClient does
  not (its owner tells the tracker with ``set_version`` after loading weights).
- a completion MAY carry its own ``policy_version`` attribute; it wins over the client's.

The collector reads the version right after each engine call (:meth:`PolicyVersion.observe`)
and stamps each sample with the oldest version that generated any of its tokens
(:meth:`PolicyVersion.merge`): a multi-turn episode whose turns straddle a weight update is as
stale as its oldest turn. As an env transform (TorchRL's use) the tracker writes the current
version under ``"policy_version"`` at every reset and step.
"""

from __future__ import annotations

from rlpost.envs.policy_version import PolicyVersion, VersionChange

__all__ = ["PolicyVersion", "VersionChange"]
