"""A KL transform in one named Ray actor shared by every env that asks for it: the
``use_ray_service=True`` form of :class:`~rlpost.envs.kl.RetrieveKL` and
:class:`~rlpost.envs.kl_reward.KLRewardTransform`. rlpost's ``reference`` actor is one (it
subclasses :class:`KLServiceActor`): ``RayRetrieveKL(actor_name="reference")`` attaches to it.

Deliberate deviation from TorchRL: every remote call waits at most ``timeout_s``, then raises
``TimeoutError`` naming the actor instead of hanging the env.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDictBase

from rlpost.envs.transforms import Transform

DEFAULT_RAY_TIMEOUT_S = 600.0


class KLServiceActor:
    """The body of a shared KL actor: one transform, called by any number of envs."""

    def __init__(self, transform: Transform | None = None, *, transform_factory: Callable[[], Transform] | None = None):
        if (transform is None) == (transform_factory is None):
            raise ValueError("KLServiceActor needs a transform or a transform_factory")
        self.transform = transform if transform is not None else transform_factory()

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        return self.transform(td)

    def on_step(self, td: TensorDictBase, next_td: TensorDictBase) -> TensorDictBase:
        return self.transform.on_step(td, next_td)

    def describe(self) -> str:
        return repr(self.transform)


class RayTransform(Transform):
    """A transform run in the :class:`KLServiceActor` named ``actor_name`` (the first env creates
    it, the others attach); Ray's own errors (the actor died) propagate."""

    def __init__(
        self,
        make_transform: Callable[[], Transform] | None,
        *,
        num_cpus: float | None = None,
        num_gpus: float = 0,
        device: torch.device | str | None = None,
        actor_name: str | None = None,
        timeout_s: float = DEFAULT_RAY_TIMEOUT_S,
    ) -> None:
        super().__init__()
        import ray

        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True)
        self._ray, self.actor_name, self.timeout_s = ray, actor_name, timeout_s
        self.device = torch.device(device) if device is not None else None
        self._actor = self._find_actor(actor_name) if actor_name is not None else None
        if self._actor is None:
            if make_transform is None:
                raise ValueError(f"no Ray actor named {actor_name!r} is running and no model was given to start one")
            options: dict[str, Any] = {"num_cpus": 1 if num_cpus is None else num_cpus, "num_gpus": num_gpus}
            if actor_name is not None:
                options.update(name=actor_name, get_if_exists=True)
            self._actor = ray.remote(KLServiceActor).options(**options).remote(transform_factory=make_transform)

    def _find_actor(self, name: str) -> Any:
        try:
            return self._ray.get_actor(name)
        except ValueError:
            return None

    def _call(self, method: str, *args: TensorDictBase) -> TensorDictBase:
        from ray.exceptions import GetTimeoutError

        source_device = args[0].device
        ref = getattr(self._actor, method).remote(*[arg.cpu() for arg in args])
        try:
            out = self._ray.get(ref, timeout=self.timeout_s)
        except GetTimeoutError:
            raise TimeoutError(
                f"the KL service actor {self.actor_name or self._actor} did not answer within {self.timeout_s} s"
            ) from None
        return out.to(source_device) if source_device is not None else out

    def on_step(self, td: TensorDictBase, next_td: TensorDictBase) -> TensorDictBase:
        out = self._call("on_step", td, next_td)
        next_td.update(out)
        return next_td

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        return self._call("forward", td)

    forward = __call__

    def __repr__(self) -> str:
        return f"{type(self).__name__}(actor_name={self.actor_name!r})"
