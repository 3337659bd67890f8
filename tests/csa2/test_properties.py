"""State transitions as properties over random inputs (hypothesis, DESIGN §8): chunk invariance of exact prefill
and of bounded replay (SPEC §11) under any chunking with rows out of step, and commit ≡ prefill of the accepted
rows for any per-row accept lengths, the DSpark context windows included (compared through the drafts they give).

Shapes stay fixed (chunks are padded to S columns, rows differ by `n_valid`), so each property compiles its
entry points once and the examples only change values.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from csa2 import model
from csa2.presets import preset
from csa2.replay import EXACT, Extend, ReplayPolicy
from csa2.state import init_state
from tests.csa2.helpers import keep

MINI = preset("mini")
B, CAP, S, N = 2, 64, 8, 21  # prompt of N tokens per row, fed in chunks of S columns
GAMMA = MINI.max_draft
SETTINGS = settings(max_examples=8, deadline=None, derandomize=True)
pytestmark = pytest.mark.cross_shape  # every property here compares programs of different chunk shapes


def _continue(params, state, steps):
    """Greedy logits of `steps` decode steps [B, steps, V] from `state` (consumed)."""
    out, tok = [], jnp.full((B,), 7, jnp.int32)
    for _ in range(steps):
        logits, state = model.decode_step(MINI, params, state, tok)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        out.append(logits)
    return jnp.stack(out, 1)


def _drafts(params, state):
    """The DSpark proposal after anchor 7 from `state` (SPEC §12): its logits [B, γ, V] and confidences [B, γ]
    read every committed entry of the drafter's context windows."""
    prop = model.draft(MINI, params, state, jnp.full((B,), 7, jnp.int32), jax.random.PRNGKey(0))
    return np.asarray(prop.logits), np.asarray(prop.confidence)


