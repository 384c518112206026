"""API keys: where they come from, what a key must look like, who holds which."""

import pytest

from rlpost.config import ConfigError
from rlpost.serve.access import ApiKeys

pytestmark = pytest.mark.unit


def test_keys_from_a_file_map_to_their_tenants(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("alice: tml-alice-12345678\nbob: [tml-bob-12345678, tml-bob-87654321]\n")
    keys = ApiKeys.load(str(path), environ={})
    assert keys.tenant("tml-alice-12345678") == "alice"
    assert keys.tenant("tml-bob-87654321") == "bob"
    assert keys.tenant("tml-alice-1234567") is None and keys.tenant("") is None and keys.tenant(None) is None
    assert keys.tenants == {"alice", "bob"}


def test_keys_from_the_environment():
    keys = ApiKeys.load(None, environ={"RLPOST_SERVE_API_KEYS": "alice=tml-alice-12345678, bob=tml-bob-12345678"})
    assert keys.tenant("tml-bob-12345678") == "bob"


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "no API keys"),
        ("alice=secret123456", "must start with 'tml-'"),
        ("alice=tml-short", "at least 8 more"),
        ("alice", "is not tenant=key"),
    ],
)
def test_bad_or_missing_keys_are_config_errors(text, message):
    with pytest.raises(ConfigError, match=message):
        ApiKeys.load(None, environ={"RLPOST_SERVE_API_KEYS": text})


def test_one_key_for_two_tenants_is_refused(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("alice: tml-shared-12345678\nbob: tml-shared-12345678\n")
    with pytest.raises(ConfigError, match="given to both 'alice' and 'bob'"):
        ApiKeys.load(str(path))
