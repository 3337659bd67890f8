"""Pallas sparse sink attention over gathered Global entries and SWA window rows (SPEC §3).

For each query row (b, s) and block of heads, the kernel walks the row's top-k Main KV ids in
blocks of `block_k`, gathers those rows of the **packed** cache (e2m1 payload + e4m3 scales) with
a vector-indexed ref load, dequantizes them in registers, and folds them into an online softmax;
then does the same for the row's window ids over the layer's FP8 ring. The online max starts at
the head's sink logit, so the sink (denominator only) is exact and a row with no valid entry
yields 0. Nothing dequantized is ever written back to memory.

Grid `(B, S, H / block_h, splits)`. With `splits > 1` (decode: few rows, flash-decoding style)
each split takes an equal slice of the main ids and of the window ids and writes unnormalized
partials (acc, max, sum), merged with the sink in XLA.

Backend notes: every in-kernel array has power-of-two dims when D, block_h, block_k, block_w are
powers of two (Triton), and dots are 2-D with M = block_h ≥ 16 on GPU. The gather is a pointer
gather in Triton (as in jax's GPU paged attention); Mosaic (TPU) cannot lower it — a TPU port
needs scalar-prefetched ids and per-row DMAs (see `_common.resolve_target`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _common
from pallas_kernels.formats import MAIN, WINDOW, decode_entries
from pallas_kernels.stored import Stored

Array = jax.Array


def _attend(q, kv, valid, carry, scale):
    """One online-softmax step: q [BH, D], kv [E, D] (K = V), valid [E]."""
    m, l, acc = carry
    s = lax.dot_general(q, kv, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                        preferred_element_type=jnp.float32) * scale  # [BH, E]
    s = jnp.where(valid[None, :], s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))  # m starts at the sink: always finite
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + lax.dot_general(p, kv, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                                                 preferred_element_type=jnp.float32)
    return m_new, l, acc


def _kernel(*refs, packed_main: bool, packed_win: bool, block_k: int, block_w: int, normalize: bool):
    it = iter(refs)
    q_ref, sink_ref = next(it), next(it)
    main_ref = next(it)
    main_scale_ref = next(it) if packed_main else None
    main_idx_ref = next(it)
    win_ref = next(it)
    win_scale_ref = next(it) if packed_win else None
    win_idx_ref = next(it)
    out_refs = list(it)

    q = q_ref[...].astype(jnp.float32)  # [BH, D]
    scale = q.shape[-1] ** -0.5
    sink = sink_ref[...].astype(jnp.float32)  # [BH]

    def source(data_ref, scale_ref, idx_ref, block, fmt):
        rows = data_ref.shape[0]

        def body(j, carry):
            idx = idx_ref[pl.ds(j * block, block)]  # [block] int32
            valid = (idx >= 0) & (idx < rows)
            row = jnp.where(valid, idx, 0)  # gather address: always in bounds
            kv = decode_entries(data_ref[row, :], None if scale_ref is None else scale_ref[row, :], fmt)
            return _attend(q, kv, valid, carry, scale)

        return idx_ref.shape[0] // block, body

    carry = (sink, jnp.zeros_like(sink), jnp.zeros(q.shape, jnp.float32))
    for data_ref, scale_ref, idx_ref, block, fmt in (
            (main_ref, main_scale_ref, main_idx_ref, block_k, MAIN),
            (win_ref, win_scale_ref, win_idx_ref, block_w, WINDOW)):
        steps, body = source(data_ref, scale_ref, idx_ref, block, fmt)
        carry = lax.fori_loop(0, steps, body, carry)
    m, l, acc = carry
    if normalize:
        (o_ref,) = out_refs
        o_ref[...] = acc / (l + jnp.exp(sink - m))[:, None]
    else:
        acc_ref, m_ref, l_ref = out_refs
        acc_ref[...], m_ref[...], l_ref[...] = acc, m, l


def _nonempty(data, scale, idx):
    """A source with no ids gets one row of −1 ids over a one-row dummy buffer (SWA-only layers)."""
    if idx.shape[-1] > 0 and data.shape[1] > 0:
        return data, scale, idx
    b, s = idx.shape[:2]
    data = jnp.zeros((b, 1, data.shape[2]), data.dtype)
    scale = None if scale is None else jnp.zeros((b, 1, scale.shape[2]), scale.dtype)
    return data, scale, jnp.full((b, s, 1), -1, jnp.int32)


@functools.partial(jax.jit, static_argnames=("target", "block_h", "block_k", "block_w", "num_splits", "num_warps"))
def _sparse_attention(q, sink, main: Stored, main_idx, window: Stored, window_idx, *, target: str,
                      block_h: int | None, block_k: int, block_w: int, num_splits: int | None, num_warps: int):
    b, s, h, d = q.shape
    main, main_scale, main_idx = _nonempty(*main.bits(), main_idx.astype(jnp.int32))
    window, window_scale, window_idx = _nonempty(*window.bits(), window_idx.astype(jnp.int32))
    k, w = main_idx.shape[-1], window_idx.shape[-1]

    # Head block: all heads in the interpreter; on GPU a power of two ≥ 16 (Triton dot M ≥ 16).
    interpret = target == "interpret"
    bh = h if block_h is None and interpret else (block_h or 16)
    if not interpret:
        bh = max(16, _common.next_pow2(bh))
    hp = _common.round_up(h, bh)
    n_hb = hp // bh
    least = _common.min_block(target)
    if num_splits is None:  # decode: split the entries so ~128 programs run at once (GPU only)
        num_splits = 1 if interpret else max(1, min(-(-k // min(block_k, _common.next_pow2(k))),
                                                  128 // (b * s * n_hb)))
    # Entries per online-softmax step: a power of two, no larger than one split's share.
    kb = max(least, min(block_k, _common.next_pow2(-(-k // num_splits))))
    wb = max(least, min(block_w, _common.next_pow2(-(-w // num_splits))))
    kp, wp = _common.round_up(k, num_splits * kb), _common.round_up(w, num_splits * wb)
    main_idx = _common.pad_axis(main_idx, 2, kp, -1)
    window_idx = _common.pad_axis(window_idx, 2, wp, -1)
    q = _common.pad_axis(q, 2, hp, 0)
    sink = _common.pad_axis(sink.astype(jnp.float32), 0, hp, 0)

    def whole_row(x):  # the row's whole buffer; the kernel gathers from it
        return pl.BlockSpec((None, *x.shape[1:]), lambda b_, s_, h_, p_: (b_, 0, 0))

    def ids_spec(per_split):
        return pl.BlockSpec((None, None, per_split), lambda b_, s_, h_, p_: (b_, s_, p_))

    operands = [q, sink, main] + ([main_scale] if main_scale is not None else []) + [main_idx, window] + (
        [window_scale] if window_scale is not None else []) + [window_idx]
    in_specs = [pl.BlockSpec((None, None, bh, d), lambda b_, s_, h_, p_: (b_, s_, h_, 0)),
                pl.BlockSpec((bh,), lambda b_, s_, h_, p_: (h_,)),
                whole_row(main)] + ([whole_row(main_scale)] if main_scale is not None else []) + [
                ids_spec(kp // num_splits), whole_row(window)] + (
                [whole_row(window_scale)] if window_scale is not None else []) + [ids_spec(wp // num_splits)]
    normalize = num_splits == 1
    if normalize:
        out_shape = jax.ShapeDtypeStruct((b, s, hp, d), jnp.float32)
        out_specs = pl.BlockSpec((None, None, bh, d), lambda b_, s_, h_, p_: (b_, s_, h_, 0))
    else:
        out_shape = (jax.ShapeDtypeStruct((num_splits, b, s, hp, d), jnp.float32),
                     jax.ShapeDtypeStruct((num_splits, b, s, hp), jnp.float32),
                     jax.ShapeDtypeStruct((num_splits, b, s, hp), jnp.float32))
        out_specs = (pl.BlockSpec((None, None, None, bh, d), lambda b_, s_, h_, p_: (p_, b_, s_, h_, 0)),
                     pl.BlockSpec((None, None, None, bh), lambda b_, s_, h_, p_: (p_, b_, s_, h_)),
                     pl.BlockSpec((None, None, None, bh), lambda b_, s_, h_, p_: (p_, b_, s_, h_)))
    kernel = functools.partial(_kernel, packed_main=main_scale is not None, packed_win=window_scale is not None,
                               block_k=kb, block_w=wb, normalize=normalize)
    out = pl.pallas_call(
        kernel, grid=(b, s, n_hb, num_splits), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        interpret=_common.interpret_arg(target), compiler_params=_common.compiler_params(target, num_warps, 4),
        name="csa2_sparse_attention",
    )(*operands)
    if not normalize:  # merge the splits' partials, then the sink (denominator only)
        acc, m_p, l_p = out
        m = jnp.max(m_p, axis=0)  # [B, S, Hp]; every split's max already includes the sink
        corr = jnp.exp(m_p - m)
        l = jnp.sum(l_p * corr, axis=0)
        out = jnp.sum(acc * corr[..., None], axis=0) / (l + jnp.exp(sink - m))[..., None]
    return out[:, :, :h]


def sparse_attention(q, sink, main: Stored, main_idx, window: Stored, window_idx, *,
                     interpret: bool | None = None, block_h: int | None = None, block_k: int = 64,
                     block_w: int = 64, num_splits: int | None = None, num_warps: int = 4) -> Array:
    """Pallas version of `reference.sparse_attention` (see `ops.sparse_attention` for shapes).

    block_h: heads per program (default: all heads in the interpreter, 16 on GPU);
    block_k / block_w: main / window entries per online-softmax step (powers of two);
    num_splits: entry splits per row (default 1 in the interpreter; on GPU enough for ~128 programs).
    """
    _common.check_sparse_attention(q, sink, main, main_idx, window, window_idx)
    for name, v in (("block_k", block_k), ("block_w", block_w), ("block_h", block_h or 1)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name}={v}: must be a power of two (Triton block shapes)")
    return _sparse_attention(q, sink, main, main_idx, window, window_idx,
                             target=_common.resolve_target(interpret, "sparse_attention", False), block_h=block_h,
                             block_k=block_k, block_w=block_w, num_splits=num_splits, num_warps=num_warps)
