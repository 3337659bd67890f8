"""Shared inputs and independent numpy oracles for the kernel tests (imports pallas_kernels only, never csa2).

The oracles decode stored entries with ml_dtypes casts and compute in float64 numpy, so they share no
code with `pallas_kernels.reference` (the `impl="xla"` backend) or the kernels.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels import formats, ops
from pallas_kernels.formats import INDEX, MAIN, WINDOW
from pallas_kernels.stored import Stored

TOL = dict(rtol=1e-5, atol=1e-5)

_quantized = jax.jit(Stored.quantized, static_argnums=1)
_fake_quant = jax.jit(lambda x, fmt: formats.dequantize(*formats.quantize(x, fmt), fmt), static_argnums=1)

# Independent of the QuantFormat fields: the SPEC §8 types, named by hand.
_SCALE_TYPE = {"main": ml_dtypes.float8_e4m3fn, "index": ml_dtypes.float8_e8m0fnu, "window": ml_dtypes.float8_e8m0fnu}
_BLOCK = {"main": 16, "index": 32, "window": 32}
_F32_MAX = float(np.finfo(np.float32).max)


# --- SPEC §8 scale oracles and block inputs --------------------------------------------------------

def rows_with_amax(fmt, values, amax):
    """One block per value: [amax, value, 0, ...], so every block has the same scale."""
    x = np.zeros((len(values), fmt.block), np.float32)
    x[:, 0] = amax
    x[:, 1] = values
    return x


def ref_scales(fmt, x):
    """SPEC §8 scale formulas evaluated independently in float64 numpy / ml_dtypes."""
    xb = np.asarray(x, np.float64).reshape(*x.shape[:-1], -1, fmt.block)
    amax = np.abs(xb).max(-1)
    if fmt.name == "main":
        t = np.maximum(amax, 6 * 2.0**-9) / 6
        # Clamp to the e4m3 max before the cast (documented decision; ml_dtypes gives NaN).
        return np.minimum(t, 448.0).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    if fmt.name == "index":
        return 2.0 ** np.ceil(np.log2(np.maximum(amax, 6 * 2.0**-126) / 6))
    return 2.0 ** np.ceil(np.log2(np.maximum(amax, 1e-4) / 448))


def random_blocks(fmt, shape, seed, lo=-20, hi=20):
    """Random normal data with a log-uniform magnitude 2^[lo, hi) per block."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    mag = 2.0 ** rng.uniform(lo, hi, (*shape[:-1], shape[-1] // fmt.block, 1))
    return (x.reshape(*shape[:-1], -1, fmt.block) * mag).reshape(shape).astype(np.float32)


def check_scores(x, want, seen):
    """Indexer scores `x` are float32 of the oracle's shape, −inf exactly where nothing is `seen`, else `want`."""
    x = np.asarray(x)
    assert x.dtype == np.float32 and x.shape == want.shape
    np.testing.assert_array_equal(np.isneginf(x), ~seen)
    np.testing.assert_allclose(x, want, **TOL)


def check_score_grads(scores, r, q, w):
    """The (q, w) gradients of Σ r·scores (finite entries) are nonzero and equal on every backend;
    `scores(q, w, impl)` computes the scores."""
    def loss(q, w, impl):
        out = scores(q, w, impl)
        return jnp.sum(jnp.where(jnp.isfinite(out), out * r, 0.0))

    grads = {impl: jax.grad(functools.partial(loss, impl=impl), argnums=(0, 1))(q, w) for impl in ops.IMPLS}
    for want, got in zip(grads["xla"], grads["pallas"]):
        assert np.abs(np.asarray(want)).max() > 0
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def stored(x, fmt, packed):
    """Values `x [..., D]` as stored: packed (quantized), or float32 fake-quantized (the QAT / float cache)."""
    x = jnp.asarray(x, jnp.float32)
    return _quantized(x, fmt) if packed else Stored(_fake_quant(x, fmt), None, fmt)


def np_payload_values(payload, fmt_name):
    """float64 payload values [..., D] from a packed payload, through ml_dtypes casts."""
    p = np.asarray(payload)
    if fmt_name == "window":
        return p.view(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    p = p.view(np.uint8)
    codes = np.stack([p & 15, p >> 4], axis=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])  # low nibble first
    return codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)


def np_dequantize(payload, scale, fmt_name):
    """float64 entries [..., D] of (payload, scale) decoded with ml_dtypes (saturated to ±float32 max)."""
    vals = np_payload_values(payload, fmt_name)
    block = _BLOCK[fmt_name]
    s = np.asarray(scale).view(np.uint8).view(_SCALE_TYPE[fmt_name]).astype(np.float64)
    out = vals.reshape(*vals.shape[:-1], -1, block) * s[..., None]
    return np.clip(out, -_F32_MAX, _F32_MAX).reshape(vals.shape)


