"""The tiny models shipped in models/ (models/README.md): the bytes recorded in SHA256SUMS, built
from the specs the code holds now, so every machine runs the same models."""

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

import pytest

from rlpost.tiny.spec import TOOL_SPEC, TinyModelSpec, built_spec, spec_dict

pytestmark = pytest.mark.unit

MODELS = Path(__file__).resolve().parents[3] / "models"
FOLDERS = ("tiny-model", "tiny-model-tools", "tiny-reward-model")


def recorded_digests() -> dict[str, str]:
    """``SHA256SUMS`` as {relative path: hex digest} (the format ``sha256sum`` writes)."""
    digests = {}
    for line in (MODELS / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        digests[name] = digest
    return digests


def test_every_shipped_file_has_its_recorded_digest():
    shipped = {
        f"{folder}/{p.name}": hashlib.sha256(p.read_bytes()).hexdigest()
        for folder in FOLDERS
        for p in sorted((MODELS / folder).iterdir())
    }
    recorded = recorded_digests()
    assert sorted(shipped) == sorted(recorded), "a file is missing from models/ or from SHA256SUMS"
    changed = [name for name, digest in shipped.items() if recorded[name] != digest]
    assert not changed, f"{changed} differ from models/SHA256SUMS: rebuilt without recording (models/README.md)"


def test_the_shipped_models_are_built_from_the_current_specs():
    assert built_spec(MODELS / "tiny-model") == spec_dict(TinyModelSpec())
    assert built_spec(MODELS / "tiny-model-tools") == spec_dict(TOOL_SPEC)
    from rlpost.tiny.reward_model import META_FILE, TinyRewardModelSpec

    reward_meta = json.loads((MODELS / "tiny-reward-model" / META_FILE).read_text())
    assert reward_meta["spec"] == asdict(TinyRewardModelSpec())
    assert reward_meta["lm"] == spec_dict(TinyModelSpec())  # built from the shipped tiny LM


@pytest.mark.parametrize("folder", FOLDERS)
def test_the_make_targets_find_each_folder_up_to_date(folder):
    """`make test` asks for the three targets; each must leave the shipped folder alone."""
    from rlpost.tiny.model import ensure_tiny_model
    from rlpost.tiny.reward_model import ensure_tiny_reward_model

    def refuse(message):
        raise AssertionError(f"would rebuild: {message}")

    if folder == "tiny-reward-model":
        assert ensure_tiny_reward_model(MODELS / folder, MODELS / "tiny-model", log=refuse) is False
    else:
        assert (
            ensure_tiny_model(MODELS / folder, TOOL_SPEC if folder.endswith("tools") else TinyModelSpec(), refuse)
            is False
        )
