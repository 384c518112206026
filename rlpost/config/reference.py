"""The job config's reference (docs/config.md), generated from the pydantic models' descriptions.

    python -m rlpost.config.reference            rewrite docs/config.md
    python -m rlpost.config.reference --check    exit 1 when docs/config.md is out of date

Every key of :class:`rlpost.config.JobConfig` is listed under its section with its type, its
default and its field description, then every key of :class:`rlpost.config.ServeConfig`, so
the reference cannot drift from the code (a unit test
compares the file with :func:`render`).
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from rlpost.config import JobConfig, ServeConfig, section_type

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "config.md"

HEADER = """# Job config reference

Generated from `rlpost/config/` by `python -m rlpost.config.reference`; do not edit by hand.
A job is one YAML file with these sections; every key can also be set on the command line as a
dotted override (`rlpost train CONFIG trainer.steps=100 "logging.trackers=[tensorboard]"`).
Unknown keys are errors that name the key.
"""


SERVE_HEADER = """# `rlpost serve` config reference

`rlpost serve [CONFIG] [key=value ...]` reads its own config (`rlpost.config.ServeConfig`;
configs/serve-tiny-cpu.yaml), with the same YAML and dotted overrides (docs/service.md).
"""


def render() -> str:
    """The whole reference as Markdown."""
    parts = [HEADER]
    for name, field in JobConfig.model_fields.items():
        section = _section_class(field)
        parts.append(f"## `{name}`\n\n{_doc(section)}\n")
        parts.append(_table(section, prefix=name))
    parts.append(SERVE_HEADER)
    parts.append(_table(ServeConfig, prefix=""))
    return "\n".join(parts)


def _table(model: type[BaseModel], prefix: str) -> str:
    """One table row per leaf key of ``model``; nested sections follow as their own tables."""
    rows = ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    nested = []
    for name, field in model.model_fields.items():
        key = f"{prefix}.{name}" if prefix else name
        section = _section_class(field)
        if section is not None:
            if section is not field.annotation:  # an optional section: null turns it off
                rows.append(
                    f"| `{key}` | `{section.__name__} \\| None` | {_default(field)} | {_cell(field.description or '')} |"
                )
            nested.append(f"### `{key}`\n\n{_doc(section)}\n\n{_table(section, key)}")
            continue
        rows.append(f"| `{key}` | {_type(field)} | {_default(field)} | {_cell(field.description or '')} |")
    return "\n".join([*rows, "", *nested])


def _section_class(field: FieldInfo) -> type[BaseModel] | None:
    return section_type(field.annotation)


def _doc(model: type[BaseModel]) -> str:
    return " ".join((model.__doc__ or "").split())


def _type(field: FieldInfo) -> str:
    text = _type_name(field.annotation)
    return f"`{text}`"


def _type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join(_type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        value = value.model_dump()
    return f"`{value!r}`".replace("|", "\\|")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write (or --check) docs/config.md from rlpost/config/.")
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/config.md is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = DOC_PATH.read_text() if DOC_PATH.is_file() else ""
        if current != text:
            print(f"{DOC_PATH} is out of date: run python -m rlpost.config.reference", file=sys.stderr)
            return 1
        return 0
    DOC_PATH.parent.mkdir(parents=True, exist_ok=True)
    DOC_PATH.write_text(text)
    print(f"wrote {DOC_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