def np_entries(st: Stored):
    """float64 values of every entry of a Stored buffer (float storage is read as is)."""
    if st.scale is None:
        return np.asarray(st.payload, np.float64)
    return np_dequantize(st.payload, st.scale, st.fmt.name)


def np_gather(values, idx):
    """values [B, rows, D], idx [B, ...] → ([B, ..., D], valid): ids outside [0, rows) masked (read row 0)."""
    idx = np.asarray(idx)
    valid = (idx >= 0) & (idx < values.shape[1])
    safe = np.where(valid, idx, 0)
    batch = np.arange(idx.shape[0]).reshape(-1, *([1] * (idx.ndim - 1)))
    return values[batch, safe], valid


def np_sink_attention(q, keys, valid, sink):
    """Softmax over [logits, sink] (float64), dropping the sink column, then Σ p·kv (K = V). [B, S, H, D]."""
    q = np.asarray(q, np.float64)
    keys = np.asarray(keys, np.float64)
    logits = np.einsum("bshd,bsed->bshe", q, keys) / np.sqrt(q.shape[-1])
    logits = np.where(np.asarray(valid)[:, :, None, :], logits, -np.inf)
    sink = np.broadcast_to(np.asarray(sink, np.float64)[None, None, :, None], (*logits.shape[:3], 1))
    full = np.concatenate([logits, sink], axis=-1)
    p = np.exp(full - full.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bshe,bsed->bshd", p[..., :-1], keys)


def np_index_scores(q, w, keys):
    """Σ_h w_h · relu(q_h · k) in float64: q [B, S, H, D], w [B, S, H], keys [B, (S,) N, D] → [B, S, N]."""
    q, w, keys = (np.asarray(a, np.float64) for a in (q, w, keys))
    dots = np.einsum("bshd,bnd->bshn", q, keys) if keys.ndim == 3 else np.einsum("bshd,bsnd->bshn", q, keys)
    return np.einsum("bshn,bsh->bsn", np.maximum(dots, 0.0), w)


def np_window_ids(positions, starts, window, slots):
    """Window positions [B, S, W] (oldest first) and their rows in concat(ring [slots], chunk)."""
    positions, starts = np.asarray(positions), np.asarray(starts)
    pos = positions[..., None] - (window - 1) + np.arange(window)
    in_chunk = pos >= starts[:, None, None]
    return pos, np.where(in_chunk, slots + pos - starts[:, None, None], pos % slots)


def np_select_topk(scores, valid, k):
    """Top-min(k, n) valid columns (ties: lower column first), sorted ascending and −1-padded to k."""
    scores, valid = np.asarray(scores), np.asarray(valid)
    n = scores.shape[-1]
    masked = np.where(valid, scores, -np.inf)
    col = np.argsort(-masked, axis=-1, kind="stable")[..., :min(k, n)]
    keep = np.take_along_axis(valid, col, axis=-1)
    chosen = np.sort(np.where(keep, col, n), axis=-1)
    chosen = np.where(chosen == n, -1, chosen)
    return np.pad(chosen, [(0, 0)] * (chosen.ndim - 1) + [(0, k - chosen.shape[-1])], constant_values=-1)


def same_topk(a, b, valid, k):
    np.testing.assert_array_equal(np_select_topk(a, valid, k), np_select_topk(b, valid, k))


# --- sparse attention -----------------------------------------------------------------------------

def attention_case(seed, *, b, s, h, d, n, k, window, slots, starts, floors, packed_main=True, packed_win=True):
    """A chunk at `starts` over a ring of `slots` (partially filled / wrapped) plus random top-k ids.

    → ((q, sink, main, main_idx, window, window_idx), (pos, ids, win_valid)) where `ids` are the
    unmasked window rows and `win_valid` their validity (window_idx = where(win_valid, ids, −1)).
    """
    rng = np.random.default_rng(seed)
    starts, floors = np.asarray(starts, np.int32), np.asarray(floors, np.int32)
    positions = starts[:, None] + np.arange(s, dtype=np.int32)[None]
    ring = rng.standard_normal((b, slots, d))
    chunk = rng.standard_normal((b, s, d))
    win = stored(np.concatenate([ring, chunk], axis=1), WINDOW, packed_win)
    pos, ids = np_window_ids(positions, starts, window, slots)
    win_valid = pos >= np.maximum(floors, 0)[:, None, None]
    win_idx = jnp.asarray(np.where(win_valid, ids, -1), jnp.int32)
    main = stored(rng.standard_normal((b, n, d)) * 2, MAIN, packed_main)
    main_idx = rng.integers(0, n, (b, s, k))
    main_idx[rng.random((b, s, k)) < 0.3] = -1  # −1 anywhere
    main_idx[0, -1] = -1  # a row with no Global entry
    main_idx = jnp.asarray(main_idx, jnp.int32)
    q = jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.float32)
    sink = jnp.asarray(rng.standard_normal(h), jnp.float32)
    return (q, sink, main, main_idx, win, win_idx), (pos, ids, win_valid)


