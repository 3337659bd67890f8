"""Tests of train/data.py: corpus, packed batches, long-context tasks (tokenizer: tests/csa2/test_tokenizer.py)."""

import math
import re

import numpy as np
import pytest

from csa2 import tokenizer
from csa2.presets import BOS_ID, PAD_ID
from train import data


def test_training_data_reads_text_through_the_tokenizer():
    assert data.encode is tokenizer.encode  # one tokenizer, in csa2.tokenizer, for training and inference


# --- corpus


def test_corpus_sizes_deterministic_and_disjoint():
    from pydoc_data.topics import topics

    corpus = data.load_corpus()
    print(f"corpus: train {corpus.train.size} bytes, valid {corpus.valid.size} bytes")
    assert corpus.train.size > 100_000 and corpus.valid.size > 10_000
    again = data.load_corpus()
    assert np.array_equal(corpus.train, again.train) and np.array_equal(corpus.valid, again.valid)
    texts = list(dict.fromkeys(topics[k] for k in sorted(topics)))
    for split, want in ((corpus.train, [t for i, t in enumerate(texts) if i % 10]), (corpus.valid, texts[::10])):
        assert split.dtype == np.int32 and split[0] == BOS_ID and split.max() == BOS_ID  # no EOS / PAD
        assert _split_docs(split) == want
    assert not set(_split_docs(corpus.train)) & set(_split_docs(corpus.valid))


def _split_docs(stream):
    """The documents of a BOS-separated stream."""
    starts = list(np.flatnonzero(stream == BOS_ID)) + [stream.size]
    return [tokenizer.decode(stream[a + 1:b]) for a, b in zip(starts[:-1], starts[1:])]


# --- batches

_STREAM = (np.arange(5000) % 256).astype(np.int32)  # every window is an arithmetic run mod 256


def test_batches_shapes_shift_and_windows():
    inputs, targets = next(data.batches(_STREAM, 4, 32, seed=0))
    assert inputs.shape == targets.shape == (4, 32)
    assert inputs.dtype == targets.dtype == np.int32
    assert np.array_equal(inputs[:, 1:], targets[:, :-1])
    assert np.array_equal(targets, (inputs + 1) % 256)  # contiguous windows of the stream


def test_batches_deterministic_and_resumable():
    fresh = data.batches(_STREAM, 3, 16, seed=7)
    first = [next(fresh) for _ in range(6)]
    again = data.batches(_STREAM, 3, 16, seed=7)
    for (a, b), (c, d) in zip(first, (next(again) for _ in range(6))):
        assert np.array_equal(a, c) and np.array_equal(b, d)
    resumed = next(data.batches(_STREAM, 3, 16, seed=7, start_step=4))
    assert np.array_equal(resumed[0], first[4][0]) and np.array_equal(resumed[1], first[4][1])
    other = next(data.batches(_STREAM, 3, 16, seed=8))
    assert not np.array_equal(other[0], first[0][0])
    assert not np.array_equal(first[1][0], first[0][0])


def test_batches_window_can_reach_stream_end():
    stream = np.arange(9, dtype=np.int32)  # seq_len 8: the only window is the whole stream
    inputs, targets = next(data.batches(stream, 2, 8, seed=0))
    assert np.array_equal(inputs, np.tile(stream[:-1], (2, 1)))
    assert np.array_equal(targets, np.tile(stream[1:], (2, 1)))


@pytest.mark.parametrize("n, batch_size, seq_len", [(103, 2, 10), (41, 2, 10), (2, 3, 4)])
def test_eval_batches_cover_stream_once(n, batch_size, seq_len):
    stream = np.random.default_rng(n).integers(0, 256, n).astype(np.int32)
    out = list(data.eval_batches(stream, batch_size, seq_len))
    assert len(out) == math.ceil(math.ceil((n - 1) / seq_len) / batch_size)
    for inputs, targets, mask in out:
        assert inputs.shape == targets.shape == mask.shape == (batch_size, seq_len)
        assert inputs.dtype == targets.dtype == np.int32 and mask.dtype == np.float32
    inputs, targets, mask = (np.concatenate([b[i].ravel() for b in out]) for i in range(3))
    keep = mask == 1.0
    assert set(np.unique(mask)) <= {0.0, 1.0}
    assert keep.sum() == n - 1 and keep[: n - 1].all()  # mask is 1 exactly on the stream, in order
    assert np.array_equal(inputs[keep], stream[:-1]) and np.array_equal(targets[keep], stream[1:])
    assert (inputs[~keep] == PAD_ID).all() and (targets[~keep] == PAD_ID).all()


