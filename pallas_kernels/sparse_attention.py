"""Pallas sparse sink attention over gathered Global entries and SWA window rows (SPEC §3).

For each query row (b, s) the kernel walks the row's top-k Main KV ids in blocks of `block_k`,
gathers those rows of the **packed** cache (e2m1 payload + e4m3 scales), dequantizes them in
registers, and folds them into an online softmax; then does the same for the row's window ids over
the layer's FP8 ring. The online max starts at the head's sink logit, so the sink (denominator only)
is exact and a row with no valid entry yields 0. Nothing dequantized is ever written back to memory.
With `splits > 1` (decode: few rows, flash-decoding style) each split takes an equal slice of the
main ids and of the window ids and writes unnormalized partials (acc, max, sum), merged with the
sink in XLA.

Two forms gather the rows, one per kind of hardware:
- GPU (Triton) and the generic interpreter, grid `(B, S, H / block_h, splits)`: each program sees its
  row's whole buffers and gathers with a vector-indexed ref load (a pointer gather in Triton, as in
  jax's GPU paged attention). Every in-kernel array has power-of-two dims when D, block_h, block_k,
  block_w are powers of two, and dots are 2-D with M = block_h ≥ 16.
- TPU (Mosaic) and the TPU interpreter, grid `(B, S, splits)`, all heads per program: Mosaic has no
  vector gather, so the ids sit in SMEM and drive one DMA per row from HBM into double-buffered VMEM
  slots (`row_dma`), both sources' first blocks in flight before any compute. VMEM holds 2 × block
  rows per source and one block decoded to float32 (block_k = 128 at D = 512: 256 KiB).

The backward pass (`jax.custom_vjp`) is a kernel of each form too: it recomputes each block's
probabilities from the log-normalizer the forward saved, accumulates dq, and writes each selected id's
d kv, which XLA adds into the buffer rows (float storage; packed bits and ids get no gradient).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _common, row_dma
from pallas_kernels.formats import MAIN, WINDOW, decode_entries
from pallas_kernels.stored import NO_ENTRY, Stored

Array = jax.Array


def _attend(q, kv, valid, carry, scale):
    """One online-softmax step: q [BH, D], kv [E, D] (K = V), valid [1, E]; carry m, l [BH, 1], acc [BH, D]."""
    m, l, acc = carry
    s = lax.dot_general(q, kv, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                        preferred_element_type=jnp.float32) * scale  # [BH, E]
    s = jnp.where(valid, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))  # m starts at the sink: always finite
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new)
    l = l * alpha + jnp.sum(p, axis=1, keepdims=True)
    acc = acc * alpha + lax.dot_general(p, kv, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                                        preferred_element_type=jnp.float32)
    return m_new, l, acc


def _finish(carry, sink, out_refs) -> None:
    """Write the normalized output (sink in the denominator only), or the split's partials (acc, m, l)."""
    m, l, acc = carry
    if len(out_refs) == 1:
        (o_ref,) = out_refs
        o_ref[...] = acc / (l + jnp.exp(sink - m))
    else:
        acc_ref, m_ref, l_ref = out_refs
        acc_ref[...], m_ref[...], l_ref[...] = acc, m, l


def _buffer_refs(it, packed_main: bool, packed_win: bool) -> tuple:
    """The next refs of `it`: main payload, its scale (None when float), main ids, then the window's three."""
    main_ref = next(it)
    main_scale_ref = next(it) if packed_main else None
    main_idx_ref = next(it)
    win_ref = next(it)
    win_scale_ref = next(it) if packed_win else None
    return main_ref, main_scale_ref, main_idx_ref, win_ref, win_scale_ref, next(it)