ATTENTION_CASES = {
    # prefill-like chunk: top-k 37 (not a multiple of the block), wrapped ring, replay floor on row 1
    "chunk": dict(b=2, s=3, h=4, d=64, n=40, k=37, window=8, slots=10, starts=[23, 5], floors=[0, 6]),
    # decode: one row per sequence; row 0 on an almost empty ring (floor cuts everything), row 2 wrapped
    "decode": dict(b=3, s=1, h=2, d=32, n=24, k=13, window=4, slots=6, starts=[0, 3, 17], floors=[1, 0, 15]),
}


def np_sparse_attention(args):
    """The oracle of sparse_attention from the op's own arguments: gather both sources, one sink softmax."""
    q, sink, main, main_idx, win, win_idx = args
    main_keys, main_valid = np_gather(np_entries(main), main_idx)
    win_keys, win_valid = np_gather(np_entries(win), win_idx)
    keys = np.concatenate([main_keys, win_keys], axis=2)
    return np_sink_attention(q, keys, np.concatenate([main_valid, win_valid], axis=2), sink)


def attention_grads(fn, args, r):
    """d/d(q, sink, main, window) of Σ r·fn(args) for a sparse attention `fn` (float0 for integer leaves: packed
    bits, ids)."""
    q, sink, main, main_idx, win, win_idx = args
    loss = lambda q, sink, main, win: jnp.sum(fn(q, sink, main, main_idx, win, win_idx) * r)  # noqa: E731
    return jax.grad(loss, argnums=(0, 1, 2, 3), allow_int=True)(q, sink, main, win)


def check_same_grads(want, got):
    """`attention_grads` of two implementations agree leaf by leaf (dtype, shape, values to 1e-5), and every float
    gradient is live."""
    for name, w, g in zip(("q", "sink", "main", "window"), want, got):
        for wl, gl in zip(jax.tree.leaves(w), jax.tree.leaves(g)):
            assert wl.dtype == gl.dtype and wl.shape == gl.shape, name
            if wl.dtype != jax.dtypes.float0:
                assert np.abs(np.asarray(wl)).max() > 0, name
                np.testing.assert_allclose(gl, wl, rtol=1e-5, atol=1e-5, err_msg=name)


def empty_rows(main_idx, main_rows, win_idx, win_rows):
    """[B, S] rows with no valid entry in either source."""
    main_idx, win_idx = np.asarray(main_idx), np.asarray(win_idx)
    return ~(((main_idx >= 0) & (main_idx < main_rows)).any(-1) | ((win_idx >= 0) & (win_idx < win_rows)).any(-1))


# --- indexer ----------------------------------------------------------------------------------------

def indexer_case(seed, *, b, s, hi, di, n, pool, packed=True):
    """→ (q, w, ikey, ids, visible): q fake-quantized to INDEX (as the model feeds it), ids with −1s."""
    rng = np.random.default_rng(seed)
    q = _fake_quant(jnp.asarray(rng.standard_normal((b, s, hi, di)), jnp.float32), INDEX)
    w = jnp.asarray(rng.standard_normal((b, s, hi)) * (di * hi) ** -0.5, jnp.float32)
    ikey = stored(rng.standard_normal((b, n, di)), INDEX, packed)
    visible = jnp.asarray(rng.integers(0, n + 1, (b, s)), jnp.int32).at[0, 0].set(n).at[-1, -1].set(0)
    ids = rng.integers(0, n, (b, s, pool))
    ids[rng.random((b, s, pool)) < 0.25] = -1
    return q, w, ikey, jnp.asarray(ids, jnp.int32), visible


def traced(kernel, *args, **options):
    """`kernel` (a public Pallas op of `pallas_kernels`, with its `target=` and tuning options) traced for
    `args` (`jax.ShapeDtypeStruct`s): `.lower(lowering_platforms=...)` checks a lowering without the device."""
    return jax.jit(functools.partial(kernel, **options)).trace(*args)