def test_eval_batches_of_valid_corpus():
    valid = data.load_corpus().valid
    n = sum(int(m.sum()) for _, _, m in data.eval_batches(valid, 8, 128))
    assert n == valid.size - 1


# --- long-context tasks


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_passkey_example(depth):
    length = 2000
    prompt, answer = data.passkey_example(np.random.default_rng(3), length, depth)
    assert prompt.shape == (length,) and prompt.dtype == np.int32 and prompt[0] == BOS_ID
    key = tokenizer.decode(answer)
    assert re.fullmatch(r"[1-9]\d{4}", key)
    text = tokenizer.decode(prompt)
    needle = f"The pass key is {key}. Remember it."
    assert text.count(needle) == 1
    assert text.endswith("What is the pass key? The pass key is ")
    assert abs((1 + text.index(needle)) / length - depth) < 0.05
    again, _ = data.passkey_example(np.random.default_rng(3), length, depth)
    assert np.array_equal(prompt, again)


def test_passkey_digits_and_minimal_length():
    minimal = 1 + len("The pass key is 123. Remember it. ") + len("What is the pass key? The pass key is ")
    prompt, answer = data.passkey_example(np.random.default_rng(0), minimal, 0.5, digits=3)
    assert prompt.size == minimal and len(tokenizer.decode(answer)) == 3  # no filler at all, still exact
    with pytest.raises(ValueError, match=f"length={minimal - 1}.*at least {minimal}"):
        data.passkey_example(np.random.default_rng(0), minimal - 1, 0.5, digits=3)


@pytest.mark.parametrize("seed", range(6))
def test_multi_needle_example(seed):
    length, depths = 1500, [0.8, 0.1, 0.5]
    prompt, answer = data.multi_needle_example(np.random.default_rng(seed), length, 3, depths)
    assert prompt.shape == (length,) and prompt[0] == BOS_ID
    text = tokenizer.decode(prompt)
    found = re.findall(r"The key for (\w+) is (\d{4})\.", text)
    assert len(found) == 3 and len({name for name, _ in found}) == 3
    for (name, _), depth in zip(found, sorted(depths)):  # needles appear in depth order
        assert abs(text.index(f"The key for {name} is") / length - depth) < 0.1
    queried = re.search(r"What is the key for (\w+)\? The key for \1 is $", text).group(1)
    assert dict(found)[queried] == tokenizer.decode(answer)


@pytest.mark.parametrize("keys, values, queries", [(1, 1, 1), (4, 1, 1), (1, 3, 1), (4, 1, 2), (5, 2, 3)])
def test_ruler_example_asks_for_every_value_of_the_asked_names(keys, values, queries):
    """Read back from the text alone: the needles, the question's names, and the answer they imply."""
    length, depth = 1200, 0.3
    for seed in range(4):
        prompt, answer, mask = data.ruler_example(np.random.default_rng(seed), length, depth, keys=keys,
                                                  values=values, queries=queries)
        assert prompt.shape == (length,) and prompt[0] == BOS_ID
        text = tokenizer.decode(prompt)
        found = re.findall(r"The key for (\w+) is (\d{4})\. ", text)
        assert len(found) == keys * values and len({n for n, _ in found}) == keys
        if queries == values == 1:
            asked = [re.search(r"What is the key for (\w+)\? The key for \1 is $", text).group(1)]
        else:
            who = re.search(r"What are the keys for (.+)\? The keys for \1 are $", text).group(1)
            asked = who.split(" and ")
        assert len(asked) == queries and set(asked) <= {n for n, _ in found}
        expected = ", ".join(v for name in asked for n, v in found if n == name)  # question order, then text order
        assert tokenizer.decode(answer) == expected
        assert np.array_equal(mask, [c.isdigit() for c in expected])
        spans = [m.start() for m in re.finditer(r"The key for (\w+) is \d", text) if m.group(1) in asked]
        assert all(abs(at / length - depth) < 0.1 for at in spans)  # the asked needles sit at the depth
        needles = "".join(f"The key for {name} is {v}. " for name in asked for n, v in found if n == name)
        assert needles in text  # together, in the answer's order


