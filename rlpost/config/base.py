"""The base of every config section, and the error a user's config mistake raises."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A user mistake in a config file or override; the message names the key or file."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
