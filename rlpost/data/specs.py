"""Specs: what an env or transform reads and writes, without running it (TorchRL's tensor specs).

The few spec types rlpost's LLM data classes and envs need, with TorchRL's names and shape
semantics: ``-1`` in a shape means "any size" (a sequence length), sampled as 1. A
:class:`Composite`'s ``data_cls`` is the tensorclass ``zero()``/``rand()`` build and ``is_in``
expects; ``step_mdp_static`` copies the entry whole from ``next`` to the root at each step.

``default_spec`` (History, ChatHistory, Text, ...) builds Composites as TorchRL does: for
``shape=(B, -1)`` the Composite has ``shape[:-1]``, its entries the last dim, so
``History.default_spec().zero()`` is a one-message History. A Composite set into one of more
dims takes the parent's shape (as TorchRL).

Made by data classes, envs and transforms; read by env checks, collectors and tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict, is_tensor_collection
from tensordict.utils import is_non_tensor

__all__ = ["Composite", "NonTensor", "TensorSpec", "Unbounded"]


def _size(shape) -> torch.Size:
    if isinstance(shape, int):
        shape = (shape,)
    return torch.Size(int(s) for s in shape)


def _fits(spec_shape: torch.Size, shape: torch.Size) -> bool:
    """Whether a value of ``shape`` has the spec's shape (``-1`` matches any size)."""
    return len(spec_shape) == len(shape) and all(s in (-1, v) for s, v in zip(spec_shape, shape))


class TensorSpec:
    """Base of the specs: a ``shape``, a ``device`` (None: any) and a ``dtype`` (None: any)."""

    def __init__(self, shape=(1,), device=None, dtype: torch.dtype | None = None):
        self.shape = _size(shape)
        self.device = torch.device(device) if device is not None else None
        self.dtype = dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def _safe_shape(self) -> torch.Size:
        """The shape with every ``-1`` (any size) replaced by 1, for sampling."""
        return torch.Size(s if s >= 0 else 1 for s in self.shape)

    def zero(self, shape=None) -> Any:
        raise NotImplementedError

    def rand(self, shape=None) -> Any:
        raise NotImplementedError

    def one(self, shape=None) -> Any:
        return self.zero(shape)

    def is_in(self, value) -> bool:
        raise NotImplementedError

    def clone(self) -> TensorSpec:
        raise NotImplementedError

    def _with_shape(self, shape) -> TensorSpec:
        out = self.clone()
        out.shape = _size(shape)
        return out

    def _drop_dim(self, dim: int) -> TensorSpec:
        """The spec of one element of a value unbound along batch dim ``dim``."""
        if dim >= self.ndim:
            return self
        return self._with_shape(self.shape[:dim] + self.shape[dim + 1 :])

    def to(self, dest) -> TensorSpec:
        out = self.clone()
        if isinstance(dest, torch.dtype):
            out.dtype = dest
        elif dest is not None:
            out.device = torch.device(dest)
        return out

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self.__dict__ == other.__dict__

    def __repr__(self) -> str:
        fields = ", ".join(f"{key}={value}" for key, value in self.__dict__.items())
        return f"{type(self).__name__}({fields})"


class Unbounded(TensorSpec):
    """A tensor of any values: ``zero()`` is zeros, ``rand()`` normal (float), random integers or
    bools. ``dtype`` defaults to torch's default float dtype, as in TorchRL."""

    def __init__(self, shape=(1,), device=None, dtype: torch.dtype | None = None):
        super().__init__(shape, device, dtype if dtype is not None else torch.get_default_dtype())

    def zero(self, shape=None) -> torch.Tensor:
        return torch.zeros((*_size(shape or ()), *self._safe_shape), dtype=self.dtype, device=self.device)

    def rand(self, shape=None) -> torch.Tensor:
        size = (*_size(shape or ()), *self._safe_shape)
        if self.dtype.is_floating_point:
            return torch.randn(size, dtype=self.dtype, device=self.device)
        if self.dtype == torch.bool:
            return torch.randint(0, 2, size, device=self.device).bool()
        return torch.randint(0, 2**31 - 1, size, dtype=self.dtype, device=self.device)

    def is_in(self, value) -> bool:
        if value is None:
            return True
        return isinstance(value, torch.Tensor) and value.dtype == self.dtype and _fits(self.shape, value.shape)

    def clone(self) -> Unbounded:
        return Unbounded(self.shape, self.device, self.dtype)


