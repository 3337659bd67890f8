"""The assembled CED model: decode ≡ forward, commit ≡ sequential, fork, replay, compile-once (SPEC §11–§12)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from csa2 import cache, model
from csa2.presets import preset
from csa2.replay import EXACT, ReplayPolicy, token_layers
from csa2.state import init_state
from tests.csa2.helpers import keep, tokens as _tokens

MINI = preset("mini")
CAP = 64


def _greedy_decode(cfg, params, first, steps, fmt="float"):
    """Prefill one token, then greedy decode: returns tokens [B, steps+1] and logits [B, steps+1, V]."""
    state = init_state(cfg, first.shape[0], CAP, fmt)
    logits, state, _ = model.prefill(cfg, params, state, first[:, None], replay=EXACT)
    toks, outs = [first], [logits]
    for _ in range(steps):
        nxt = jnp.argmax(logits, -1).astype(jnp.int32)
        logits, state = model.decode_step(cfg, params, state, nxt)
        toks.append(nxt)
        outs.append(logits)
    return jnp.stack(toks, 1), jnp.stack(outs, 1), state


def _decode_and_forward(cfg, params, steps):
    """Greedy decode logits [B, steps+1, V] from a one-token prefill, and `forward`'s logits and aux on its tokens."""
    tokens, logits, _ = _greedy_decode(cfg, params, jnp.array([3, 200], jnp.int32), steps=steps)
    ref, aux = model.forward(cfg, params, tokens, qat=True)
    return logits, ref, aux


@pytest.mark.cross_shape
@pytest.mark.parametrize("name", ["mini", "tiny"])
def test_greedy_decode_equals_teacher_forced_forward(name, mini_params, tiny_params):
    """Exact mode, f32: step-by-step logits == forward on the same tokens, across ring wrap (21 slots)
    and every ratio-2 boundary."""
    cfg = preset(name)
    logits, ref, aux = _decode_and_forward(cfg, mini_params if name == "mini" else tiny_params, steps=25)
    # One token per step and the whole sequence at once sum in different orders; re-rounded to FP4 by the
    # SPEC §8 fake-quant, the last-ulp differences can flip a rare cached element by one step and move later
    # logits by ~1e-3 (seen on AVX-512 XLA:CPU for mini: 8e-4). A wrong ring slot, position or window moves
    # them by ~1e-1, and most logits still agree to float precision.
    np.testing.assert_allclose(logits, ref, rtol=0, atol=1e-2)
    assert np.mean(np.abs(np.asarray(logits) - np.asarray(ref)) <= 1e-4) >= 0.5
    assert aux["load"].shape == (cfg.num_hidden_layers, cfg.n_routed_experts)


def test_mutant_ring_slot_off_by_one_is_caught(mini_params, mutant):
    """Decode ≡ forward catches a ring written one slot off (position p at slot (p + 1) % slots, read at p % slots):
    the window of every decode step reads a wrong row (the `mutant` fixture: conftest)."""
    ring_slots = cache.ring_slots

    def off_by_one(positions, valid, new_length, slots):
        slot, keep = ring_slots(positions, valid, new_length, slots)
        return (slot + 1) % slots, keep

    mutant.setattr(cache, "ring_slots", off_by_one)
    logits, ref, _ = _decode_and_forward(MINI, mini_params, steps=6)
    diff = np.abs(np.asarray(logits) - np.asarray(ref))
    print(f"\nmutant ring slot + 1: max |Δ logits| {diff.max():.3f}, within 1e-4: {np.mean(diff <= 1e-4):.3f}")
    assert diff.max() > 10 * 1e-2  # the test's atol
    assert np.mean(diff <= 1e-4) < 0.5


def test_packed_fp4_cache_decodes_like_float_cache(mini_params):
    first = jnp.array([5, 6], jnp.int32)
    _, a, _ = _greedy_decode(MINI, mini_params, first, steps=6, fmt="fp4")
    _, b, _ = _greedy_decode(MINI, mini_params, first, steps=6, fmt="float")
    np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- verify / commit

GAMMA = 4


def _decode_all(params, state, tokens):
    outs = []
    for t in range(tokens.shape[1]):
        logits, state = model.decode_step(MINI, params, state, tokens[:, t])
        outs.append(logits)
    return jnp.stack(outs, 1), state


