"""TorchRL's LLM API at TorchRL's module paths: port a script by replacing ``torchrl`` with
``rlpost.torchrl`` in its imports.

``from torchrl.envs.llm import ChatEnv`` becomes ``from rlpost.torchrl.envs.llm import ChatEnv``,
and ``rlpost.torchrl.envs.llm.ChatEnv is rlpost.envs.ChatEnv``: every name is rlpost's own object,
never a copy. The modules under this package are made on import from one table,
:data:`rlpost.torchrl.tree.TREE` (TorchRL module path -> its names -> where each lives in rlpost),
by the finder below; their names are imported on first access, so importing a module loads
nothing it does not use (no vLLM, no Ray). A TorchRL name rlpost lacks imports as a
:class:`~rlpost.torchrl.tree.NotInRlpost`, which raises NotImplementedError when used, saying why
and what to use instead.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types

from rlpost.torchrl.tree import TREE, NotInRlpost

__all__ = sorted(TREE[""])

_PREFIX = __name__ + "."
# every TorchRL module path of the table and the packages above them (``modules`` above
# ``modules.llm``): the modules this package makes
PATHS = {".".join(path.split(".")[:depth]) for path in TREE if path for depth in range(1, path.count(".") + 2)}


def resolve(path: str, name: str):
    """The object TorchRL's ``torchrl.<path>.<name>`` is in rlpost (``path`` "" for ``torchrl``):
    rlpost's own object, a NotInRlpost, or the submodule ``<path>.<name>``. AttributeError for a
    name the table does not have."""
    target = TREE.get(path, {}).get(name)
    if isinstance(target, NotInRlpost):
        return target
    if isinstance(target, str):
        module, attribute = target.split(":")
        return getattr(importlib.import_module(module), attribute)
    child = f"{path}.{name}" if path else name
    if child in PATHS:
        return importlib.import_module(_PREFIX + child)
    shown = f"torchrl.{path}" if path else "torchrl"
    raise AttributeError(
        f"rlpost.torchrl has no {name!r} in {shown} (TorchRL's names are listed in rlpost/torchrl/tree.py)"
    )


def _module_getattr(path: str):
    def __getattr__(name: str):
        value = resolve(path, name)
        setattr(sys.modules[_PREFIX + path if path else __name__], name, value)  # looked up once
        return value

    return __getattr__


class _TreeFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes ``rlpost.torchrl.<path>`` for each of PATHS: a package whose attributes are
    resolved from the table on first access."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(_PREFIX) and fullname[len(_PREFIX) :] in PATHS:
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module: types.ModuleType) -> None:
        path = module.__name__[len(_PREFIX) :]
        module.__doc__ = f"TorchRL's torchrl.{path}, as rlpost's objects (rlpost.torchrl.tree.TREE[{path!r}])."
        module.__all__ = sorted(TREE.get(path, {}))
        module.__getattr__ = _module_getattr(path)
        module.__dir__ = lambda: sorted(set(module.__all__) | set(vars(module)))


if not any(isinstance(finder, _TreeFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _TreeFinder())

__getattr__ = _module_getattr("")