def _kernel(*refs, packed_main: bool, packed_win: bool, block_k: int, block_w: int):
    """GPU (Triton) and the generic interpreter: vector-indexed loads gather the rows."""
    it = iter(refs)
    q_ref, sink_ref = next(it), next(it)
    main_ref, main_scale_ref, main_idx_ref, win_ref, win_scale_ref, win_idx_ref = _buffer_refs(it, packed_main,
                                                                                               packed_win)
    out_refs = list(it)

    q = q_ref[...].astype(jnp.float32)  # [BH, D]
    scale = q.shape[-1] ** -0.5
    sink = sink_ref[...]  # [BH, 1]

    def source(data_ref, scale_ref, idx_ref, block, fmt):
        rows = data_ref.shape[0]

        def body(j, carry):
            idx = idx_ref[pl.ds(j * block, block)]  # [block] int32
            valid = (idx >= 0) & (idx < rows)
            row = jnp.where(valid, idx, 0)  # gather address: always in bounds
            kv = decode_entries(data_ref[row, :], None if scale_ref is None else scale_ref[row, :], fmt)
            return _attend(q, kv, valid[None, :], carry, scale)

        return idx_ref.shape[0] // block, body

    carry = (sink, jnp.zeros_like(sink), jnp.zeros(q.shape, jnp.float32))
    for data_ref, scale_ref, idx_ref, block, fmt in (
            (main_ref, main_scale_ref, main_idx_ref, block_k, MAIN),
            (win_ref, win_scale_ref, win_idx_ref, block_w, WINDOW)):
        steps, body = source(data_ref, scale_ref, idx_ref, block, fmt)
        carry = lax.fori_loop(0, steps, body, carry)
    _finish(carry, sink, out_refs)


def _tpu_kernel(*refs, packed_main: bool, packed_win: bool, steps_k: int, steps_w: int, block_k: int,
                block_w: int):
    """TPU (Mosaic): SMEM ids drive per-row DMAs from HBM into double-buffered VMEM slots (`row_dma`); the
    same ids as a VMEM block give the validity masks."""
    (main_ids, win_ids, main_ids_v, win_ids_v, q_ref, sink_ref), main, win, out_refs = _tpu_refs(
        refs, 6, 1 + packed_main, 1 + packed_win)
    q = q_ref[...].astype(jnp.float32)  # [Hp, D]
    scale = q.shape[-1] ** -0.5
    sink = sink_ref[...]  # [Hp, 1]
    carry = (sink, jnp.zeros_like(sink), jnp.zeros(q.shape, jnp.float32))
    carry = _tpu_walk((main_ids, win_ids), (main_ids_v, win_ids_v), (main, win), (steps_k, steps_w),
                      (block_k, block_w), lambda _, j, kv, valid, carry: _attend(q, kv, valid, carry, scale), carry)
    _finish(carry, sink, out_refs)


def _tpu_walk(ids, ids_v, sources, steps, blocks, step, carry):
    """Both sources' selected rows by DMA, both first blocks in flight before any compute:
    `carry = step(source, j, kv [block, D], valid [1, block], carry)`, main (source 0) then window (1)."""
    b = pl.program_id(0)
    gathers = [row_dma.RowGather(i, *src, b, block) for i, src, block in zip(ids, sources, blocks)]
    for gather, n in zip(gathers, steps):
        gather.zero()
        gather.prime(n)
    for source, (gather, idx_v, n, fmt) in enumerate(zip(gathers, ids_v, steps, (MAIN, WINDOW))):
        rows = gather.sources[0].shape[1]

        def body(j, fetched, carry, source=source, idx_v=idx_v, rows=rows, fmt=fmt):
            idx = idx_v[pl.ds(j, 1), :]  # [1, block]
            kv = decode_entries(fetched[0], fetched[1] if len(fetched) > 1 else None, fmt)
            return step(source, j, kv, (idx >= 0) & (idx < rows), carry)

        carry = gather.pipeline(n, body, carry)
    return carry


def _head_block(target: str, h: int, block_h: int | None) -> int:
    """Heads per program: all of them in the interpreter and on TPU (padded to a whole sublane tile there); on
    GPU `block_h`, a power of two ≥ 16 (Triton dot M ≥ 16)."""
    if _common.mosaic(target):
        return _common.round_up(h, 8)
    if target == "interpret":
        return block_h or h
    return max(16, _common.next_pow2(block_h or 16))


# Shared memory a Triton program may use: under A100's 164 KiB and H100/H200's 227 KiB per block.
_TRITON_SMEM_BYTES = 160 * 1024


