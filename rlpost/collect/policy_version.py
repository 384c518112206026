"""PolicyVersion: which weights version generated the tokens of each sample.

TorchRL's ``PolicyVersion`` transform (defined in :mod:`rlpost.envs.policy_version`, re-exported
here); as an env transform it writes the current version under ``"policy_version"`` at every
reset and step. The whole-episodes collector uses integer versions: the learner bumps the version
at every publication and inference workers report the version they served with. Contract with
engine clients (:class:`rlpost.policies.VLLMEngineClient`): a client MAY expose
``last_policy_version``, the version of its latest ``generate`` (the *oldest* when several workers
served one call; LocalVLLMClient has none, its owner calls ``set_version``); a completion MAY carry
its own ``policy_version``, which wins. The collector reads it after each engine call
(:meth:`PolicyVersion.observe`) and stamps each sample with the oldest version of any of its
tokens (:meth:`PolicyVersion.merge`): a multi-turn episode is as stale as its oldest turn.
"""

from __future__ import annotations

from rlpost.envs.policy_version import PolicyVersion, VersionChange

__all__ = ["PolicyVersion", "VersionChange"]
