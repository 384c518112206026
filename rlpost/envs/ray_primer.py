"""TorchRL's ``RayDataLoadingPrimer``: a :class:`~rlpost.envs.datasets.DataLoadingPrimer` whose
prompt stream lives in one Ray actor, shared by every env that names it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlpost.envs.datasets import DataLoadingPrimer, PromptItem


class _SharedStream:
    """The Ray actor behind :class:`RayDataLoadingPrimer`: one primer whose prompt stream every
    env sharing the actor draws from."""

    def __init__(self, source: Any, factory: bool, kwargs: dict[str, Any]) -> None:
        self.primer = DataLoadingPrimer(source() if factory else source, **kwargs)

    def next_items(self, num_items: int) -> list[PromptItem]:
        return self.primer.next_items(num_items)

    def state_dict(self) -> dict[str, Any]:
        return self.primer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.primer.load_state_dict(state)

    def reset_dataloader(self) -> None:
        self.primer.reset_dataloader()


class RayDataLoadingPrimer(DataLoadingPrimer):
    """A :class:`DataLoadingPrimer` whose prompt stream lives in one Ray actor, shared by every env
    that names the same actor (TorchRL's): envs in several collectors draw one stream, so no prompt
    is served twice and the copies of a prompt (``repeats``) keep their shared ``prompt_id``
    wherever they land; ``state_dict()`` saves the shared position.

    The source (``dataloader``, pickled to the actor; ``dataloader_factory``, called in the actor
    and once here to learn the columns; or ``dataset``, rlpost's rows) and ``**kwargs``
    (:class:`DataLoadingPrimer`'s) apply in the actor; the actor made first sets the stream.
    ``actor_name``: an existing actor of that name is used, else made (None: this primer's own);
    ``num_cpus`` defaults to none reserved; ``timeout_s`` bounds each call (rlpost's).

    Deviations from TorchRL: a named actor lives with the Ray job, not detached beyond it; this
    object also reads the source's first row itself, for the columns the env writes.
    """

    def __init__(self, *, dataloader: Any = None, dataloader_factory: Callable[[], Any] | None = None,
                 num_cpus: float | None = None, num_gpus: float = 0, device: torch.device | str | None = None,
                 actor_name: str | None = None, timeout_s: float = 120.0, **kwargs: Any) -> None:  # fmt: skip
        import ray

        sources = [s for s in (dataloader, dataloader_factory, kwargs.get("dataset")) if s is not None]
        if len(sources) != 1:
            raise ValueError("RayDataLoadingPrimer needs exactly one of dataloader=, dataloader_factory= and dataset=")
        dataset = kwargs.pop("dataset", None)
        local = dataloader_factory() if dataloader_factory is not None else dataloader
        super().__init__(local, dataset=dataset, device=device, **kwargs)
        options: dict[str, Any] = {"num_cpus": num_cpus or 0, "num_gpus": num_gpus}
        if actor_name is not None:
            options.update(name=actor_name, get_if_exists=True)
        factory = dataloader_factory is not None
        source = dataloader_factory if factory else (dataloader if dataloader is not None else dataset)
        shared = {**kwargs, "device": None}  # the actor sends rows; this side writes the tensors
        self.actor_name, self.timeout_s = actor_name, timeout_s
        self._stream = ray.remote(**options)(_SharedStream).remote(source, factory, shared)

    def _ask(self, method: str, *args: Any) -> Any:
        import ray

        try:
            return ray.get(getattr(self._stream, method).remote(*args), timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            name = self.actor_name or "unnamed"
            raise TimeoutError(
                f"RayDataLoadingPrimer ({name}): {method} did not return within {self.timeout_s:.0f} s"
            ) from None

    def next_items(self, num_items: int) -> list[PromptItem]:
        return self._ask("next_items", num_items)

    def state_dict(self) -> dict[str, Any]:
        return self._ask("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._ask("load_state_dict", state)

    def reset_dataloader(self) -> DataLoadingPrimer:
        if hasattr(self, "_stream"):  # DataLoadingPrimer's own set-up calls this before the actor exists
            self._ask("reset_dataloader")
        return super().reset_dataloader()

    def __repr__(self) -> str:
        return f"RayDataLoadingPrimer(actor={self.actor_name or 'unnamed'}, dataset={self.description}, repeats={self.repeats})"
