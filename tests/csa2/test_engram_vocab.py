"""csa2.engram_vocab: the compressed Engram vocabulary (SPEC §10b), from a tokenizer and inside the model."""

import jax
import numpy as np
import pytest
from flax import nnx
from tokenizers import Tokenizer, models

from csa2 import engram_vocab, model
from csa2.checkpoints.hf import as_params
from csa2.presets import preset

# mini's schedule with a compressed vocabulary smaller than its 259 tokens: the model holds a table.
CFG = preset("mini").replace(engram_compressed_vocab_size=200, engram_pad_id=0)


def word_tokenizer(words):
    return Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[-1]))


def test_tokens_that_differ_by_case_accents_compatibility_form_or_spacing_share_an_id():
    words = ["Hello", "hello", " HELLO", "Ünïcode", "unicode", "\t\n", " ", "ﬁ", "fi", "A\ufffd", "a\ufffd", "<unk>"]
    table = engram_vocab.from_tokenizer(word_tokenizer(words))
    # New keys get ids in first-seen order; a text with U+FFFD (a partial byte) keeps its raw token as key.
    np.testing.assert_array_equal(table, [0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 5, 6])
    assert table.dtype == np.int32


def test_a_tokenizer_of_distinct_keys_gives_the_identity(tmp_path):
    tok = word_tokenizer(["a", "b", "c", "<unk>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    np.testing.assert_array_equal(engram_vocab.from_tokenizer(tmp_path / "tokenizer.json"), [0, 1, 2, 3])


def test_the_tokenizer_must_fit_the_config(mini):
    cfg = mini.replace(vocab_size=12, engram_compressed_vocab_size=7, engram_pad_id=0, dspark_noise_token_id=0)
    words = ["Hello", "hello", " HELLO", "Ünïcode", "unicode", "\t\n", " ", "ﬁ", "fi", "A\ufffd", "a\ufffd", "<unk>"]
    np.testing.assert_array_equal(engram_vocab.from_tokenizer(word_tokenizer(words), cfg)[:3], [0, 0, 0])
    with pytest.raises(ValueError,
                       match=r"7 distinct; the hash multipliers assume exactly engram_compressed_vocab_size=6"):
        engram_vocab.from_tokenizer(word_tokenizer(words), cfg.replace(engram_compressed_vocab_size=6))
    with pytest.raises(ValueError, match=r"tokenizer: 12 ids for vocab_size=13"):
        engram_vocab.from_tokenizer(word_tokenizer(words), cfg.replace(vocab_size=13))


def test_which_models_hold_a_table_and_the_default_one(mini, tiny, v41_flash):
    assert not engram_vocab.has_table(tiny) and not engram_vocab.has_table(mini)
    assert engram_vocab.has_table(v41_flash) and engram_vocab.has_table(CFG)
    table = engram_vocab.default_table(CFG)
    np.testing.assert_array_equal(table[:200], np.arange(200))
    assert set(table[200:].tolist()) == {CFG.engram_pad_id}
    assert engram_vocab.PARAM not in nnx.to_pure_dict(model.abstract_params(mini))
    assert type(model.abstract_params(CFG)[engram_vocab.PARAM]) is engram_vocab.CompressedVocab
    leaf = nnx.to_pure_dict(model.abstract_params(CFG))[engram_vocab.PARAM]
    assert leaf.dtype == np.int32 and leaf.shape == (259,)
    with pytest.raises(ValueError, match=r"ids span \[0, 258\]"):
        engram_vocab.check_table(CFG, np.arange(259))


def test_engram_hashes_compressed_ids_not_token_ids():
    """Two prompts that differ only in tokens sharing a compressed id (and an embedding) give the same logits;
    give one of them another compressed id and they differ."""
    pure = nnx.to_pure_dict(model.init_params(CFG, jax.random.PRNGKey(3)))
    pure = jax.tree.map(np.array, pure)
    pure["embed"][210] = pure["embed"][10]
    pure[engram_vocab.PARAM][210] = 10
    x = np.array([[5, 10, 10, 7, 10, 3, 10, 10, 9, 1, 10, 4]], np.int32)
    y = np.where(x == 10, 210, x)
    same = as_params(CFG, jax.tree.map(np.copy, pure))
    np.testing.assert_array_equal(model.forward(CFG, same, x)[0], model.forward(CFG, same, y)[0])
    pure[engram_vocab.PARAM][210] = 20
    other = as_params(CFG, pure)
    assert not np.array_equal(model.forward(CFG, other, x)[0], model.forward(CFG, other, y)[0])