def test_held_out_wording_shares_no_phrase_with_training():
    """Prompts in the held-out template hold the same tasks (the key, its depth, the answer) in wording that no
    training row holds: none of the training template's sentences or phrasings appears."""
    train = data.TEMPLATES["train"]
    phrases = [p for p in train.filler.split(". ") if p.strip()] + ["pass key", "The key for", "What is", "What are"]
    rng = np.random.default_rng(5)
    prompt, answer = data.passkey_example(rng, 800, 0.4, template="held_out")
    text, key = tokenizer.decode(prompt), tokenizer.decode(answer)
    assert prompt.shape == (800,) and f"Keep this secret number in mind: {key}. " in text
    assert text.endswith("Which secret number was given? The secret number is ")
    assert abs(text.index(key) / 800 - 0.4) < 0.05
    prompt, answer, mask = data.ruler_example(rng, 800, 0.6, keys=4, values=2, queries=2, template="held_out")
    text = tokenizer.decode(prompt)
    found = re.findall(r"(\w+) holds the number (\d{4})\. ", text)
    who = re.search(r"Which numbers do (.+) hold\? \1 hold $", text).group(1).split(" and ")
    assert len(found) == 8 and tokenizer.decode(answer) == ", ".join(v for w in who for n, v in found if n == w)
    ruler_text = tokenizer.decode(prompt)
    prompt, answer = data.multi_needle_example(rng, 800, 3, [0.2, 0.5, 0.8], template="held_out")
    needles_text = tokenizer.decode(prompt)
    found = re.findall(r"(\w+) holds the number (\d{4})\. ", needles_text)
    asked = re.search(r"Which number does (\w+) hold\? \1 holds $", needles_text).group(1)
    assert len(found) == 3 and dict(found)[asked] == tokenizer.decode(answer)
    for text in (ruler_text, needles_text, tokenizer.decode(data.passkey_example(rng, 800, 0.1,
                                                                                   template="held_out")[0])):
        assert not [p for p in phrases if p in text]


# --- bad arguments


@pytest.mark.parametrize("call, field", [
    (lambda: data.passkey_example(np.random.default_rng(0), 20, 0.5), "length=20"),
    (lambda: data.passkey_example(np.random.default_rng(0), 500, 1.5), "depth=1.5"),
    (lambda: data.passkey_example(np.random.default_rng(0), 500, float("nan")), "depth=nan"),
    (lambda: data.passkey_example(0, 500, 0.5), "rng="),
    (lambda: data.passkey_example(np.random.default_rng(0), 500, 0.5, digits=0), "digits=0"),
    (lambda: data.multi_needle_example(np.random.default_rng(0), 500, 2, [0.5]), "depths="),
    (lambda: data.multi_needle_example(np.random.default_rng(0), 500, 2, [0.5, -0.1]), r"depths\[1\]=-0.1"),
    (lambda: data.multi_needle_example(np.random.default_rng(0), 500, 0, []), "n_keys=0"),
    (lambda: data.multi_needle_example(np.random.default_rng(0), 500, 27, [0.5] * 27), "n_keys=27"),
    (lambda: data.multi_needle_example(np.random.default_rng(0), 60, 2, [0.2, 0.8]), "length=60"),
    (lambda: data.ruler_example(np.random.default_rng(0), 500, 0.5, keys=2, queries=3), "queries=3"),
    (lambda: data.ruler_example(np.random.default_rng(0), 500, 0.5, keys=27), "keys=27"),
    (lambda: data.ruler_example(np.random.default_rng(0), 500, 0.5, values=0), "values=0"),
    (lambda: data.ruler_example(np.random.default_rng(0), 500, 1.2), "depth=1.2"),
    (lambda: data.ruler_example(np.random.default_rng(0), 500, 0.5, template="test"), "template='test'"),
    (lambda: data.passkey_example(np.random.default_rng(0), 500, 0.5, template=None), "template=None"),
    (lambda: data.ruler_example(np.random.default_rng(0), 80, 0.5, keys=3), "length=80"),
    (lambda: next(data.batches(_STREAM[:10], 2, 10, seed=0)), "tokens="),
    (lambda: next(data.batches(_STREAM, 0, 10, seed=0)), "batch_size=0"),
    (lambda: next(data.batches(_STREAM, 2, 10, seed=-1)), "seed=-1"),
    (lambda: next(data.batches(_STREAM, 2, 10, seed=0, start_step=-1)), "start_step=-1"),
    (lambda: next(data.batches(_STREAM + 300, 2, 10, seed=0)), "tokens=300"),
    (lambda: next(data.eval_batches(_STREAM.reshape(50, 100), 2, 10)), "tokens="),
    (lambda: next(data.eval_batches(_STREAM, 2, 0)), "seq_len=0"),
])
def test_bad_arguments_raise(call, field):
    with pytest.raises(ValueError, match=field):
        call()
