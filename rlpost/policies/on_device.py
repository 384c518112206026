"""LLMOnDevice: a ``vllm.LLM`` whose engine starts when asked (TorchRL's ``LLMOnDevice``).

Made to be a Ray actor class: ``ray.remote(num_gpus=1)(LLMOnDevice).remote(model, ...)`` creates
the actor cheaply, and ``actor.initialize.remote()`` starts the engine inside it, on the devices
Ray gave the actor. ``bundle_indices`` places the engine's workers on placement-group bundles (it
sets vLLM's ``VLLM_RAY_BUNDLE_INDICES``). The class is built on first access, so importing rlpost
does not import vLLM.
"""

from __future__ import annotations

import os
from functools import cache


@cache
def llm_on_device_class() -> type:
    """``LLMOnDevice``, a subclass of the installed ``vllm.LLM``."""
    from vllm import LLM

    class LLMOnDevice(LLM):
        """A ``vllm.LLM`` that keeps its arguments until :meth:`initialize` (see the module docstring)."""

        def __init__(self, *args, bundle_indices: list[int] | None = None, **kwargs):
            if bundle_indices is not None:
                os.environ["VLLM_RAY_BUNDLE_INDICES"] = ",".join(str(int(i)) for i in bundle_indices)
            self.args, self.kwargs = args, kwargs
            self.initialized = False

        def initialize(self) -> bool:
            """Start the engine with the arguments given to the constructor."""
            if not self.initialized:
                LLM.__init__(self, *self.args, **self.kwargs)
                self.initialized = True
            return True

    LLMOnDevice.__module__ = __name__
    return LLMOnDevice
