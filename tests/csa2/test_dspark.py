"""The DSpark drafter (SPEC §12): parameters, context windows, masks, and the inference form ≡ the training form."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from csa2 import dspark, model
from csa2.config import preset
from csa2.params import arrays
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
    assert set(p) == {"embed", "groups", "norm", "head", model.DRAFTER}
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
    dspark.propose(MINI, arrays(mini_params), state, anchor, jax.random.PRNGKey(0), jnp.float32(0), jnp.float32(1))
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
