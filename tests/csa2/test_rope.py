"""Tests for csa2.rope (SPEC §7)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from csa2.config import YarnScaling
from csa2.rope import apply_rope, rope_frequencies

RELEASED_YARN = YarnScaling(factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0, beta_slow=1.0)


def _spec_yarn_freqs_64(base, factor, orig, beta_fast, beta_slow):
    """SPEC §7 written out literally for rope_dim = 64 (independent of csa2.rope)."""
    freqs = base ** (-np.arange(0, 64, 2, dtype=np.float64) / 64)

    def corr(r):
        return 64 * np.log(orig / (2 * np.pi * r)) / (2 * np.log(base))

    low = max(np.floor(corr(beta_fast)), 0)
    high = min(np.ceil(corr(beta_slow)), 63)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(32) - low) / (high - low), 0, 1)
    return freqs / factor * ramp + freqs * (1 - ramp)


def test_plain_frequencies():
    np.testing.assert_allclose(rope_frequencies(4, 10000.0), [1.0, 0.01], rtol=1e-7)
    f = rope_frequencies(64, 10000.0)
    assert f.shape == (32,) and f.dtype == np.float32
    np.testing.assert_allclose(f, 10000.0 ** (-np.arange(0, 64, 2) / 64), rtol=1e-6)


def test_hand_computed_rope_dim_4():
    # D = 6: channels 0-1 pass through, channels 2-5 are the rope slice (pairs (2,3), (4,5)).
    freqs = np.array([1.0, 0.5], np.float32)
    x = np.array([[7.0, -8.0, 1.0, 2.0, 3.0, 4.0]] * 2, np.float32)
    out = np.asarray(apply_rope(jnp.asarray(x), jnp.array([0, 3], jnp.int32), freqs))
    np.testing.assert_allclose(out[0], x[0], rtol=0, atol=0)  # position 0: identity
    c1, s1, c2, s2 = math.cos(3.0), math.sin(3.0), math.cos(1.5), math.sin(1.5)
    expected = [7.0, -8.0, 1 * c1 - 2 * s1, 1 * s1 + 2 * c1, 3 * c2 - 4 * s2, 3 * s2 + 4 * c2]
    np.testing.assert_allclose(out[1], expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("yarn", [None, RELEASED_YARN])
def test_inverse_roundtrip(yarn):
    freqs = rope_frequencies(64, 160000.0 if yarn else 10000.0, yarn)
    kx, kp = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (2, 5, 3, 96), jnp.float32)
    pos = jax.random.randint(kp, (2, 5, 1), 0, 100_000)
    back = apply_rope(apply_rope(x, pos, freqs), pos, freqs, inverse=True)
    np.testing.assert_allclose(back, x, atol=1e-5)
    back = apply_rope(apply_rope(x, pos, freqs, inverse=True), pos, freqs)
    np.testing.assert_allclose(back, x, atol=1e-5)
    # Conjugate rotation == rotation by the negated position.
    np.testing.assert_allclose(apply_rope(x, pos, freqs, inverse=True), apply_rope(x, -pos, freqs), atol=1e-6)


def test_yarn_matches_spec_formula_released():
    ours = rope_frequencies(64, 160000.0, RELEASED_YARN)
    ref = _spec_yarn_freqs_64(160000.0, 16.0, 65536, 32.0, 1.0)
    assert ours.shape == (32,) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, ref, rtol=1e-6)
    plain = rope_frequencies(64, 160000.0)
    # Released numbers: low = floor(15.46) = 15, high = ceil(24.71) = 25.
    np.testing.assert_array_equal(ours[:16], plain[:16])  # high frequency: extrapolated (unchanged)
    np.testing.assert_allclose(ours[25:], plain[25:] / 16.0, rtol=1e-6)  # low frequency: interpolated
    ratio = ours[16:25] / plain[16:25]
    assert np.all((ratio < 1) & (ratio > 1 / 16)) and np.all(np.diff(ratio) < 0)


def test_yarn_generalizes_to_small_rope_dim():
    # rope_dim 8: corr(32) = 1.93 -> low 1; corr(1) = 3.09 -> high 4 (clip at rope_dim-1 = 7).
    f = rope_frequencies(8, 160000.0, RELEASED_YARN)
    plain = rope_frequencies(8, 160000.0)
    ramp = np.clip((np.arange(4) - 1) / 3, 0, 1)
    np.testing.assert_allclose(f, plain / 16 * ramp + plain * (1 - ramp), rtol=1e-6)


def test_yarn_degenerate_range_does_not_divide_by_zero():
    # beta_fast == beta_slow makes low == high: SPEC adds 0.001 to high.
    f = rope_frequencies(64, 160000.0, YarnScaling(16.0, 65536, 8.0, 8.0))
    assert np.all(np.isfinite(f))


def test_norm_preserved_and_non_rope_dims_unchanged():
    freqs = rope_frequencies(16, 10000.0)
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 7, 40), jnp.float32)
    pos = jnp.arange(28, dtype=jnp.int32).reshape(4, 7) * 997
    out = apply_rope(x, pos, freqs)
    np.testing.assert_array_equal(out[..., :24], x[..., :24])
    np.testing.assert_allclose(jnp.linalg.norm(out, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5)
    pair_norm = lambda t: jnp.linalg.norm(t[..., 24:].reshape(4, 7, 8, 2), axis=-1)  # noqa: E731
    np.testing.assert_allclose(pair_norm(out), pair_norm(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("yarn", [None, RELEASED_YARN])
def test_rotation_is_relative(yarn):
    freqs = rope_frequencies(64, 160000.0 if yarn else 10000.0, yarn)
    kq, kk = jax.random.split(jax.random.PRNGKey(2))
    q = jax.random.normal(kq, (64,), jnp.float32)
    k = jax.random.normal(kk, (64,), jnp.float32)

    def dot(p, pp):
        return jnp.dot(apply_rope(q, jnp.int32(p), freqs), apply_rope(k, jnp.int32(pp), freqs))

    for delta in (0, 3, 40):
        vals = [dot(base + delta, base) for base in (0, 17, 500, 2047)]
        np.testing.assert_allclose(vals, vals[0], atol=2e-3)
    assert abs(dot(3, 0) - dot(0, 3)) > 1e-3  # not symmetric in general: depends on the sign of p - p'


def test_head_broadcast_convention_and_jit():
    freqs = rope_frequencies(8, 10000.0)
    x = jax.random.normal(jax.random.PRNGKey(3), (2, 5, 3, 16), jnp.float32)
    pos = jnp.array([[0, 1, 2, 3, 4], [9, 8, 7, 6, 5]], jnp.int32)
    out = jax.jit(apply_rope)(x, pos[:, :, None], freqs)
    for h in range(3):
        np.testing.assert_allclose(out[:, :, h], apply_rope(x[:, :, h], pos, freqs), atol=1e-6)


def test_garbage_positions_finite_and_dtype_kept():
    freqs = rope_frequencies(64, 160000.0, RELEASED_YARN)
    x = jax.random.normal(jax.random.PRNGKey(4), (6, 128), jnp.float32).astype(jnp.bfloat16)
    info = np.iinfo(np.int32)
    pos = jnp.array([-1, -12345, info.min, info.max, 0, 1 << 20], jnp.int32)
    out = apply_rope(x, pos, freqs)
    assert out.dtype == jnp.bfloat16 and out.shape == x.shape
    assert bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
    np.testing.assert_allclose(
        jnp.linalg.norm(out.astype(jnp.float32), axis=-1), jnp.linalg.norm(x.astype(jnp.float32), axis=-1), rtol=2e-2
    )


def test_rejects_bad_shapes():
    with pytest.raises(ValueError):
        rope_frequencies(7, 10000.0)
    with pytest.raises(ValueError):
        apply_rope(jnp.zeros((2, 4)), jnp.zeros((2,), jnp.int32), rope_frequencies(8, 10000.0))
