"""Who may call the service: API keys, each mapped to a tenant.

Keys come from ``api_keys_file`` (YAML: ``{tenant: key}`` or ``{tenant: [key, ...]}``) or from
``$RLPOST_SERVE_API_KEYS`` (``tenant=key,tenant=key``); there is no built-in key, and a service
without one does not start. The tinker SDK refuses to send a key that does not start with
``tml-``, so such a key is a configuration error here too. A request's ``X-API-Key`` is compared
with every key in constant time.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

import yaml

from rlpost.config import ConfigError

ENV_KEYS = "RLPOST_SERVE_API_KEYS"
KEY_PREFIX = "tml-"


class ApiKeys:
    """``key -> tenant``; see the module docstring."""

    def __init__(self, tenants_by_key: dict[str, str]):
        if not tenants_by_key:
            raise ConfigError(
                f"no API keys: set api_keys_file or ${ENV_KEYS} (tenant=key,...); there is no default key"
            )
        for key, tenant in tenants_by_key.items():
            if not key.startswith(KEY_PREFIX) or len(key) < len(KEY_PREFIX) + 8:
                raise ConfigError(
                    f"API key of tenant {tenant!r}: must start with {KEY_PREFIX!r} and have at least 8 more "
                    "characters (the tinker SDK sends no other keys)"
                )
        self._keys = [(key.encode(), tenant) for key, tenant in tenants_by_key.items()]

    @classmethod
    def load(cls, path: str | None, environ: dict[str, str] | None = None) -> ApiKeys:
        environ = os.environ if environ is None else environ
        if path is not None:
            return cls(_from_file(Path(path)))
        text = environ.get(ENV_KEYS, "")
        pairs: dict[str, str] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            tenant, sep, key = item.partition("=")
            if not sep or not tenant.strip() or not key.strip():
                raise ConfigError(f"${ENV_KEYS}: {item.split('=')[0]!r}... is not tenant=key")
            pairs[key.strip()] = tenant.strip()
        return cls(pairs)

    def tenant(self, key: str | None) -> str | None:
        """The tenant of ``key``, or None when it is no key of this service."""
        if not key:
            return None
        given = key.encode()
        found = None
        for known, tenant in self._keys:  # every key compared, in constant time each
            if hmac.compare_digest(known, given):
                found = tenant
        return found

    @property
    def tenants(self) -> set[str]:
        return {tenant for _, tenant in self._keys}


def _from_file(path: Path) -> dict[str, str]:
    if not path.is_file():
        raise ConfigError(f"api_keys_file: {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"api_keys_file: {path} is not YAML ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"api_keys_file: {path} must map each tenant to a key or a list of keys")
    pairs: dict[str, str] = {}
    for tenant, keys in data.items():
        for key in [keys] if isinstance(keys, str) else keys or []:
            if not isinstance(key, str):
                raise ConfigError(f"api_keys_file: tenant {tenant!r} has a key that is not a string")
            if key in pairs and pairs[key] != str(tenant):
                raise ConfigError(f"api_keys_file: one key is given to both {pairs[key]!r} and {tenant!r}")
            pairs[key] = str(tenant)
    return pairs