@pytest.mark.cross_shape
@pytest.mark.parametrize("prompt_len", [18, 17])
def test_commit_equals_sequential_decode(mini_params, prompt_len):
    """commit(verify(state, [R, d1..dγ]), n+1) continues exactly like decoding R, d1..dn one by one.

    prompt 18: the verify block L..L+4 = 18..22 wraps the 21-slot rings; with both parities of L a
    ratio-2 pair straddles the accept boundary for some n."""
    prompt = _tokens(1, (2, prompt_len))
    state0 = init_state(MINI, 2, CAP, "float")
    _, state, _ = model.prefill(MINI, mini_params, state0, prompt, replay=EXACT)
    block = _tokens(2, (2, GAMMA + 1))
    cont = _tokens(3, (2, 3))
    v_logits, spec = model.verify(MINI, mini_params, keep(state), block)
    seq_logits, _ = _decode_all(mini_params, keep(state), block)
    np.testing.assert_allclose(v_logits, seq_logits, rtol=1e-4, atol=1e-4)
    bonus = jnp.array([7, 9], jnp.int32)
    for n in range(GAMMA + 1):
        committed = model.commit(keep(spec), jnp.full((2,), n + 1, jnp.int32), bonus)
        assert (np.asarray(committed.length) == prompt_len + n + 1).all()
        emitted = np.concatenate([np.asarray(block[:, 1:n + 1]), np.asarray(bonus)[:, None]], axis=1)  # d1..dn, C
        np.testing.assert_array_equal(committed.accept.tokens[:, :n + 1], emitted)
        np.testing.assert_array_equal(committed.accept.count, n + 1)
        np.testing.assert_array_equal(committed.accept.width, 0)
        _, seq_state = _decode_all(mini_params, keep(state), block[:, :n + 1])
        a, _ = _decode_all(mini_params, committed, cont)
        b, _ = _decode_all(mini_params, seq_state, cont)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.cross_shape
def test_commit_with_different_accept_lengths_per_row(mini_params):
    state0 = init_state(MINI, 2, CAP, "fp4")
    _, state, _ = model.prefill(MINI, mini_params, state0, _tokens(4, (2, 9)), replay=EXACT)
    block = _tokens(5, (2, GAMMA + 1))
    _, spec = model.verify(MINI, mini_params, keep(state), block)
    committed = model.commit(spec, jnp.array([1, 4], jnp.int32), jnp.array([5, 6], jnp.int32))
    nxt = _tokens(6, (2, 2))
    a, _ = _decode_all(mini_params, committed, nxt)
    for row, n in ((0, 1), (1, 4)):
        twice = jnp.array([row, row])
        _, s_row = _decode_all(mini_params, model.fork(state, twice), block[twice, :n])
        b, _ = _decode_all(mini_params, s_row, nxt[twice])
        np.testing.assert_allclose(a[row], b[0], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- fork

def _bits(tree):
    """Every leaf of a pytree as raw bytes, so float leaves compare bit for bit (NaN payloads included)."""
    return [np.asarray(x).view(np.uint8) for x in jax.tree_util.tree_leaves(tree)]


@pytest.mark.cross_shape
def test_fork_is_a_gather_and_rows_are_independent_at_fixed_shapes(mini_params):
    """The bitwise half of the batch promise (`csa2.state`, "What is bitwise"): at fixed shapes a row's bits
    never depend on the other rows, and `fork` is a gather, so forked rows hold their source rows' bits."""
    prompts = _tokens(7, (3, 11))
    n_valid = jnp.array([11, 9, 11], jnp.int32)
    state0 = init_state(MINI, 3, CAP, "fp4")
    logits, state, _ = model.prefill(MINI, mini_params, keep(state0), prompts, n_valid, replay=EXACT)
    rows = jnp.array([1, 0, 1])
    forked = model.fork(state, rows)
    for got, src in zip(_bits(forked), _bits(jax.tree.map(lambda x: np.asarray(x)[np.asarray(rows)], state)),
                        strict=True):
        np.testing.assert_array_equal(got, src)
    # Another row's tokens and length change; rows 0 and 2 keep every bit of their logits and state.
    other = prompts.at[1].set(_tokens(11, (11,)))
    o_logits, o_state, _ = model.prefill(MINI, mini_params, keep(state0), other, n_valid.at[1].set(4),
                                         replay=EXACT)
    assert not np.allclose(o_logits[1], logits[1])
    mine = jnp.array([0, 2])
    np.testing.assert_array_equal(np.asarray(o_logits)[mine].view(np.uint32), np.asarray(logits)[mine].view(np.uint32))
    for a, b in zip(_bits(model.fork(o_state, mine)), _bits(model.fork(state, mine)), strict=True):
        np.testing.assert_array_equal(a, b)
    # Decoding continues the same way: rows 0 and 2 fork from one source but get different tokens; changing
    # row 1's continuation changes no bit of theirs.
    cont = _tokens(8, (3, 3))
    a, _ = _decode_all(mini_params, keep(forked), cont)
    b, _ = _decode_all(mini_params, keep(forked), cont.at[1].set(_tokens(12, (3,))))
    assert not np.allclose(a[0], a[2])
    np.testing.assert_array_equal(np.asarray(a)[mine].view(np.uint32), np.asarray(b)[mine].view(np.uint32))


@pytest.mark.cross_shape
@pytest.mark.parametrize("fmt", ["float", "fp4"])
def test_forked_rows_continue_like_separately_prefilled_rows(mini_params, fmt):
    """The cross-shape half: 2 rows prefilled then forked to 3 continue like 3 rows prefilled separately. The
    two prefills are programs of different batch sizes, which XLA:CPU does not promise to round alike (vector
    widths, tiling and fusion choices follow the shape and the host's ISA), so they agree to float rounding;
    with SPEC §8 storage those last-ulp differences can flip a rare FP4/FP8 element at a rounding midpoint,
    moving later logits by ~1e-3 while a wrong row or position moves them by ~1e-1."""
    prompts = _tokens(7, (2, 11))
    rows = jnp.array([1, 0, 1])
    _, state, _ = model.prefill(MINI, mini_params, init_state(MINI, 2, CAP, fmt), prompts, replay=EXACT)
    _, separate, _ = model.prefill(MINI, mini_params, init_state(MINI, 3, CAP, fmt), prompts[rows], replay=EXACT)
    cont = _tokens(8, (3, 3))  # rows 0 and 2 fork from the same prompt but continue differently
    a, _ = _decode_all(mini_params, model.fork(state, rows), cont)
    b, _ = _decode_all(mini_params, separate, cont)
    assert not np.allclose(a[0], a[2], atol=1e-2)
    if fmt == "float":
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    else:
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-2)
        assert np.mean(np.abs(np.asarray(a) - np.asarray(b)) <= 1e-4) >= 0.5


