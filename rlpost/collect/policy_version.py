"""PolicyVersion: which weights version generated the tokens of each sample.

TorchRL's transform (defined in :mod:`rlpost.envs.policy_version`, re-exported here). The
whole-episodes collector uses integer versions (bumped by the learner at every publication).
Contract with engine clients: a client MAY expose ``last_policy_version``, its latest
``generate``'s version (the *oldest* when several workers served one call; LocalVLLMClient's
owner calls ``set_version``); a completion's own ``policy_version`` wins. Each sample is stamped
with the oldest version of any of its tokens (:meth:`PolicyVersion.merge`): a multi-turn episode
is as stale as its oldest turn.
"""

from __future__ import annotations

from rlpost.envs.policy_version import PolicyVersion, VersionChange

__all__ = ["PolicyVersion", "VersionChange"]
