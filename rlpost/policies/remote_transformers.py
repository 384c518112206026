"""RemoteTransformersWrapper: a TransformersWrapper in a Ray actor (TorchRL's).

The wrapper is called as a local one (``remote(td)``, ``remote.log_prob(td)``,
``remote.generate``); each call runs in the actor and returns there::

    driver / env threads                       Ray actor (max_concurrency threads)
    RemoteTransformersWrapper(td) ---- call --> _WrapperHost.call(version, "forward", td)
                                  <- result --    -> TransformersWrapper(model).forward(td)

With ``batching=True`` the concurrent calls of several callers (the actor runs up to
``max_concurrency`` at once) are batched in the actor by the wrapper's own batch queue.

Every call is bounded by ``timeout_s`` (rlpost's; a ``TimeoutError`` naming the call); an error
in the actor is re-raised here as Ray does. Deliberate deviations from TorchRL: ``num_gpus`` defaults to 1 only
when the cluster has a GPU (TorchRL's 1 would never schedule on a CPU cluster);
``get_new_version`` returns a RemoteTransformersWrapper on the same actor and model (TorchRL
returns the twin itself, model and all, copied out of the actor); attributes are read from the
actor through one method (``remote.generate`` is the actor's value).
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from rlpost.policies.transformers_wrapper import TransformersWrapper

# the wrapper's attributes a remote one reads from the actor (TorchRL's list)
_REMOTE_ATTRIBUTES = frozenset(
    {
        "generate", "pad_output", "text_key", "tokens_key", "masks_key", "log_probs_key", "history_key",
        "in_keys", "out_keys", "inplace", "layout", "num_samples", "batching", "log_prob_key",
        "log_prob_keys", "dist_sample_keys", "dist_params_keys", "input_mode", "input_key",
        "generate_kwargs", "prefer_tokens", "pad_model_input", "_min_batch_size", "_max_batch_size",
    }
)  # fmt: skip


class _WrapperHost:
    """The actor's body: the TransformersWrapper and its twins (``get_new_version``), on one model,
    each under a version number; forwards each call to one of them."""

    def __init__(self, model: Any, kwargs: dict[str, Any]):
        self._wrappers = {0: TransformersWrapper(model, **kwargs)}
        self._numbers = itertools.count(1)

    def call(self, version: int, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._wrappers[version], method)(*args, **kwargs)

    def get(self, version: int, name: str) -> Any:
        return getattr(self._wrappers[version], name)

    def set(self, version: int, name: str, value: Any) -> None:
        setattr(self._wrappers[version], name, value)

    def new_version(self, version: int, overrides: dict[str, Any]) -> int:
        number = next(self._numbers)
        self._wrappers[number] = self._wrappers[version].get_new_version(**overrides)
        return number


class RemoteTransformersWrapper:
    """A :class:`TransformersWrapper` in a Ray actor, called as a local one (module docstring).

    Args:
        model: the model's name or path (the actor loads it); a model object (copied into the
            actor) only with ``validate_model=False``.
        actor_name: an actor of that name already alive is used (the other keyword arguments
            then ignored, as in TorchRL).
        num_gpus: None: 1 when the cluster has a GPU, else 0.
        **kwargs: :class:`TransformersWrapper`'s keyword arguments.
    """

    def __init__(
        self,
        model: Any,
        max_concurrency: int = 16,
        validate_model: bool = True,
        actor_name: str | None = None,
        num_gpus: int | None = None,
        num_cpus: int = 1,
        *,
        timeout_s: float = 600.0,
        **kwargs: Any,
    ):
        import ray

        if validate_model and not isinstance(model, (str, os.PathLike)):
            raise ValueError(
                "For RemoteTransformersWrapper, the model parameter must be a string (model name or path). "
                f"Got type: {type(model)}. Transformers models are not serializable, so only model names/paths "
                "are supported. You can bypass this check by setting validate_model=False."
            )
        if not ray.is_initialized():
            ray.init()
        self.timeout_s = float(timeout_s)
        self._version = 0
        self._owned = False
        self._remote_wrapper = _existing_actor(actor_name) if actor_name is not None else None
        if self._remote_wrapper is None:
            if num_gpus is None:
                num_gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
            options = dict(max_concurrency=max_concurrency, num_gpus=num_gpus, num_cpus=num_cpus, name=actor_name)
            model = str(model) if isinstance(model, os.PathLike) else model
            self._remote_wrapper = ray.remote(_WrapperHost).options(**options).remote(model, kwargs)
            self._owned = True

    @classmethod
    def _on(cls, handle: Any, version: int, timeout_s: float) -> RemoteTransformersWrapper:
        twin = cls.__new__(cls)
        twin._remote_wrapper, twin._version, twin.timeout_s, twin._owned = handle, version, timeout_s, False
        return twin

    def _get(self, what: str, ref: Any) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError as err:
            raise TimeoutError(f"RemoteTransformersWrapper: {what} got no answer within {self.timeout_s:g}s") from err

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._get(method, self._remote_wrapper.call.remote(self._version, method, *args, **kwargs))

    def __call__(self, tensordict, **kwargs):
        return self._call("forward", tensordict, **kwargs)

    forward = __call__

    def get_new_version(self, **overrides: Any) -> RemoteTransformersWrapper:
        """A twin with some constructor arguments changed, in the same actor, on the same model."""
        version = self._get("get_new_version", self._remote_wrapper.new_version.remote(self._version, overrides))
        return self._on(self._remote_wrapper, version, self.timeout_s)

    def log_prob(self, data, **kwargs):
        return self._call("log_prob", data, **kwargs)

    def get_dist(self, tensordict, **kwargs):
        return self._call("get_dist", tensordict, **kwargs)

    def cleanup_batching(self, *, flush: bool = False) -> None:
        self._call("cleanup_batching", flush=flush)

    def get_batching_state(self) -> dict[str, Any]:
        return self._call("get_batching_state")

    @property
    def collector(self) -> None:
        """A collector registers with a local policy; the actor's wrapper has none."""
        return None

    def __getattr__(self, name: str) -> Any:
        if name not in _REMOTE_ATTRIBUTES:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return self._get(name, self._remote_wrapper.get.remote(self._version, name))

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _REMOTE_ATTRIBUTES:
            self._get(f"setting {name}", self._remote_wrapper.set.remote(self._version, name, value))
        else:
            object.__setattr__(self, name, value)

    def __enter__(self) -> RemoteTransformersWrapper:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.cleanup_batching()

    def shutdown(self) -> None:
        """Stop the actor, if this wrapper started it (rlpost's; twins and shared actors do not)."""
        import ray

        if self._owned:
            ray.kill(self._remote_wrapper)
            self._owned = False


def _existing_actor(name: str) -> Any:
    """The live actor called ``name``, or None."""
    import ray

    try:
        return ray.get_actor(name)
    except ValueError:
        return None
