"""Self-distillation data (train.distill, SPEC §12): pool rows are a corpus prompt and the target's own
continuation of it, seeded; pool batches are a pure function of (seed, step); bad input is refused by name."""

import numpy as np
import pytest

from infer.generate import Sampling, generate
from train.data import load_corpus
from train.distill import continuations, pool_batches

PROMPT, SEQ = 8, 14


@pytest.fixture(scope="module")
def corpus():
    return load_corpus().train[:4096]


def _is_window(stream: np.ndarray, row: np.ndarray) -> bool:
    windows = np.lib.stride_tricks.sliding_window_view(stream, row.size)
    return bool((windows == row).all(axis=1).any())


def test_rows_are_a_corpus_prompt_and_the_targets_continuation(mini, mini_params, corpus):
    pool = continuations(mini, mini_params, corpus, rows=3, prompt_len=PROMPT, seq_len=SEQ, temperature=0.0, seed=5,
                         batch=2)
    assert pool.shape == (3, SEQ) and pool.dtype == np.int32
    assert all(_is_window(corpus, row[:PROMPT]) for row in pool)
    # The first call's two rows, continued by the target through the same program (batch 2, greedy).
    again = generate(mini, mini_params, pool[:2, :PROMPT], max_new_tokens=SEQ - PROMPT, eos_id=None)
    np.testing.assert_array_equal(pool[:2, PROMPT:], again.tokens)
    # The last row sits in a padded call (3 = 2 + 1 + one padding row): it is the target's greedy continuation too.
    last = generate(mini, mini_params, np.repeat(pool[2:, :PROMPT], 2, axis=0), max_new_tokens=SEQ - PROMPT,
                    eos_id=None)
    np.testing.assert_array_equal(pool[2, PROMPT:], last.tokens[0])

    np.testing.assert_array_equal(pool, continuations(mini, mini_params, corpus, rows=3, prompt_len=PROMPT,
                                                      seq_len=SEQ, temperature=0.0, seed=5, batch=2))
    other = continuations(mini, mini_params, corpus, rows=3, prompt_len=PROMPT, seq_len=SEQ, temperature=0.0, seed=6,
                          batch=2)
    assert not np.array_equal(pool[:, :PROMPT], other[:, :PROMPT])  # the seed picks the prompts


def test_sampled_rows_follow_the_temperature(mini, mini_params, corpus):
    kw = dict(rows=2, prompt_len=PROMPT, seq_len=SEQ, seed=5, batch=2)
    greedy = continuations(mini, mini_params, corpus, temperature=0.0, **kw)
    sampled = continuations(mini, mini_params, corpus, temperature=1.0, **kw)
    np.testing.assert_array_equal(greedy[:, :PROMPT], sampled[:, :PROMPT])  # same prompts
    assert not np.array_equal(greedy[:, PROMPT:], sampled[:, PROMPT:])
    want = generate(mini, mini_params, greedy[:, :PROMPT], max_new_tokens=SEQ - PROMPT, eos_id=None,
                    sampling=Sampling(temperature=1.0), seed=5 * 100_003)
    np.testing.assert_array_equal(sampled[:, PROMPT:], want.tokens)


def test_pool_batches_are_a_function_of_seed_and_step():
    pool = np.arange(40, dtype=np.int32).reshape(10, 4)
    straight = pool_batches(pool, 3, seed=1)
    first = [next(straight) for _ in range(5)]
    resumed = pool_batches(pool, 3, seed=1, start_step=3)
    for want in first[3:]:
        np.testing.assert_array_equal(next(resumed), want)
    assert all(b.shape == (3, 4) and set(b[:, 0] // 4) <= set(range(10)) for b in first)
    assert all((b[:, 1:] - b[:, :1] == np.arange(1, 4)).all() for b in first)  # whole pool rows
    assert not np.array_equal(next(pool_batches(pool, 3, seed=2)), first[0])


def test_bad_inputs_are_refused(mini, mini_params, corpus):
    kw = dict(rows=2, prompt_len=PROMPT, seq_len=SEQ, temperature=0.0, seed=0)
    for field, value, match in (("seq_len", PROMPT, "seq_len=8"), ("rows", 0, "rows=0"),
                                ("prompt_len", 0, "prompt_len=0"), ("temperature", -1.0, "temperature=-1.0")):
        with pytest.raises(ValueError, match=match):
            continuations(mini, mini_params, corpus, **{**kw, field: value})
    with pytest.raises(ValueError, match="corpus: 5 tokens"):
        continuations(mini, mini_params, corpus[:5], **kw)
    with pytest.raises(ValueError, match="pool: shape"):
        next(pool_batches(np.zeros((4,), np.int32), 2, seed=0))
    with pytest.raises(ValueError, match="batch_size=0"):
        next(pool_batches(np.zeros((4, 4), np.int32), 0, seed=0))
