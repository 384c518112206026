"""How a learner process holds its memory and its threads.

The model's memory: :func:`own_trainable_weights` copies the trainable weights out of the
memory-mapped checkpoint file, and :func:`enable_activation_checkpointing` makes the decoder
layers recompute their activations in the backward pass (``trainer.gradient_checkpointing``);
the :class:`~rlpost.actors.learner.core.Learner` calls both while it builds its model. The
process's: :func:`return_freed_memory_to_os` sets glibc's allocator to give freed tensor memory
back (``resources.learner.release_freed_memory``, decided by :func:`release_freed_memory`) and
:func:`set_torch_threads` sets the torch threads; the
:class:`~rlpost.actors.learner.actor.LearnerActor` calls them before it builds its learner (the
reference and reward actors call :func:`set_torch_threads` too).
"""

from __future__ import annotations

import torch


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Have each decoder layer of a transformers ``model`` recompute its activations in the
    backward pass instead of keeping them from the forward.

    transformers checkpoints a layer only while that layer is in training mode, and the learner
    keeps its model in eval mode (dropout off). So the decoder layers alone are switched to
    training mode: the modules inside them (attention, MLP, dropout) stay in eval mode and
    compute exactly what they did, and the loss and gradients are unchanged. The KV cache is
    turned off too: the learner scores whole sequences and never reads it.
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
    """Copy each trainable CPU parameter of ``model`` into memory of its own; returns how many.

    transformers maps a safetensors checkpoint into memory and its CPU parameters are views of
    the mapped file (private, copy-on-write pages). The first optimizer step writes every
    trainable weight, and each of its 4 KB pages is then copied by a page fault inside the step:
    measured on the Qwen2.5-0.5B-shaped model (2 CPU threads), the first AdamW step took 8.6 s
    against 3.4 s after this copy, which takes 0.6 s at load time. Frozen weights (a LoRA base
    model) keep the mapping, and the memory it saves; a parameter on an accelerator is already a
    copy. Parameter objects are kept (``.data`` is replaced), so tied weights stay tied."""
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
    returns whether it applied).

    glibc serves allocations of up to 32 MB from heaps that it trims lazily, and it raises its
    mmap threshold each time a large block is freed: a training step's activations, gradients
    and gather buffers, freed at the end of the step, stay resident, and the next step's
    allocations land on top of them. With the threshold fixed at 128 KB, every tensor larger than
    that gets pages of its own that ``free`` unmaps, and pays the page faults of fresh pages on
    every allocation: measured on the Qwen2.5-0.5B-shaped model (one learner, 16 rows of 78
    tokens, 2 CPU threads) peak resident memory 12.0 -> 10.1 GB for a step of 15.3 s against
    12.1 s, on the tiny model 0.26 s against 0.14 s; each rank of a 2-rank group peaks at 6.6 GB
    against 8.7 GB (``bench learner_group``). Hence ``resources.learner.release_freed_memory``."""
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