class NonTensor(TensorSpec):
    """Non-tensor data (strings, lists, dicts). ``zero()``/``rand()``/``one()`` return
    ``example_data`` as ``NonTensorData`` of the spec's shape (``batched=True``: a
    ``NonTensorStack`` of copies). TorchRL's default shape ``(1,)`` is kept."""

    def __init__(self, shape=(1,), device=None, dtype=None, example_data: Any = None, batched: bool = False):
        super().__init__(shape, device, dtype)
        self.example_data = example_data
        self.batched = batched

    def zero(self, shape=None):
        size = (*_size(shape or ()), *self._safe_shape)
        if not self.batched:
            return NonTensorData(data=self.example_data, batch_size=size, device=self.device)
        value: Any = NonTensorData(data=self.example_data, batch_size=(), device=self.device)
        for n in reversed(size):
            value = NonTensorStack(*[value.clone() for _ in range(n)])
        return value

    def rand(self, shape=None):
        return self.zero(shape)

    def is_in(self, value) -> bool:
        if value is None or not (isinstance(value, torch.Tensor) or is_tensor_collection(value)):
            return True  # plain Python data: nothing to check
        return is_non_tensor(value) and _fits(self.shape, value.batch_size)

    def clone(self) -> NonTensor:
        return NonTensor(self.shape, self.device, self.dtype, self.example_data, self.batched)