# ---------------------------------------------------------------- replay (SPEC §11)

def test_replay_window_covering_the_prompt_equals_exact(mini_params):
    prompt = _tokens(9, (2, 24))
    a, sa, _ = model.prefill(MINI, mini_params, init_state(MINI, 2, CAP, "fp4"), prompt, replay=EXACT)
    b, sb, _ = model.prefill(MINI, mini_params, init_state(MINI, 2, CAP, "fp4"), prompt,
                             replay=ReplayPolicy(window=24))
    np.testing.assert_array_equal(a, b)
    for x, y in zip(jax.tree_util.tree_leaves(sa), jax.tree_util.tree_leaves(sb)):
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


def test_small_replay_window_keeps_global_kv_and_bounds_decoder_work(mini_params):
    n, r = 24, 6
    prompt = _tokens(10, (2, n))
    n_valid = jnp.array([24, 13], jnp.int32)

    def run(policy):
        return model.prefill(MINI, mini_params, init_state(MINI, 2, CAP, "float"), prompt, n_valid, policy)

    _, exact, w_exact = run(EXACT)
    logits, replayed, w_replay = run(ReplayPolicy(window=r))
    for g in range(2):  # Global KV (encoder sources and the decoder's projection) is identical
        np.testing.assert_allclose(replayed.global_kv[g].kv.payload, exact.global_kv[g].kv.payload, rtol=1e-6,
                                   atol=1e-6)
    split, layers = MINI.first_decoder_layer, MINI.num_hidden_layers
    dec = slice(split, layers)
    assert not np.allclose(replayed.swa.payload[:, dec], exact.swa.payload[:, dec])  # decoder rings hold tails
    np.testing.assert_array_equal(replayed.floor, [n - r, 13 - r])
    # work counts the rows entering each layer: the split layer (Full) compresses every row, then runs its
    # attention and FFN on the tail, so it counts them all.
    total = sum((split + 1) * int(v) + (layers - split - 1) * min(r, int(v)) for v in n_valid)
    assert int(w_replay["work"]) == total and int(w_exact["work"]) == layers * int(n_valid.sum())
    assert total == sum(token_layers(MINI, ReplayPolicy(window=r), int(v)) for v in n_valid)
    # split_layer moves the boundary: L{split} whole on every row, L{split+1} (Reuse) on the tail only.
    _, split21, w21 = run(ReplayPolicy(window=r, split_layer=split + 1))
    assert int(w21["work"]) == total == sum(token_layers(MINI, ReplayPolicy(window=r, split_layer=split + 1), int(v))
                                             for v in n_valid)
    np.testing.assert_array_equal(split21.floor, replayed.floor)
    # decoding after a replayed prefill stays finite and respects the floor
    out, _ = model.decode_step(MINI, mini_params, replayed, jnp.array([1, 2], jnp.int32))
    assert np.isfinite(np.asarray(out)).all()