def _committed_entries(state):
    """Every committed Global KV entry (float storage), per stack: [B, G, N, D] masked beyond length // ratio."""
    out = []
    for gkv, ratio in zip(state.global_kv, (2, 1)):  # mini: one ratio-2 stack, one ratio-1 stack
        entries = np.asarray(gkv.kv.payload)
        valid = np.arange(entries.shape[2])[None, :] < (np.asarray(state.length) // ratio)[:, None]
        out.append(np.where(valid[:, None, :, None], entries, 0.0))
    return out


@st.composite
def chunkings(draw):
    """Per row, N tokens cut at random points (repeats give empty chunks), pieces longer than S split: rows get
    different chunkings, so they are out of step."""
    rows = []
    for _ in range(B):
        bounds = [0, *sorted(draw(st.lists(st.integers(0, N), max_size=6))), N]
        sizes = []
        for a, b in zip(bounds, bounds[1:]):
            sizes += [S] * ((b - a) // S) + ([(b - a) % S] if (b - a) % S or a == b else [])
        rows.append(sizes)
    calls = max(len(r) for r in rows)
    return np.array([r + [0] * (calls - len(r)) for r in rows], np.int32)  # [B, calls]


def _chunked_prefill(params, prompt, chunks, replay, extend=None):
    """`prompt [B, N]` fed in the chunks `[B, calls]` of S columns: the state and each row's last logits of a
    call that gave it tokens."""
    state, done = init_state(MINI, B, CAP, "float"), np.zeros(B, np.int32)
    last = None
    for call in range(chunks.shape[1]):
        n_valid = chunks[:, call]
        cols = np.zeros((B, S), np.int32)
        for b in range(B):
            cols[b, :n_valid[b]] = prompt[b, done[b]:done[b] + n_valid[b]]
        logits, state, _ = model.prefill(MINI, params, state, jnp.asarray(cols), jnp.asarray(n_valid),
                                         replay=replay, extend=extend)
        last = np.asarray(logits) if last is None else np.where((n_valid > 0)[:, None], np.asarray(logits), last)
        done += n_valid
    return last, state


def _assert_same_up_to_requantization(params, a, b, logits_a, logits_b):
    """Same length, floor, committed Global KV, last logits, drafts and greedy continuation, for states built with
    different chunk shapes: their float sums differ in the last ulp, and re-rounded to FP4 that can flip a rare
    Global KV element by one step (seen: 2 of 4096, moving the logits by ~1e-3). A wrong decoder tail or floor
    moves the logits by ~1e-1 (per-chunk tails: 0.12)."""
    np.testing.assert_array_equal(a.length, b.length)
    np.testing.assert_array_equal(a.floor, b.floor)
    for x, y in zip(_committed_entries(a), _committed_entries(b)):
        assert np.mean(np.abs(x - y) > 1e-5) <= 2e-3
    np.testing.assert_allclose(logits_a, logits_b, rtol=0, atol=1e-2)
    for x, y in zip(_drafts(params, a), _drafts(params, b)):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-2)
    np.testing.assert_allclose(_continue(params, keep(a), 3), _continue(params, keep(b), 3), rtol=0, atol=1e-2)


def _assert_identical(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


@SETTINGS
@given(chunks=chunkings(), seed=st.integers(0, 2**16))
def test_exact_prefill_is_chunk_invariant(mini_params, chunks, seed):
    """Any chunking of an exact prefill (rows out of step, empty chunks included) gives the same committed Global
    KV, last logits and continuation as one call."""
    prompt = np.asarray(jax.random.randint(jax.random.PRNGKey(seed), (B, N), 0, 256, jnp.int32))
    one_logits, one, _ = model.prefill(MINI, mini_params, init_state(MINI, B, CAP, "float"), jnp.asarray(prompt),
                                       replay=EXACT)
    last, state = _chunked_prefill(mini_params, prompt, chunks, EXACT)
    _assert_same_up_to_requantization(mini_params, state, one, last, one_logits)  # chunk shapes differ from one call


@SETTINGS
@given(chunks=chunkings(), policy=st.sampled_from([(3, None), (11, None), (11, 5), (N, None)]),
       seed=st.integers(0, 2**16))
def test_replayed_prefill_is_chunk_invariant(mini_params, chunks, policy, seed):
    """Bounded replay of a prompt fed in any chunking (its `Extend.cold(N)`) ≡ one call: the decoder tail is
    `[N − T, N)` of the whole prompt, whichever chunks hold it (R = 3 and 11: inside one chunk and across
    chunks of S = 8; split 5 cuts before a non-compressing layer). With R ≥ N the chunked prefill is bit for
    bit the exact one under the same chunking."""
    window, split = policy  # (R, split layer); each policy compiles its own prefill
    replay = ReplayPolicy(window=window, split_layer=split)
    prompt = np.asarray(jax.random.randint(jax.random.PRNGKey(seed), (B, N), 0, 256, jnp.int32))
    one_logits, one, _ = model.prefill(MINI, mini_params, init_state(MINI, B, CAP, "float"), jnp.asarray(prompt),
                                       replay=replay)
    np.testing.assert_array_equal(one.floor, max(N - window, 0))
    extend = Extend.cold(jnp.full((B,), N, jnp.int32))
    last, state = _chunked_prefill(mini_params, prompt, chunks, replay, extend)
    _assert_same_up_to_requantization(mini_params, state, one, last, one_logits)
    if window >= N:
        exact_last, exact = _chunked_prefill(mini_params, prompt, chunks, EXACT)
        np.testing.assert_array_equal(last, exact_last)
        _assert_identical(state, exact)


def _commit_and_prefill(params, accept, prompt_lens, seed):
    """After a prefill of `prompt_lens` tokens per row: commit(verify(state, [R, d1..dγ]), accept) and an exact
    prefill of the `accept` rows R, d1..dn on the same state; with the block and the bonus tokens."""
    key1, key2 = jax.random.split(jax.random.PRNGKey(seed))
    prompt = jax.random.randint(key1, (B, N), 0, 256, jnp.int32)
    block = jax.random.randint(key2, (B, GAMMA + 1), 0, 256, jnp.int32)
    accept = jnp.asarray(accept, jnp.int32)
    _, state, _ = model.prefill(MINI, params, init_state(MINI, B, CAP, "float"), prompt,
                                jnp.asarray(prompt_lens, jnp.int32), replay=EXACT)
    _, spec = model.verify(MINI, params, keep(state), block)
    bonus = jax.random.randint(key2, (B,), 0, 256, jnp.int32)
    committed = model.commit(spec, accept, bonus)
    _, reference, _ = model.prefill(MINI, params, state, block, accept, replay=EXACT)
    return committed, reference, block, bonus


@SETTINGS
@given(accept=st.lists(st.integers(1, GAMMA + 1), min_size=B, max_size=B),
       prompt_lens=st.lists(st.integers(9, N), min_size=B, max_size=B), seed=st.integers(0, 2**16))
def test_commit_equals_prefill_of_accepted_rows(mini_params, accept, prompt_lens, seed):
    """commit(verify(state, [R, d1..dγ]), n+1) per row ≡ an exact prefill of R, d1..dn on the same state: the same
    length, committed Global KV, drafts and continuation, whatever the per-row accept lengths and prompt lengths
    (both parities of L, so ratio-2 pairs straddle the accept boundary)."""
    committed, reference, block, bonus = _commit_and_prefill(mini_params, accept, prompt_lens, seed)
    for row, a in enumerate(accept):  # emitted: d1 … dn, C
        want = np.append(np.asarray(block[row, 1:a]), np.asarray(bonus[row]))[:a]
        np.testing.assert_array_equal(committed.accept.tokens[row, :a], want)
    np.testing.assert_array_equal(committed.length, reference.length)
    for a, b in zip(_committed_entries(committed), _committed_entries(reference)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(_drafts(mini_params, committed), _drafts(mini_params, reference)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(_continue(mini_params, committed, 3), _continue(mini_params, reference, 3),
                               rtol=1e-4, atol=1e-4)


def test_mutant_commit_of_one_row_too_many_is_caught(mini_params, monkeypatch):
    """commit ≡ prefill catches a commit whose length takes one verified row more than it accepts (the emitted
    tokens right): the continuation reads that row. `commit` runs outside any jitted program, so a plain monkeypatch
    reaches it (no retrace)."""
    commit = model.commit

    def one_row_too_many(state, accept_lens, bonus):
        committed = commit(state, accept_lens, bonus)
        return committed.replace(length=committed.length + 1)

    monkeypatch.setattr(model, "commit", one_row_too_many)
    committed, reference, _, _ = _commit_and_prefill(mini_params, [2, 4], [N, 14], seed=0)
    lengths = (np.asarray(committed.length), np.asarray(reference.length))
    drafts = max(np.abs(a - b).max() for a, b in zip(_drafts(mini_params, committed), _drafts(mini_params, reference)))
    cont = np.abs(_continue(mini_params, committed, 3) - _continue(mini_params, reference, 3)).max()
    print(f"\nmutant commit + 1 row: lengths {lengths}, max |Δ drafts| {drafts:.3f}, max |Δ continuation| {cont:.3f}")
    assert (lengths[0] == lengths[1] + 1).all()
    assert drafts > 100 * 1e-4 and cont > 100 * 1e-4