class Composite(TensorSpec):
    """A dict of specs sharing a leading ``shape`` (a TensorDict's batch size); see the module
    docstring for ``data_cls`` and ``step_mdp_static``.

    Entries are given as a dict (``Composite({"a": spec}, shape=...)``) or keywords; a nested
    dict becomes a nested Composite; a ``None`` entry is a placeholder with no checks.
    """

    def __init__(
        self,
        *args,
        shape=None,
        device=None,
        data_cls: type | None = None,
        step_mdp_static: bool = False,
        batch_size=None,
        **kwargs,
    ):
        if batch_size is not None:
            if shape is not None:
                raise TypeError("Composite: pass shape or batch_size, not both")
            shape = batch_size
        super().__init__(shape if shape is not None else (), device, None)
        self.data_cls = data_cls
        self.step_mdp_static = step_mdp_static
        self._specs: dict[str, TensorSpec | None] = {}
        if len(args) > 1:
            raise TypeError("Composite takes at most one positional argument (a dict of specs)")
        for key, spec in {**(args[0] if args else {}), **kwargs}.items():
            self[key] = spec

    # -------------------------------------------------------------- mapping

    def __setitem__(self, key, spec: TensorSpec | dict | None) -> None:
        if isinstance(key, tuple):
            head, rest = key[0], key[1:]
            if not rest:
                self[head] = spec
                return
            if head not in self._specs:
                self[head] = Composite(shape=self.shape, device=self.device)
            self._specs[head][rest] = spec
            return
        if isinstance(spec, dict):
            spec = Composite(spec, shape=self.shape, device=self.device)
        if spec is not None and spec.shape[: self.ndim] != self.shape:
            if (
                isinstance(spec, (Composite, NonTensor))
                and spec.ndim < self.ndim
                and self.shape[: spec.ndim] == spec.shape
            ):
                spec = spec._with_shape(self.shape)
            else:
                raise ValueError(
                    f"the first {self.ndim} dims of the spec of {key!r} must be the Composite's shape "
                    f"{tuple(self.shape)}, got {tuple(spec.shape)}"
                )
        self._specs[key] = spec

    def set(self, key, spec) -> Composite:
        self[key] = spec
        return self

    def __getitem__(self, key):
        if isinstance(key, tuple):
            value = self._specs[key[0]]
            return value if len(key) == 1 else value[key[1:]]
        return self._specs[key]

    def __contains__(self, key) -> bool:
        return key in self.keys(include_nested=isinstance(key, tuple))

    def __len__(self) -> int:
        return len(self._specs)

    def __iter__(self) -> Iterator:
        return iter(self._specs)

    def keys(self, include_nested: bool = False, leaves_only: bool = False) -> list:
        """Entry names; with ``include_nested`` nested entries as tuples; with ``leaves_only``
        only the non-Composite entries."""
        out = []
        for key, spec in self._specs.items():
            if isinstance(spec, Composite) and include_nested:
                if not leaves_only:
                    out.append(key)
                out.extend((key, *(sub if isinstance(sub, tuple) else (sub,))) for sub in spec.keys(True, leaves_only))
            elif not (leaves_only and isinstance(spec, Composite)):
                out.append(key)
        return out

    def items(self, include_nested: bool = False, leaves_only: bool = False) -> list:
        return [(key, self[key]) for key in self.keys(include_nested, leaves_only)]

    def values(self, include_nested: bool = False, leaves_only: bool = False) -> list:
        return [self[key] for key in self.keys(include_nested, leaves_only)]

    @property
    def shape(self) -> torch.Size:
        return self._shape

    @shape.setter
    def shape(self, value) -> None:
        value = _size(value)
        for key, spec in getattr(self, "_specs", {}).items():
            if isinstance(spec, Composite) and spec.shape[: len(value)] != value:
                spec.shape = value
            elif spec is not None and spec.shape[: len(value)] != value:
                raise ValueError(
                    f"cannot give shape {tuple(value)} to a Composite whose {key!r} has {tuple(spec.shape)}"
                )
        self._shape = value

    # -------------------------------------------------------------- values

    def zero(self, shape=None):
        return self._build(shape, lambda spec, s: spec.zero(s))

    def rand(self, shape=None):
        return self._build(shape, lambda spec, s: spec.rand(s))

    def _build(self, shape, sample):
        shape = _size(shape or ())
        values = {}
        for key, spec in self._specs.items():
            if spec is None or (isinstance(spec, NonTensor) and spec.example_data is None):
                continue  # left unset: the data class's default (None)
            values[key] = sample(spec, shape)
        batch = (*shape, *self._data_shape())
        if self.data_cls is None:
            return TensorDict(values, batch_size=batch, device=self.device)
        return self.data_cls(**values, batch_size=batch, device=self.device)

    def _data_shape(self) -> torch.Size:
        """The (sampled) batch shape of a value: for a data class, every leading dim that all
        entries share, else the Composite's shape."""
        if self.data_cls is None or not self._specs:
            return self._safe_shape
        shapes = [spec.shape for spec in self._specs.values() if spec is not None]
        common = []
        for dims in zip(*shapes):
            if any(d != dims[0] for d in dims):
                break
            common.append(dims[0])
        return torch.Size(d if d >= 0 else 1 for d in common)

    def is_in(self, value) -> bool:
        if value is None:
            return True
        if self.data_cls is not None and not isinstance(value, self.data_cls):
            return False
        view = getattr(value, "_spec_view", None)  # a class may say how it is checked (History does)
        if callable(view):
            value = view()
        td = getattr(value, "_tensordict", value)
        if isinstance(td, LazyStackedTensorDict):
            element = self._drop_dim(td.stack_dim)
            return all(element.is_in(item) for item in value.unbind(td.stack_dim))
        for key, spec in self._specs.items():
            if spec is not None and not spec.is_in(td.get(key, None)):
                return False
        return True

    # -------------------------------------------------------------- copies

    def clone(self) -> Composite:
        specs = {key: spec.clone() if spec is not None else None for key, spec in self._specs.items()}
        return Composite(
            specs, shape=self.shape, device=self.device, data_cls=self.data_cls, step_mdp_static=self.step_mdp_static
        )

    def _with_shape(self, shape) -> Composite:
        out = self.clone()
        out.shape = shape
        return out

    def _drop_dim(self, dim: int) -> Composite:
        specs = {key: spec._drop_dim(dim) if spec is not None else None for key, spec in self._specs.items()}
        shape = self.shape[:dim] + self.shape[dim + 1 :] if dim < self.ndim else self.shape
        return Composite(
            specs, shape=shape, device=self.device, data_cls=self.data_cls, step_mdp_static=self.step_mdp_static
        )

    def to(self, dest) -> Composite:
        specs = {key: spec.to(dest) if spec is not None else None for key, spec in self._specs.items()}
        device = self.device if isinstance(dest, torch.dtype) or dest is None else dest
        return Composite(
            specs, shape=self.shape, device=device, data_cls=self.data_cls, step_mdp_static=self.step_mdp_static
        )

    def __eq__(self, other) -> bool:
        return (
            type(other) is Composite
            and self.shape == other.shape
            and self.device == other.device
            and self.data_cls is other.data_cls
            and self.step_mdp_static == other.step_mdp_static
            and self._specs == other._specs
        )

    def __repr__(self) -> str:
        entries = "".join(f"\n    {key}: {spec!r}," for key, spec in self._specs.items())
        cls = self.data_cls.__name__ if self.data_cls is not None else None
        return f"Composite({entries}\n    shape={self.shape}, device={self.device}, data_cls={cls})"
