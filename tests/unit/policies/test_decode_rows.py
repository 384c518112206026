"""The wrapper's batch decoding: the Rust tokenizer in one call, the same strings as batch_decode."""

import random

import pytest

from rlpost.policies.base import decode_rows

pytestmark = pytest.mark.unit


def _rows(tokenizer, n=64):
    rng = random.Random(0)
    ids = list(range(len(tokenizer)))
    return [[rng.choice(ids) for _ in range(rng.randint(0, 40))] for _ in range(n)] + [[tokenizer.eos_token_id]]


def test_decode_rows_returns_what_batch_decode_returns(tiny_tokenizer):
    rows = _rows(tiny_tokenizer)
    assert decode_rows(tiny_tokenizer, rows) == tiny_tokenizer.batch_decode(rows, skip_special_tokens=False)


def test_a_tokenizer_that_decodes_its_own_way_keeps_its_decoding(tiny_tokenizer):
    class Shouting(type(tiny_tokenizer)):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    shouting = Shouting.from_pretrained(tiny_tokenizer.name_or_path)
    rows = _rows(tiny_tokenizer, 8)
    assert decode_rows(shouting, rows) == [t.upper() for t in tiny_tokenizer.batch_decode(rows)]
    shouting.clean_up_tokenization_spaces = True  # clean-up is transformers' own step: kept too
    assert decode_rows(shouting, rows) == shouting.batch_decode(rows, skip_special_tokens=False)
