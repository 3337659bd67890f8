"""The DSpark drafter (SPEC §12): parameters, context windows, masks, and the inference form ≡ the training form."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from csa2 import dspark, model, replay
from csa2.chunk import Chunk
from csa2.params import arrays
from csa2.presets import preset
from csa2.replay import Extend, ReplayPolicy
from csa2.state import init_state
from tests.csa2.helpers import keep, tokens

MINI = preset("mini")
B, CAP, N = 2, 64, 20
GAMMA = MINI.dspark_block_size


@pytest.fixture(scope="module")
def prefilled(mini_params):
    """A float-cache state after an exact prefill of N tokens per row, the prompt and the greedy anchor."""
    prompt = tokens(3, (B, N))
    logits, state, _ = model.prefill(MINI, mini_params, init_state(MINI, B, CAP, "float"), prompt,
                                     replay=model.EXACT)
    return prompt, state, jnp.argmax(logits, -1).astype(jnp.int32)


def test_drafter_parameters_are_their_own_subtree(mini_params):
    p = arrays(mini_params)
    d, n_t, r, v = MINI.hidden_size, len(MINI.dspark_target_layer_ids), MINI.dspark_markov_rank, MINI.vocab_size
    drafter = p[model.DRAFTER]
    assert drafter["main_proj"].shape == (n_t * d, d)
    assert drafter["markov_embed"].shape == (v, r) and drafter["markov_head"].shape == (r, v)
    assert drafter["confidence"].shape == (d + r,)
    assert len(drafter["stages"]) == MINI.num_nextn_predict_layers
    assert drafter["stages"][0]["moe"]["router"].shape == (d, MINI.dspark_n_routed_experts)
    assert set(p) == {"embed", "groups", "engram", "norm", "head", model.DRAFTER}
    no_draft = MINI.replace(num_nextn_predict_layers=0)
    assert model.DRAFTER not in arrays(model.abstract_params(no_draft))
    assert init_state(no_draft, 1, 16).draft.payload.shape[1] == 0


def test_proposal_shapes_and_greedy_is_the_markov_argmax(mini_params, prefilled):
    _, state, anchor = prefilled
    prop = model.draft(MINI, mini_params, state, anchor, jax.random.PRNGKey(0))
    assert prop.tokens.shape == (B, GAMMA) and prop.logits.shape == (B, GAMMA, MINI.vocab_size)
    assert prop.confidence.shape == (B, GAMMA)
    np.testing.assert_array_equal(prop.tokens, jnp.argmax(prop.logits, -1))
    assert np.all((np.asarray(prop.confidence) > 0) & (np.asarray(prop.confidence) < 1))


def test_inference_form_equals_training_form(mini_params, prefilled):
    """`propose` on a prefilled state (context windows in the ring, drafts sampled left to right) ≡ `anchored` on
    the teacher-forced sequence prompt + [anchor, d1 … d_{γ−1}] at anchor position N: the same logits and
    confidences. This ties the ring (written by prefill) to the features of `forward(features=True)`."""
    prompt, state, anchor = prefilled
    prop = model.draft(MINI, mini_params, state, anchor, jax.random.PRNGKey(0))
    seq = jnp.concatenate([prompt, anchor[:, None], prop.tokens[:, :-1]], axis=1)  # [B, N + γ]
    _, aux = model.forward(MINI, mini_params, seq, qat=True, features=True)
    logits, conf = dspark.anchored(MINI, arrays(mini_params), aux["features"], seq, jnp.full((B, 1), N, jnp.int32),
                                   quantize=True)
    np.testing.assert_allclose(logits[:, 0], prop.logits, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(conf[:, 0], prop.confidence, rtol=1e-5, atol=1e-5)


def _spy_positions(monkeypatch, shift=0):
    """Record the block positions every `dspark.hidden` call receives (moved by `shift` before it runs)."""
    seen, real = [], dspark.hidden

    def spy(cfg, p, embed, block, positions, *rest, **kw):
        seen.append(np.asarray(positions))
        return real(cfg, p, embed, block, positions + shift, *rest, **kw)

    monkeypatch.setattr(dspark, "hidden", spy)
    return seen


def test_the_block_starts_at_length_one_step_after_the_context(mini_params, prefilled, monkeypatch):
    """SPEC §12: C is rotated at its own position L = `length`, slot k at L + k, and the context is
    `[L − W, L − 1]`; in training a block anchored at a sits at a … a + γ − 1 (the references' anchor_pos + 1)."""
    _, state, anchor = prefilled
    seen = _spy_positions(monkeypatch)
    dspark.propose(MINI, arrays(mini_params), state, anchor, jax.random.PRNGKey(0), jnp.float32(0), jnp.float32(1),
                   quantize=True)
    np.testing.assert_array_equal(seen[0], np.asarray(state.length)[:, None] + np.arange(GAMMA))
    rows = dspark.window_rows(state.length, state.floor, MINI.sliding_window, state.draft.rows)
    context = N - MINI.sliding_window + np.arange(MINI.sliding_window)  # [L − W, L − 1]
    np.testing.assert_array_equal(rows, np.broadcast_to(context % state.draft.rows, (B, MINI.sliding_window)))
    anchors = jnp.asarray([[6, 15]] * B, jnp.int32)
    seq = tokens(5, (B, 24))
    feats = jax.random.normal(jax.random.PRNGKey(6), (B, 24, len(MINI.dspark_target_layer_ids), MINI.hidden_size))
    dspark.anchored(MINI, arrays(mini_params), feats, seq, anchors, quantize=False)
    np.testing.assert_array_equal(seen[1], (np.asarray(anchors)[..., None] + np.arange(GAMMA)).reshape(B, -1))


def test_draft_logits_see_positions_relative_to_the_context(mini_params, monkeypatch):
    """Float storage, training form: moving the sequence and every anchor by 7 positions leaves the logits and
    confidences (to float rounding: RoPE is relative); moving the block one step against its context does not."""
    p, s, shift = arrays(mini_params), 40, 7
    anchors = jnp.asarray([[MINI.sliding_window, 30]] * B, jnp.int32)  # whole windows inside the sequence
    seq = tokens(13, (B, s))
    feats = jax.random.normal(jax.random.PRNGKey(14), (B, s, len(MINI.dspark_target_layer_ids), MINI.hidden_size))
    base, base_c = dspark.anchored(MINI, p, feats, seq, anchors, quantize=False)
    pad_t = tokens(15, (B, shift))
    pad_f = jax.random.normal(jax.random.PRNGKey(16), (B, shift, *feats.shape[2:]))
    moved, moved_c = dspark.anchored(MINI, p, jnp.concatenate([pad_f, feats], 1), jnp.concatenate([pad_t, seq], 1),
                                     anchors + shift, quantize=False)
    np.testing.assert_allclose(moved, base, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(moved_c, base_c, rtol=1e-5, atol=1e-5)
    _spy_positions(monkeypatch, shift=1)
    off_by_one, _ = dspark.anchored(MINI, p, feats, seq, anchors, quantize=False)
    assert np.max(np.abs(np.asarray(off_by_one) - np.asarray(base))) > 1e-2


def test_a_block_sees_only_its_context_and_its_own_block(mini_params):
    """Training form, two anchors per row: changing the features at or after an anchor, or the tokens of the other
    block, leaves a block's logits unchanged; changing the feature just before the anchor changes them."""
    p = arrays(mini_params)
    s, anchors = 24, jnp.asarray([[6, 15]] * B, jnp.int32)
    seq = tokens(5, (B, s))
    feats = jax.random.normal(jax.random.PRNGKey(6), (B, s, len(MINI.dspark_target_layer_ids), MINI.hidden_size))
    base, _ = dspark.anchored(MINI, p, feats, seq, anchors, quantize=False)
    later = feats.at[:, 6:].add(1.0)  # the first block's anchor position and everything after it
    got, _ = dspark.anchored(MINI, p, later, seq, anchors, quantize=False)
    np.testing.assert_array_equal(got[:, 0], base[:, 0])
    assert not np.allclose(got[:, 1], base[:, 1])
    other = seq.at[:, 15].set((seq[:, 15] + 1) % 256)  # the second block's anchor token
    got, _ = dspark.anchored(MINI, p, feats, other, anchors, quantize=False)
    np.testing.assert_array_equal(got[:, 0], base[:, 0])
    assert not np.allclose(got[:, 1], base[:, 1])
    before = feats.at[:, 5].add(1.0)
    got, _ = dspark.anchored(MINI, p, before, seq, anchors, quantize=False)
    assert not np.allclose(got[:, 0], base[:, 0])


def test_window_rows_cover_the_window_above_the_floor():
    rows = dspark.window_rows(jnp.asarray([20, 5, 40]), jnp.asarray([0, 0, 30]), window=16, slots=21)
    np.testing.assert_array_equal(rows[0], np.arange(4, 20) % 21)
    np.testing.assert_array_equal(rows[1], [-1] * 11 + [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(rows[2], [-1] * 6 + [p % 21 for p in range(30, 40)])


def test_scratch_beyond_length_never_reaches_a_draft(mini_params, prefilled):
    """A verify writes the context windows of positions L … L+γ; before commit, the draft from that state equals
    the draft from the state before the verify (rejected rows are scratch)."""
    _, state, anchor = prefilled
    key = jax.random.PRNGKey(1)
    before = model.draft(MINI, mini_params, state, anchor, key)
    _, spec = model.verify(MINI, mini_params, keep(state), tokens(8, (B, GAMMA + 1)))
    assert not np.array_equal(np.asarray(spec.draft.payload), np.asarray(state.draft.payload))
    after = model.draft(MINI, mini_params, spec, anchor, key)
    np.testing.assert_array_equal(after.logits, before.logits)


@pytest.mark.parametrize("cfg, anchor, match", [
    (MINI, jnp.zeros((3,), jnp.int32), "anchor.shape"),
    (MINI, jnp.zeros((B,), jnp.float32), "anchor.dtype"),
    (MINI, jnp.full((B,), 999, jnp.int32), "outside the vocabulary"),
])
def test_bad_draft_input_raises_value_error(mini_params, prefilled, cfg, anchor, match):
    with pytest.raises(ValueError, match=match):
        model.draft(cfg, mini_params, prefilled[1], anchor, jax.random.PRNGKey(0))


def test_draft_without_a_drafter_raises_value_error(mini_params, prefilled):
    with pytest.raises(ValueError, match="num_nextn_predict_layers=0"):
        model.draft(MINI.replace(num_nextn_predict_layers=0), mini_params, prefilled[1], prefilled[2],
                    jax.random.PRNGKey(0))


# ---------------------------------------------------------------------------------------------
# The drafter's context under bounded replay (SPEC §11): rows below the floor have no features

W = MINI.sliding_window
SPLIT = MINI.first_decoder_layer
# The smallest R whose drafter context equals exact mode's: the last target layer's features are exact from
# W − 1 positions per decoder layer above the floor (see the test below), and the context starts W below length.
R_EXACT_CONTEXT = W + (max(MINI.dspark_target_layer_ids) - SPLIT) * (W - 1)  # 61 for mini
LONG = jnp.asarray([80, 70], jnp.int32)  # prompt lengths, both above R_EXACT_CONTEXT
LONG_CAP = 128


@pytest.fixture(scope="module")
def long_exact(mini_params):
    """Exact prefill of prompts of `LONG` tokens (float cache): prompt, state, greedy anchor, its draft logits."""
    prompt = tokens(21, (B, int(LONG.max())))
    logits, state, _ = model.prefill(MINI, mini_params, init_state(MINI, B, LONG_CAP, "float"), prompt, LONG,
                                     replay=model.EXACT)
    anchor = jnp.argmax(logits, -1).astype(jnp.int32)
    return prompt, state, anchor, model.draft(MINI, mini_params, state, anchor, jax.random.PRNGKey(0)).logits


def _replayed(params, long_exact, window):
    """The state after a prefill of the same prompts with replay window `window`, and its draft logits after the
    exact prefill's anchor (so only the drafter's context differs)."""
    prompt, _, anchor, _ = long_exact
    _, state, _ = model.prefill(MINI, params, init_state(MINI, B, LONG_CAP, "float"), prompt, LONG,
                                replay=ReplayPolicy(window=window))
    return state, model.draft(MINI, params, state, anchor, jax.random.PRNGKey(0)).logits


def _context_positions(length):
    return np.asarray(length)[:, None] - W + np.arange(W)  # [B, W]: [L − W, L − 1]


def test_replay_below_the_window_masks_the_context_below_the_floor(mini_params, long_exact):
    """Model level, R = 8 < W = 16 (`model.prefill` as called; `speculative_generate` would raise R to W): the floor
    is length − R, `window_rows` masks exactly the context rows below it, the R rows above it are those of the ring,
    and the draft logits differ from the exact prefill's: the first drafts after such a prompt lose context."""
    _, _, _, exact = long_exact
    r = 8
    state, got = _replayed(mini_params, long_exact, r)
    np.testing.assert_array_equal(state.floor, LONG - r)
    rows = np.asarray(dspark.window_rows(state.length, state.floor, W, state.draft.rows))
    pos = _context_positions(state.length)
    below = pos < (np.asarray(LONG) - r)[:, None]
    np.testing.assert_array_equal(rows == -1, below)
    np.testing.assert_array_equal(rows[~below], (pos % state.draft.rows)[~below])
    assert np.max(np.abs(np.asarray(got) - np.asarray(exact))) > 1e-1


def test_replay_of_the_window_fills_the_context_with_approximate_rows(mini_params, long_exact):
    """R = W: no context row lies below the floor (none is masked), yet the draft logits still differ from exact
    mode's, and legitimately: rows near the floor ran the decoder with windows cut at the floor (SPEC §11), so
    their target features are not exact mode's (the next test gives the bound). From R = 61 (`R_EXACT_CONTEXT`)
    on, the context `[L − W, L − 1]` is all exact: the ring holds exact mode's entries there and the draft logits
    equal exact mode's to float rounding."""
    _, exact_state, _, exact = long_exact
    state, got = _replayed(mini_params, long_exact, W)
    np.testing.assert_array_equal(state.floor, LONG - W)
    assert np.all(np.asarray(dspark.window_rows(state.length, state.floor, W, state.draft.rows)) >= 0)
    assert np.max(np.abs(np.asarray(got) - np.asarray(exact))) > 1e-2
    state, got = _replayed(mini_params, long_exact, R_EXACT_CONTEXT)
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5)
    context = _context_positions(state.length) % state.draft.rows  # [B, W] ring rows of [L − W, L − 1]
    ring = lambda s: np.take_along_axis(np.asarray(s.draft.payload), context[:, None, :, None], axis=2)  # noqa: E731
    np.testing.assert_allclose(ring(state), ring(exact_state), rtol=1e-5, atol=1e-5)


def test_replayed_target_features_are_exact_from_one_window_per_decoder_layer_above_the_floor(mini_params):
    """Why R = W is not enough for exact context rows, float model (`forward(features=True)`, where FP8 storage
    cannot hide a small difference), R = 50 on 80 tokens (floor 30): target layer ℓ's feature at position p (its
    attention-site input, computed by layers up to ℓ − 1) equals exact mode's iff p ≥ floor + (ℓ − split)·(W − 1).
    The split layer's window at p reaches back to p − W + 1, which must not be below the floor; each decoder layer
    after it reads the previous layer's outputs over one more window. With the context starting at L − W, the
    drafter's rows are all exact from R ≥ W + (max target − split)·(W − 1): 61 for mini, 125 for `demo`, 2541 for
    the release (W = 128, split 20, targets up to 39)."""
    n, r = 80, 50
    seq = tokens(22, (B, n))
    _, exact = model.forward(MINI, mini_params, seq, features=True)
    _, replayed = model.forward(MINI, mini_params, seq, features=True, replay=ReplayPolicy(window=r))
    floor = n - r
    diff = np.abs(np.asarray(replayed["features"]) - np.asarray(exact["features"])[:, floor:]).max(-1)  # [B, R, n_t]
    for j, layer in enumerate(MINI.dspark_target_layer_ids):
        first = (layer - SPLIT) * (W - 1)  # the first exact row of the tail
        assert diff[:, first:, j].max() < 2e-7, (layer, diff[:, first:, j].max())
        assert diff[:, :first, j].min() > 2e-7, (layer, diff[:, :first, j].min())


def _fed(policy, start, end, floor, hit=None, chunk=None):
    """Feed positions `[start, end)` of one row as one extend (in chunks of `chunk` columns) on a row whose
    decoder floor is `floor`, through `replay.plan` (what `model.prefill` computes, without the model): the first
    position that runs the decoder layers and the floor after the last chunk."""
    extend = Extend(start=jnp.asarray([start]), end=jnp.asarray([end]),
                    hit=None if hit is None else jnp.asarray([hit]))
    s = chunk or end - start
    floor, first = jnp.asarray([floor], jnp.int32), None
    for c in range(start, end, s):
        n = min(s, end - c)
        step = replay.plan(MINI, policy, Chunk(start=jnp.asarray([c]), n_valid=jnp.asarray([n]), floor=floor), s,
                           floor, extend)
        floor = step.tail.chunk.floor
        if first is None and int(step.tail.chunk.n_valid[0]) > 0:
            first = int(step.tail.chunk.start[0])
    return first, int(floor[0])


def _masked(length, floor):
    """The context positions `[L − W, L − 1]` that `window_rows` masks (negative ones included)."""
    pos = length - W + np.arange(W)
    slots = W + MINI.max_draft + 1  # `State.draft`'s ring
    rows = np.asarray(dspark.window_rows(jnp.asarray([length]), jnp.asarray([floor]), W, slots))[0]
    return pos[rows == -1]


@pytest.mark.parametrize("chunk", [None, 7], ids=["one_call", "chunks_of_7"])
def test_drafting_replay_gives_the_drafter_a_whole_window(chunk):
    """`replay.drafting_replay` (what speculative decoding prefills with), by the replay plan alone: a cold prompt of
    N tokens (shorter than W, W, longer, R larger than the prompt; one call or chunks of one extend) runs the decoder
    on its last W positions at least, and the drafter's first context is masked nowhere (only below position 0);
    as given, R < W masks exactly the positions below N − R. A prefix hit without its snapshot (encoder replay)
    and a snapshot hit under "borrow" keep the whole window too; under "truncate" a short extend floors the drafter
    at the hit whatever R is (documented, `drafting_replay`)."""
    assert replay.drafting_replay(MINI, model.EXACT) is model.EXACT
    wide = ReplayPolicy(window=W + 1)
    assert replay.drafting_replay(MINI, wide) is wide
    assert replay.drafting_replay(MINI, ReplayPolicy(window=3, split_layer=5, short_extend="borrow")) == \
        ReplayPolicy(window=W, split_layer=5, short_extend="borrow")
    with pytest.raises(ValueError, match="policy=8: pass a csa2.replay.ReplayPolicy"):
        replay.drafting_replay(MINI, 8)
    for n in (5, W, 40, 150):
        for r in (1, 8, W - 1, W, 40, 1000, None):
            given = model.EXACT if r is None else ReplayPolicy(window=r)
            first, floor = _fed(replay.drafting_replay(MINI, given), 0, n, 0, chunk=chunk)
            assert first <= max(n - W, 0) and floor == (0 if r is None else max(n - max(r, W), 0)), (n, r)
            assert np.all(_masked(n, floor) < 0), (n, r)
            if r is not None and r < W:
                _, floor = _fed(given, 0, n, 0, chunk=chunk)
                np.testing.assert_array_equal(_masked(n, floor), np.arange(n - W, max(n - r, 0)))
    for hit, end in ((32, 35), (32, 80), (100, 101)):
        for r in (1, 8, W, 40):
            raised = replay.drafting_replay(MINI, ReplayPolicy(window=r))
            ext = Extend.replaying(MINI, raised, jnp.asarray([hit]), jnp.asarray([end]))
            start = int(ext.start[0])  # `PrefixCache.restore` sets the row's length and floor to it
            first, floor = _fed(raised, start, end, start, hit=hit, chunk=chunk)
            assert first <= end - W and floor <= end - W and np.all(_masked(end, floor) < 0), (hit, end, r)
            for mode in ("borrow", "truncate"):  # a snapshot hit: the prefix's prefill, then the extend [hit, end)
                policy = replay.drafting_replay(MINI, ReplayPolicy(window=r, short_extend=mode))
                prefix_first, prefix_floor = _fed(policy, 0, hit, 0, chunk=chunk)
                _, floor = _fed(policy, hit, end, prefix_floor, hit=hit, chunk=chunk)
                if mode == "borrow" or end - hit >= policy.window:
                    assert prefix_first <= end - W and np.all(_masked(end, floor) < 0), (hit, end, r, mode)
                else:
                    assert floor == hit, (hit, end, r, mode)
