"""How a learner holds its memory and threads: the model's (set as the Learner builds it) and the
process's (set first by the LearnerActor)."""

from __future__ import annotations

import torch


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Have each decoder layer recompute its activations in the backward instead of keeping them.

    Trap: transformers checkpoints a layer only in training mode, and the learner stays in eval
    mode (dropout off); so only the decoder layers themselves are switched to training mode (the
    modules inside stay in eval: loss and gradients unchanged). The KV cache goes off too.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"trainer.gradient_checkpointing: {type(model).__name__} does not support gradient checkpointing"
        )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    if not layers:  # e.g. remote code whose layers do not take transformers' checkpointing
        raise ValueError(
            f"trainer.gradient_checkpointing: no layer of {type(model).__name__} can be checkpointed by transformers"
        )
    for layer in layers:
        layer.training = True  # this module only, not its children (docstring)


def own_trainable_weights(model: torch.nn.Module) -> int:
    """Copy each trainable CPU parameter into memory of its own; returns how many. Trap:
    transformers' CPU parameters are views of the memory-mapped safetensors file (copy-on-write),
    so the first optimizer step page-faults every 4 KB page: on the 0.5B-shaped model (2 threads)
    the first AdamW step took 8.6 s instead of 3.4 s (the copy costs 0.6 s at load). Frozen
    weights keep the mapping. ``.data`` is replaced, so tied weights stay tied."""
    copied = 0
    for param in model.parameters():  # each tied parameter once
        if param.requires_grad and param.device.type == "cpu":
            param.data = param.data.clone()
            copied += 1
    return copied


# glibc's mallopt parameters, and the size above which a learner's allocations get pages of their own
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_LEARNER_MMAP_THRESHOLD = 128 * 1024


def return_freed_memory_to_os() -> bool:
    """Make this process's C allocator give freed tensor memory back to the OS (glibc only;
    whether it applied). glibc trims its heaps lazily and raises its mmap threshold as large
    blocks are freed, so a step's freed activations and gradients stay resident. A fixed 128 KB
    threshold unmaps them on ``free``, at the cost of fresh-page faults: on the 0.5B-shaped model
    (16 rows of 78 tokens, 2 threads) peak memory 12.0 -> 10.1 GB, step 12.1 -> 15.3 s (tiny model
    0.14 -> 0.26 s); a 2-rank group 8.7 -> 6.6 GB per rank (``bench learner_group``). Hence the
    option."""
    import ctypes
    import ctypes.util

    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):  # no C library found, or not glibc: nothing to set
        return False
    applied = [mallopt(option, _LEARNER_MMAP_THRESHOLD) == 1 for option in (_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD)]
    return all(applied)


def release_freed_memory(resources, world_size: int) -> bool:
    """Whether a learner rank gives freed memory back to the OS: ``resources.learner.
    release_freed_memory``, or by default only in a group of ranks (whose point is memory)."""
    setting = resources.release_freed_memory
    return world_size > 1 if setting is None else setting


def set_torch_threads(num_threads: int | None) -> None:
    """Give this process ``num_threads`` torch threads (None: keep Ray's OMP_NUM_THREADS, which
    Ray sets from an actor's reserved CPUs, at least 1)."""
    if num_threads is not None:
        torch.set_num_threads(num_threads)