def entry_block(target: str, n: int, block: int, splits: int, d: int, head_rows: int) -> int:
    """Entries per online-softmax step (and per DMA block): a power of two, no larger than one split's share of
    `n` entries, at least the target's smallest block. On GPU also small enough for shared memory: the
    `head_rows` float32 [block_h, D] operands plus the decoded block [E, D] twice (the dots' K and V operands;
    at D = 512 and block_h = 16 a block of 64 asks 288 KiB, which Triton refuses on an H200)."""
    if target == "triton":
        fits = (_TRITON_SMEM_BYTES // (4 * d) - head_rows) // 2
        block = min(block, 1 << max(0, fits.bit_length() - 1))
    return max(_common.min_block(target), min(block, _common.next_pow2(-(-n // splits))))


def _nonempty(data, scale, idx):
    """A source with no ids gets one row of −1 ids over a one-row dummy buffer (SWA-only layers)."""
    if idx.shape[-1] > 0 and data.shape[1] > 0:
        return data, scale, idx
    b, s = idx.shape[:2]
    data = jnp.zeros((b, 1, data.shape[2]), data.dtype)
    scale = None if scale is None else jnp.zeros((b, 1, scale.shape[2]), scale.dtype)
    return data, scale, jnp.full((b, s, 1), NO_ENTRY, jnp.int32)


def _gpu_call(q, sink, main, main_scale, main_idx, window, window_scale, window_idx, *, target, bh, kb, wb,
              splits, partials, num_warps):
    """Grid `(B, S, Hp / bh, splits)`; each program holds its row's whole buffers and gathers from them."""
    b, s, hp, d = q.shape

    def whole_row(x):  # the row's whole buffer; the kernel gathers from it
        return pl.BlockSpec((None, *x.shape[1:]), lambda b_, s_, h_, p_: (b_, 0, 0))

    def ids_spec(x):
        return pl.BlockSpec((None, None, x.shape[-1] // splits), lambda b_, s_, h_, p_: (b_, s_, p_))

    packed = [x for x in (main_scale,) if x is not None], [x for x in (window_scale,) if x is not None]
    operands = [q, sink, main, *packed[0], main_idx, window, *packed[1], window_idx]
    in_specs = [pl.BlockSpec((None, None, bh, d), lambda b_, s_, h_, p_: (b_, s_, h_, 0)),
                pl.BlockSpec((bh, 1), lambda b_, s_, h_, p_: (h_, 0)),
                whole_row(main), *map(whole_row, packed[0]), ids_spec(main_idx), whole_row(window),
                *map(whole_row, packed[1]), ids_spec(window_idx)]
    rows = lambda b_, s_, h_, p_: (b_, s_, h_, 0)  # noqa: E731
    parts = lambda b_, s_, h_, p_: (p_, b_, s_, h_, 0)  # noqa: E731
    out_shape, out_specs = _outputs(b, s, hp, d, splits, partials, bh, rows, parts)
    kernel = functools.partial(_kernel, packed_main=main_scale is not None, packed_win=window_scale is not None,
                               block_k=kb, block_w=wb)
    return pl.pallas_call(
        kernel, grid=(b, s, hp // bh, splits), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        interpret=_common.interpret_arg(target), compiler_params=_common.compiler_params(target, num_warps, 4),
        name="csa2_sparse_attention",
    )(*operands)


def _tpu_refs(refs, lead: int, n_main: int, n_win: int):
    """Split a TPU kernel's refs: `lead` operands, the main and window HBM sources, the outputs, and the
    scratch (VMEM slots, then DMA semaphores, per source)."""
    n_out = len(refs) - lead - 3 * (n_main + n_win)
    it = iter(refs)
    take = lambda n: tuple(next(it) for _ in range(n))  # noqa: E731
    lead_refs, main_src, win_src, outs = take(lead), take(n_main), take(n_win), take(n_out)
    main_slots, main_sems, win_slots, win_sems = take(n_main), take(n_main), take(n_win), take(n_win)
    return lead_refs, (main_src, main_slots, main_sems), (win_src, win_slots, win_sems), outs


def _tpu_call(q, sink, main, main_scale, main_idx, window, window_scale, window_idx, *, target, kb, wb, splits,
              partials):
    """Grid `(B, S, splits)`, all heads per program; buffers stay in HBM (`memory_space=ANY`) and each split's
    ids arrive twice: in SMEM (DMA addresses) and in VMEM as `[steps, block]` (validity masks)."""
    b, s, hp, d = q.shape

    (main_smem, main_vmem), (main_smem_spec, main_vmem_spec) = row_dma.ids_blocks(main_idx, kb, splits)
    (win_smem, win_vmem), (win_smem_spec, win_vmem_spec) = row_dma.ids_blocks(window_idx, wb, splits)
    main_src = [x for x in (main, main_scale) if x is not None]
    win_src = [x for x in (window, window_scale) if x is not None]
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    in_specs = [main_smem_spec, win_smem_spec, main_vmem_spec, win_vmem_spec,
                pl.BlockSpec((None, None, hp, d), lambda b_, s_, p_: (b_, s_, 0, 0)),
                pl.BlockSpec((hp, 1), lambda b_, s_, p_: (0, 0))] + [hbm] * (len(main_src) + len(win_src))
    rows = lambda b_, s_, p_: (b_, s_, 0, 0)  # noqa: E731
    parts = lambda b_, s_, p_: (p_, b_, s_, 0, 0)  # noqa: E731
    out_shape, out_specs = _outputs(b, s, hp, d, splits, partials, hp, rows, parts)
    scratch = row_dma.scratch(kb, *main_src) + row_dma.scratch(wb, *win_src)
    kernel = functools.partial(_tpu_kernel, packed_main=main_scale is not None, packed_win=window_scale is not None,
                               steps_k=main_vmem.shape[1], steps_w=win_vmem.shape[1], block_k=kb, block_w=wb)
    return pl.pallas_call(
        kernel, grid=(b, s, splits), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        scratch_shapes=scratch, interpret=_common.interpret_arg(target),
        compiler_params=_common.compiler_params(target, 0, 3), name="csa2_sparse_attention_tpu",
    )(main_smem, win_smem, main_vmem, win_vmem, q, sink, *main_src, *win_src)


def _outputs(b, s, hp, d, splits, partials, bh, rows, parts):
    """(out_shape, out_specs): the normalized output `[B, S, Hp, D]`, or (`partials`) each split's
    acc `[splits, B, S, Hp, D]`, m and l `[splits, B, S, Hp, 1]`."""
    if not partials:
        return jax.ShapeDtypeStruct((b, s, hp, d), jnp.float32), pl.BlockSpec((None, None, bh, d), rows)
    shapes = ((splits, b, s, hp, d), (splits, b, s, hp, 1), (splits, b, s, hp, 1))
    return (tuple(jax.ShapeDtypeStruct(x, jnp.float32) for x in shapes),
            tuple(pl.BlockSpec((None, None, None, bh, x[-1]), parts) for x in shapes))


@functools.partial(jax.jit, static_argnames=("target", "block_h", "block_k", "block_w", "num_splits", "num_warps",
                                             "with_lse"))
def _sparse_attention(q, sink, main: Stored, main_idx, window: Stored, window_idx, *, target: str,
                      block_h: int | None, block_k: int, block_w: int, num_splits: int | None, num_warps: int,
                      with_lse: bool = False):
    """The output [B, S, H, D]; with `with_lse`, also each row's log-normalizer over entries and sink
    `lse = m + log(l + exp(sink − m))` [B, S, H, 1] (what the backward pass needs)."""
    b, s, h, d = q.shape
    main, main_scale, main_idx = _nonempty(*main.bits(), main_idx.astype(jnp.int32))
    window, window_scale, window_idx = _nonempty(*window.bits(), window_idx.astype(jnp.int32))
    k, w = main_idx.shape[-1], window_idx.shape[-1]
    tpu = _common.mosaic(target)
    bh = _head_block(target, h, block_h)
    hp = _common.round_up(h, bh)
    if num_splits is None:  # decode: split the entries so the cores have programs to share
        if tpu:  # two TensorCores (megacore) share the parallel grid axes: a lone row splits in two
            num_splits = 2 if b * s == 1 and k > block_k else 1
        elif target == "triton":  # ~128 programs at once
            num_splits = max(1, min(-(-k // min(block_k, _common.next_pow2(k))), 128 // (b * s * (hp // bh))))
        else:
            num_splits = 1
    kb, wb = (entry_block(target, n, blk, num_splits, d, bh) for n, blk in ((k, block_k), (w, block_w)))
    main_idx = _common.pad_axis(main_idx, 2, _common.round_up(k, num_splits * kb), NO_ENTRY)
    window_idx = _common.pad_axis(window_idx, 2, _common.round_up(w, num_splits * wb), NO_ENTRY)
    q = _common.pad_axis(q, 2, hp, 0)
    sink = _common.pad_axis(sink.astype(jnp.float32), 0, hp, 0)[:, None]  # [Hp, 1]
    operands = (q, sink, main, main_scale, main_idx, window, window_scale, window_idx)
    partials = num_splits > 1 or with_lse
    if tpu:
        out = _tpu_call(*operands, target=target, kb=kb, wb=wb, splits=num_splits, partials=partials)
    else:
        out = _gpu_call(*operands, target=target, bh=bh, kb=kb, wb=wb, splits=num_splits, partials=partials,
                        num_warps=num_warps)
    if not partials:
        return out[:, :, :h]
    # Merge the splits' partials, then the sink (denominator only).
    acc, m_p, l_p = out
    m = jnp.max(m_p, axis=0)  # [B, S, Hp, 1]; every split's max already includes the sink
    corr = jnp.exp(m_p - m)
    denom = jnp.sum(l_p * corr, axis=0) + jnp.exp(sink - m)
    out = (jnp.sum(acc * corr, axis=0) / denom)[:, :, :h]
    return (out, (m + jnp.log(denom))[:, :, :h]) if with_lse else out


# ---------------------------------------------------------------------------------------------
# Backward pass (flash-attention style, from the saved log-normalizer; K = V, so each entry gets both terms)
#
#   p_e = exp(l_e − lse),  l_e = q·kv_e·D^-½          Δ = Σ_d dO·o
#   dl_e = p_e (dO·kv_e − Δ)                           dq = D^-½ Σ_e dl_e kv_e
#   d kv_e = Σ_h (p_e dO + D^-½ dl_e q)               d sink = −Σ_rows exp(sink − lse) Δ
#
# The kernel writes d kv per selected id ([B, S, entries, D]); XLA adds them into the buffers' rows.


def _entry_grads(q, do, lse, delta, kv, valid, scale):
    """One block of entries: (d kv [E, D] summed over the heads, its dq contribution [BH, D])."""
    dot = functools.partial(lax.dot_general, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    logits = dot(q, kv, (((1,), (1,)), ((), ()))) * scale  # [BH, E]
    p = jnp.where(valid, jnp.exp(logits - lse), 0.0)
    dl = p * (dot(do, kv, (((1,), (1,)), ((), ()))) - delta)
    dkv = dot(p, do, (((0,), (0,)), ((), ()))) + scale * dot(dl, q, (((0,), (0,)), ((), ())))
    return dkv, scale * dot(dl, kv, (((1,), (0,)), ((), ())))


def _bwd_kernel(*refs, packed_main: bool, packed_win: bool, block_k: int, block_w: int):
    """GPU (Triton) and the generic interpreter."""
    it = iter(refs)
    q_ref, do_ref, lse_ref, delta_ref = (next(it) for _ in range(4))
    main_ref, main_scale_ref, main_idx_ref, win_ref, win_scale_ref, win_idx_ref = _buffer_refs(it, packed_main,
                                                                                               packed_win)
    dq_ref, dmain_ref, dwin_ref = it

    q = q_ref[...].astype(jnp.float32)  # [BH, D]
    do, lse, delta = do_ref[...], lse_ref[...], delta_ref[...]  # [BH, D], [BH, 1], [BH, 1]
    scale = q.shape[-1] ** -0.5

    def source(data_ref, scale_ref, idx_ref, d_ref, block, fmt, dq):
        rows = data_ref.shape[0]

        def body(j, dq):
            idx = idx_ref[pl.ds(j * block, block)]
            valid = (idx >= 0) & (idx < rows)
            row = jnp.where(valid, idx, 0)
            kv = decode_entries(data_ref[row, :], None if scale_ref is None else scale_ref[row, :], fmt)  # [E, D]
            dkv, ddq = _entry_grads(q, do, lse, delta, kv, valid[None, :], scale)
            d_ref[pl.ds(j * block, block), :] = dkv
            return dq + ddq

        return lax.fori_loop(0, idx_ref.shape[0] // block, body, dq)

    dq = jnp.zeros(q.shape, jnp.float32)
    dq = source(main_ref, main_scale_ref, main_idx_ref, dmain_ref, block_k, MAIN, dq)
    dq = source(win_ref, win_scale_ref, win_idx_ref, dwin_ref, block_w, WINDOW, dq)
    dq_ref[...] = dq


def _tpu_bwd_kernel(*refs, packed_main: bool, packed_win: bool, steps_k: int, steps_w: int, block_k: int,
                    block_w: int):
    """TPU (Mosaic): the rows arrive as in the forward (`_tpu_walk`); each block's d kv goes to its own slab."""
    (main_ids, win_ids, main_ids_v, win_ids_v, q_ref, do_ref, lse_ref, delta_ref), main, win, outs = _tpu_refs(
        refs, 8, 1 + packed_main, 1 + packed_win)
    dq_ref, d_refs = outs[0], outs[1:]
    q = q_ref[...].astype(jnp.float32)  # [Hp, D]
    do, lse, delta = do_ref[...], lse_ref[...], delta_ref[...]
    scale = q.shape[-1] ** -0.5

    def step(source, j, kv, valid, dq):
        dkv, ddq = _entry_grads(q, do, lse, delta, kv, valid, scale)
        d_refs[source][j] = dkv
        return dq + ddq

    dq_ref[...] = _tpu_walk((main_ids, win_ids), (main_ids_v, win_ids_v), (main, win), (steps_k, steps_w),
                            (block_k, block_w), step, jnp.zeros(q.shape, jnp.float32))


def _gpu_bwd_call(q, do, lse, delta, main, main_scale, main_idx, window, window_scale, window_idx, *, target, bh,
                  kb, wb, num_warps):
    """Grid `(B, S, Hp / bh)` → dq, and d kv per id `[B, S, entries, D]` summed over the head blocks."""
    b, s, hp, d = q.shape

    def whole_row(x):
        return pl.BlockSpec((None, *x.shape[1:]), lambda b_, s_, h_: (b_, 0, 0))

    def ids_spec(x):
        return pl.BlockSpec((None, None, x.shape[-1]), lambda b_, s_, h_: (b_, s_, 0))

    def heads(width):
        return pl.BlockSpec((None, None, bh, width), lambda b_, s_, h_: (b_, s_, h_, 0))

    def per_entry(x):  # one slab per head block
        return pl.BlockSpec((None, None, None, x.shape[-1], d), lambda b_, s_, h_: (h_, b_, s_, 0, 0))

    packed = [x for x in (main_scale,) if x is not None], [x for x in (window_scale,) if x is not None]
    n_hb = hp // bh
    dq, dmain, dwin = pl.pallas_call(
        functools.partial(_bwd_kernel, packed_main=main_scale is not None, packed_win=window_scale is not None,
                          block_k=kb, block_w=wb),
        grid=(b, s, n_hb),
        in_specs=[heads(d), heads(d), heads(1), heads(1), whole_row(main), *map(whole_row, packed[0]),
                  ids_spec(main_idx), whole_row(window), *map(whole_row, packed[1]), ids_spec(window_idx)],
        out_specs=(heads(d), per_entry(main_idx), per_entry(window_idx)),
        out_shape=(jax.ShapeDtypeStruct((b, s, hp, d), jnp.float32),
                   jax.ShapeDtypeStruct((n_hb, *main_idx.shape, d), jnp.float32),
                   jax.ShapeDtypeStruct((n_hb, *window_idx.shape, d), jnp.float32)),
        interpret=_common.interpret_arg(target), compiler_params=_common.compiler_params(target, num_warps, 3),
        name="csa2_sparse_attention_bwd",
    )(q, do, lse, delta, main, *packed[0], main_idx, window, *packed[1], window_idx)
    return dq, jnp.sum(dmain, axis=0), jnp.sum(dwin, axis=0)


def _tpu_bwd_call(q, do, lse, delta, main, main_scale, main_idx, window, window_scale, window_idx, *, target, kb,
                  wb):
    """Grid `(B, S)`, all heads per program, rows by DMA as in the forward → dq, d kv per id `[B, S, entries, D]`."""
    b, s, hp, d = q.shape
    (main_smem, main_vmem), (main_smem_spec, main_vmem_spec) = row_dma.ids_blocks(main_idx, kb, 1)
    (win_smem, win_vmem), (win_smem_spec, win_vmem_spec) = row_dma.ids_blocks(window_idx, wb, 1)
    main_src = [x for x in (main, main_scale) if x is not None]
    win_src = [x for x in (window, window_scale) if x is not None]
    heads = lambda width: pl.BlockSpec((None, None, hp, width), lambda b_, s_: (b_, s_, 0, 0))  # noqa: E731
    per_entry = lambda v, block: pl.BlockSpec((None, v.shape[1], block, d),  # noqa: E731
                                              lambda b_, s_: (b_ * s + s_, 0, 0, 0))
    dq, dmain, dwin = pl.pallas_call(
        functools.partial(_tpu_bwd_kernel, packed_main=main_scale is not None, packed_win=window_scale is not None,
                          steps_k=main_vmem.shape[1], steps_w=win_vmem.shape[1], block_k=kb, block_w=wb),
        grid=(b, s),
        in_specs=[main_smem_spec, win_smem_spec, main_vmem_spec, win_vmem_spec, heads(d), heads(d), heads(1),
                  heads(1)] + [pl.BlockSpec(memory_space=pl.ANY)] * (len(main_src) + len(win_src)),
        out_specs=(heads(d), per_entry(main_vmem, kb), per_entry(win_vmem, wb)),
        out_shape=(jax.ShapeDtypeStruct((b, s, hp, d), jnp.float32),
                   jax.ShapeDtypeStruct((*main_vmem.shape, d), jnp.float32),
                   jax.ShapeDtypeStruct((*win_vmem.shape, d), jnp.float32)),
        scratch_shapes=row_dma.scratch(kb, *main_src) + row_dma.scratch(wb, *win_src),
        interpret=_common.interpret_arg(target), compiler_params=_common.compiler_params(target, 0, 2),
        name="csa2_sparse_attention_bwd_tpu",
    )(main_smem, win_smem, main_vmem, win_vmem, q, do, lse, delta, *main_src, *win_src)
    return dq, dmain.reshape(*main_idx.shape, d), dwin.reshape(*window_idx.shape, d)


@functools.partial(jax.jit, static_argnames=("target", "block_h", "block_k", "block_w", "num_warps"))
def _sparse_attention_bwd(q, sink, main: Stored, main_idx, window: Stored, window_idx, out, lse, do, *,
                          target: str, block_h: int | None, block_k: int, block_w: int, num_warps: int):
    """(dq, dsink, d main entries [B, rows, D], d window entries) of Σ do·out, from the saved `out` and `lse`."""
    b, s, h, d = q.shape
    m_rows, w_rows = main.rows, window.rows
    main_bits, main_scale, main_idx = _nonempty(*main.bits(), main_idx.astype(jnp.int32))
    win_bits, win_scale, win_idx = _nonempty(*window.bits(), window_idx.astype(jnp.int32))
    k, w = main_idx.shape[-1], win_idx.shape[-1]
    bh = _head_block(target, h, block_h)
    hp = _common.round_up(h, bh)
    kb, wb = (entry_block(target, n, blk, 1, d, 2 * bh) for n, blk in ((k, block_k), (w, block_w)))  # q, dO
    main_idx = _common.pad_axis(main_idx, 2, _common.round_up(k, kb), NO_ENTRY)
    win_idx = _common.pad_axis(win_idx, 2, _common.round_up(w, wb), NO_ENTRY)
    do = do.astype(jnp.float32)
    delta = jnp.sum(do * out, axis=-1, keepdims=True)  # [B, S, H, 1]
    # Padded heads: q = dO = 0, lse = +inf, so their p and every gradient they touch are 0.
    operands = (_common.pad_axis(q, 2, hp, 0), _common.pad_axis(do, 2, hp, 0), _common.pad_axis(lse, 2, hp, jnp.inf),
                _common.pad_axis(delta, 2, hp, 0), main_bits, main_scale, main_idx, win_bits, win_scale, win_idx)
    if _common.mosaic(target):
        dq, dmain, dwin = _tpu_bwd_call(*operands, target=target, kb=kb, wb=wb)
    else:
        dq, dmain, dwin = _gpu_bwd_call(*operands, target=target, bh=bh, kb=kb, wb=wb, num_warps=num_warps)

    def scatter(d_entries, idx, rows):  # Σ over the (row, id) pairs that read each buffer row
        keep = (idx >= 0) & (idx < rows)
        batch = jnp.arange(b)[:, None, None]
        grad = jnp.where(keep[..., None], d_entries, 0.0)
        return jnp.zeros((b, rows, d), jnp.float32).at[batch, jnp.where(keep, idx, rows)].add(grad, mode="drop")

    dsink = -jnp.sum(jnp.exp(sink.astype(jnp.float32)[:, None] - lse) * delta, axis=(0, 1))[:, 0]
    return dq[:, :, :h], dsink, scatter(dmain, main_idx, m_rows), scatter(dwin, win_idx, w_rows)


def _cotangent(x, grad):
    """The cotangent of input `x`: `grad` for float inputs, float0 zeros for integer ones (ids, packed bits)."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return grad.astype(x.dtype).reshape(x.shape)
    return np.zeros(x.shape, jax.dtypes.float0)


def _stored_cotangent(store: Stored, grad) -> Stored:
    """A `Stored` buffer's cotangent: d payload for float storage; packed bits get float0."""
    return Stored(_cotangent(store.payload, grad), None if store.scale is None else _cotangent(store.scale, None),
                  store.fmt)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _differentiable(q, sink, main, main_idx, window, window_idx, opts):
    return _sparse_attention(q, sink, main, main_idx, window, window_idx, **dict(opts))


def _differentiable_fwd(q, sink, main, main_idx, window, window_idx, opts):
    out, lse = _sparse_attention(q, sink, main, main_idx, window, window_idx, **dict(opts), with_lse=True)
    return out, (q, sink, main, main_idx, window, window_idx, out, lse)


def _differentiable_bwd(opts, res, do):
    q, sink, main, main_idx, window, window_idx, out, lse = res
    opts = dict(opts)
    dq, dsink, dmain, dwin = _sparse_attention_bwd(
        *res, do, target=opts["target"], block_h=opts["block_h"], block_k=opts["block_k"], block_w=opts["block_w"],
        num_warps=opts["num_warps"])
    return (_cotangent(q, dq), _cotangent(sink, dsink), _stored_cotangent(main, dmain), _cotangent(main_idx, None),
            _stored_cotangent(window, dwin), _cotangent(window_idx, None))


_differentiable.defvjp(_differentiable_fwd, _differentiable_bwd)


def sparse_attention(q, sink, main: Stored, main_idx, window: Stored, window_idx, *,
                     interpret: bool | None = None, target: str | None = None, block_h: int | None = None,
                     block_k: int = 64, block_w: int = 64, num_splits: int | None = None,
                     num_warps: int = 4) -> Array:
    """Pallas version of `reference.sparse_attention` (see `ops.sparse_attention` for shapes), with its custom
    backward kernel.

    target: the lowering by name (`_common.TARGETS`; None: the platform's, or the interpreter with
    `interpret=True`);
    block_h: heads per program (default: all heads in the interpreter, 16 on GPU; TPU takes all heads);
    block_k / block_w: main / window entries per online-softmax step and per DMA block (powers of two);
    num_splits: entry splits per row (default 1 in the interpreter; on GPU enough for ~128 programs; on TPU
    two for a lone row, one per TensorCore).
    """
    _common.check_sparse_attention(q, sink, main, main_idx, window, window_idx)
    for name, v in (("block_k", block_k), ("block_w", block_w), ("block_h", block_h or 1)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name}={v}: must be a power of two (Triton block shapes)")
    opts = (("target", _common.pick_target(interpret, target, "sparse_attention")), ("block_h", block_h),
            ("block_k", block_k), ("block_w", block_w), ("num_splits", num_splits), ("num_warps", num_warps))
    return _differentiable(q, sink, main, main_idx, window, window_idx, opts)
