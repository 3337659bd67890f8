"""Tests of csa2/tokenizer.py: the byte tokenizer of the tiny presets (training data and inference use it)."""

import numpy as np
import pytest

from csa2 import tokenizer
from csa2.presets import BOS_ID, EOS_ID, PAD_ID


@pytest.mark.parametrize("text", ["", "hello, world", "héllo wörld — 日本語 🎉\n\ttabs"])
def test_round_trip(text):
    ids = tokenizer.encode(text, bos=True, eos=True)
    assert ids.dtype == np.int32
    assert ids[0] == BOS_ID and ids[-1] == EOS_ID
    assert list(ids[1:-1]) == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(tokenizer.encode(text, bos=False)) == text
    assert np.array_equal(tokenizer.encode_bytes(text.encode("utf-8")), tokenizer.encode(text))


def test_decode_skips_specials_and_stops_at_eos():
    ids = [BOS_ID, ord("h"), PAD_ID, ord("i"), BOS_ID, EOS_ID, ord("x")]
    assert tokenizer.decode(ids) == "hi"
    assert tokenizer.decode(np.array([ord("a"), 0xFF, ord("b")])) == "a\ufffdb"


def test_invalid_utf8_raises():
    assert tokenizer.validate_utf8("é ok".encode()) == "é ok"
    with pytest.raises(ValueError, match=r"prompt=.*offset 1.*UTF-8"):
        tokenizer.validate_utf8(b"a\xff")
    with pytest.raises(ValueError, match="text"):
        tokenizer.encode("bad \udcff surrogate")
    with pytest.raises(ValueError, match="encode_bytes"):
        tokenizer.encode(b"bytes")
    with pytest.raises(ValueError, match="ids=259"):
        tokenizer.decode([1, 259])