def test_release_replay_saves_the_reported_token_layer_work_at_8k(v41_flash):
    """The V4.1 report's 46.76 % at 8K: SGLang's split (layer 20 whole on every row, tails from 21), R = 128."""
    cfg = v41_flash
    saving = 1 - token_layers(cfg, ReplayPolicy(window=128, split_layer=21), 8192) / token_layers(cfg, EXACT, 8192)
    assert round(100 * saving, 2) == 46.76


def test_replay_row_without_tokens_comes_out_unchanged(mini_params):
    """A row with n_valid = 0 in a replayed prefill keeps its whole state: its floor does not rise to its
    length, so its next decode keeps its decoder window (SPEC §11)."""
    _, state, _ = model.prefill(MINI, mini_params, init_state(MINI, 2, CAP, "float"), _tokens(11, (2, 12)),
                                replay=EXACT)
    before = keep(state)
    _, after, work = model.prefill(MINI, mini_params, state, _tokens(12, (2, 6)), jnp.array([6, 0], jnp.int32),
                                   replay=ReplayPolicy(window=4))
    row1 = jnp.array([1])
    for x, y in zip(jax.tree.leaves(model.fork(before, row1)), jax.tree.leaves(model.fork(after, row1))):
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
    np.testing.assert_array_equal(after.floor, [18 - 4, 0])
    split, layers = MINI.first_decoder_layer, MINI.num_hidden_layers
    assert int(work["work"]) == (split + 1) * 6 + (layers - split - 1) * 4


def test_replay_extend_outside_the_chunk_is_refused(mini_params):
    with pytest.raises(ValueError, match=r"extend=.*rows \[1\].*Extend.cold"):
        model.prefill(MINI, mini_params, init_state(MINI, 2, CAP), _tokens(13, (2, 6)), replay=ReplayPolicy(window=4),
                      extend=model.Extend.cold(jnp.array([8, 5], jnp.int32)))
    with pytest.raises(ValueError, match=r"extend\.end: float32\[2\]"):
        model.prefill(MINI, mini_params, init_state(MINI, 2, CAP), _tokens(13, (2, 6)), replay=ReplayPolicy(window=4),
                      extend=model.Extend(start=jnp.zeros(2, jnp.int32), end=jnp.full(2, 8.0)))


# ---------------------------------------------------------------- compile once

def test_decode_loop_compiles_once(mini_params):
    state = init_state(MINI, 2, CAP, "fp4")
    tok = jnp.array([1, 2], jnp.int32)
    _, state = model.decode_step(MINI, mini_params, state, tok)  # warm (may already be cached)
    before = model.decode_step.cache_size()
    for _ in range(63):
        logits, state = model.decode_step(MINI, mini_params, state, tok)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
    assert model.decode_step.cache_size() == before


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("call, message", [
    (lambda p, s: model.prefill(MINI, p, s, jnp.full((2, 4), 300, jnp.int32)), "outside the vocabulary"),
    (lambda p, s: model.prefill(MINI, p, s, jnp.zeros((2, CAP + 2), jnp.int32)), "capacity"),
    (lambda p, s: model.prefill(MINI, p, s, jnp.zeros((3, 4), jnp.int32)), "tokens.shape"),
    (lambda p, s: model.decode_step(MINI, p, s, jnp.zeros((2, 1), jnp.int32)), "one token per row"),
    (lambda p, s: model.verify(MINI, p, s, jnp.zeros((2, MINI.max_draft + 2), jnp.int32)), "max_draft"),
    (lambda p, s: model.commit(s, jnp.array([9, 1]), jnp.array([0, 0])), "accept_lens"),
    (lambda p, s: model.prefill(MINI, p, s, jnp.zeros((2, 4), jnp.int32), replay=ReplayPolicy(window=0)), "window"),
    (lambda p, s: model.prefill(MINI, p, s, jnp.zeros((2, 4), jnp.int32),
                                replay=ReplayPolicy(split_layer=2)), "split_layer"),
])
def test_bad_input_raises(mini_params, call, message):
    with pytest.raises(ValueError, match=message):
        call(mini_params, init_state(MINI, 2, CAP, "float"))
