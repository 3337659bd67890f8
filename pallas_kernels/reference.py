"""jnp oracles of the kernels (the `impl="xla"` path), same signatures, same math (SPEC §3, §5).

They gather first and dequantize after the gather, like `csa2.cache.gather`, with the shared
bit-level decoders of `_formats` (bit-identical to `csa2.quant.dequantize`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _common
from pallas_kernels._formats import load_entries, stored

Array = jax.Array


def gather_entries(data: Array, scale: Array | None, idx: Array, kind: str) -> tuple[Array, Array]:
    """Rows `idx [B, ...]` of per-row buffers `[B, N, ·]` as float32 `[B, ..., D]`, and their validity.

    An id is valid iff 0 ≤ id < N; invalid ids read row 0 and are masked by the caller.
    """
    data, scale = stored(data, scale)
    n = data.shape[1]
    valid = (idx >= 0) & (idx < n)
    rows = jnp.where(valid, idx, 0)
    take = jax.vmap(lambda buf, i: buf[i])
    scale_rows = None if scale is None else take(scale, rows)
    return load_entries(take(data, rows), scale_rows, kind), valid


def sink_softmax(q: Array, keys: Array, valid: Array, sink: Array) -> Array:
    """One softmax over entries with the per-head sink in the denominator only (SPEC §3).

    q [B, S, H, D], keys [B, S, E, D] (K = V), valid [B, S, E], sink [H] → [B, S, H, D] float32;
    a row with no valid entry returns 0. Same math as `csa2.attention.sink_attention`.
    """
    scale = q.shape[-1] ** -0.5
    logits = jnp.einsum("bshd,bsed->bshe", q.astype(jnp.float32), keys, precision=lax.Precision.HIGHEST) * scale
    logits = jnp.where(valid[:, :, None, :], logits, -jnp.inf)
    sink = sink.astype(jnp.float32)[None, None, :]  # [1, 1, H]
    m = jnp.maximum(jnp.max(logits, axis=-1), sink)  # [B, S, H], finite thanks to the sink
    p = jnp.exp(logits - m[..., None])
    denom = jnp.sum(p, axis=-1) + jnp.exp(sink - m)
    return jnp.einsum("bshe,bsed->bshd", p, keys, precision=lax.Precision.HIGHEST) / denom[..., None]


@jax.jit
def sparse_attention(q, sink, main, main_scale, main_idx, window, window_scale, window_idx) -> Array:
    """Top-k Global entries (`main_idx`, −1 = skip) and window rows (`window_idx`) in one sink softmax.

    See `ops.sparse_attention` for shapes. → [B, S, H, D] float32.
    """
    _common.check_sparse_attention(q, sink, main, main_scale, main_idx, window, window_scale, window_idx)
    main_keys, main_valid = gather_entries(main, main_scale, main_idx, "main")  # [B, S, K, D]
    win_keys, win_valid = gather_entries(window, window_scale, window_idx, "window")  # [B, S, W, D]
    keys = jnp.concatenate([main_keys, win_keys], axis=2)
    return sink_softmax(q, keys, jnp.concatenate([main_valid, win_valid], axis=2), sink)


def _weighted_relu(dots: Array, w: Array) -> Array:
    """Σ_h w_h · relu(dots_h): dots [B, S, Hi, P], w [B, S, Hi] → [B, S, P] float32."""
    return jnp.einsum("bshn,bsh->bsn", jax.nn.relu(dots), w.astype(jnp.float32), precision=lax.Precision.HIGHEST)


@jax.jit
def indexer_scores(q, w, ikey, ikey_scale, visible) -> Array:
    """Σ_h w_h · relu(qI_h · k_n) over all entries [B, S, N] float32, −inf where n ≥ visible[b, s] (SPEC §5)."""
    _common.check_indexer(q, w, ikey, ikey_scale, visible)
    keys = load_entries(*stored(ikey, ikey_scale), "index")  # [B, N, Di]
    dots = jnp.einsum("bshd,bnd->bshn", q.astype(jnp.float32), keys, precision=lax.Precision.HIGHEST)
    n = keys.shape[1]
    seen = jnp.arange(n, dtype=jnp.int32) < visible[..., None]  # [B, S, N]
    return jnp.where(seen, _weighted_relu(dots, w), -jnp.inf)


@jax.jit
def indexer_scores_gathered(q, w, ikey, ikey_scale, ids, visible) -> Array:
    """Scores of the candidate positions `ids [B, S, P]` only (Reindex, SPEC §5): gather, then score.

    → [B, S, P] float32, −inf where id < 0 or id ≥ visible[b, s] (or id ≥ N).
    """
    _common.check_indexer(q, w, ikey, ikey_scale, visible)
    if ids.ndim != 3 or ids.shape[:2] != q.shape[:2]:
        raise ValueError(f"ids.shape={ids.shape}: expected [B, S, P] int32 candidate ids with B, S of q {q.shape[:2]}")
    keys, valid = gather_entries(ikey, ikey_scale, ids, "index")  # [B, S, P, Di]
    dots = jnp.einsum("bshd,bspd->bshp", q.astype(jnp.float32), keys, precision=lax.Precision.HIGHEST)
    valid = valid & (ids < visible[..., None])
    return jnp.where(valid, _weighted_relu(dots, w), -jnp.inf)


@functools.partial(jax.jit, static_argnames="block")
def block_max(scores: Array, block: int) -> Array:
    """Max of each run of `block` entries: scores [B, S, N] → [B, S, ceil(N / block)] (tail padded with −inf)."""
    if block < 1 or scores.ndim != 3:
        raise ValueError(f"block_max: scores.shape={scores.shape}, block={block}; expected [B, S, N] and block ≥ 1")
    b, s, n = scores.shape
    blocks = -(-n // block)
    padded = _common.pad_axis(scores, 2, blocks * block, -jnp.inf)
    return padded.reshape(b, s, blocks, block).max(-1)
