"""Pallas lightning-indexer scores and candidate block maxima (SPEC §5).

- `indexer_scores`: Σ_h w_h · relu(qI_h · k_n) for every entry n, streamed over key blocks:
  grid `(B, S / block_s, N / block_n)`; each program dequantizes one contiguous block of the
  packed MXFP4 Indexer K (e2m1 + ue8m0) in registers, scores `block_s` query rows × Hi heads with
  one 2-D dot, and writes −inf where n ≥ visible[b, s].
- `indexer_scores_gathered` (Reindex): per query row, gather the candidate ids' key rows first
  (vector-indexed ref load, −1 / out-of-range ids read row 0 and are masked), then score only
  them — work bounded by the pool size P, not by N. Grid `(B, S, P / block_p)`. On TPU (Mosaic has no
  vector gather) grid `(B, S)`: the ids sit in SMEM and drive one DMA per key row from HBM into
  double-buffered VMEM slots, `block_p` rows at a time (`row_dma`).
- `block_max`: max over runs of `block` scores, for the candidate source's block scores.

Top-k selection stays in XLA (`lax.top_k`). Measured (`bench.py`, `topk` lines, CPU, k = 512,
N = 4K…128K): `lax.approx_max_k(recall_target=0.95)` lowers to XLA's ApproxTopK with
`is_fallback=true`, which XLA:CPU (and XLA:GPU) rewrites into the same exact TopK: recall 1.0 and
the same time (ratio 0.86–1.65 around 1, noise), 0.07–0.41 ms against a 6–86 ms group step. It
only approximates on TPU, so it buys nothing here and would make selection backend-dependent.
Block shapes: powers of two in every in-kernel array (Triton); the streamed key block
`(block_n, Di/2)` and score block `(block_s, block_n)` also satisfy Mosaic's (8, 128) rule.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _common, row_dma
from pallas_kernels.formats import INDEX, decode_entries
from pallas_kernels.stored import Stored

Array = jax.Array


def _score_block(q, w, keys):
    """q [R, Hi, Di], w [R, Hi], keys [E, Di] → Σ_h w_h relu(q_h · k) [R, E]."""
    r, hi, di = q.shape
    dots = lax.dot_general(q.reshape(r * hi, di), keys, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)  # [R·Hi, E]
    return jnp.sum(jnp.maximum(dots, 0.0).reshape(r, hi, -1) * w[:, :, None], axis=1)


def _scores_kernel(*refs, packed: bool, block_n: int):
    q_ref, w_ref, vis_ref, k_ref = refs[:4]
    ks_ref = refs[4] if packed else None
    o_ref = refs[-1]
    keys = decode_entries(k_ref[...], None if ks_ref is None else ks_ref[...], INDEX)  # [BN, Di]
    scores = _score_block(q_ref[...].astype(jnp.float32), w_ref[...].astype(jnp.float32), keys)  # [BS, BN]
    col = pl.program_id(2) * block_n + lax.broadcasted_iota(jnp.int32, (1, block_n), 1)
    o_ref[...] = jnp.where(col < vis_ref[...], scores, -jnp.inf)  # vis [BS, 1]


def _pick_block_n(n: int, block_n: int, least: int, mosaic: bool) -> tuple[int, int]:
    """(key block, padded N): the largest power of two ≤ block_n dividing N, else pad N (copies the keys).
    Mosaic: all N in one block when N ≤ block_n, else blocks of a multiple of 128 lanes."""
    if mosaic:
        return (n, n) if n <= block_n else (max(128, block_n), _common.round_up(n, max(128, block_n)))
    bn = max(least, min(block_n, _common.next_pow2(n)))
    while bn > max(8, least) and n % bn:
        bn //= 2
    return (bn, n) if n % bn == 0 else (bn, _common.round_up(n, bn))


@functools.partial(jax.jit, static_argnames=("target", "block_s", "block_n", "num_warps"))
def _indexer_scores(q, w, ikey: Stored, visible, *, target, block_s, block_n, num_warps):
    b, s, hi, di = q.shape
    n = ikey.rows
    ikey, ikey_scale = ikey.bits()
    bs = min(block_s, _common.next_pow2(s))
    bs = max(bs, _common.next_pow2(-(-_common.min_block(target) // hi)))  # dot rows bs·Hi ≥ 16 on GPU
    bs = max(bs, 8) if _common.mosaic(target) else bs  # Mosaic: query rows in whole sublane tiles
    sp = _common.round_up(s, bs)
    bn, npad = _pick_block_n(n, block_n, _common.min_block(target), _common.mosaic(target))
    q = _common.pad_axis(q, 1, sp, 0)
    w = _common.pad_axis(w, 1, sp, 0)
    vis = _common.pad_axis(visible.astype(jnp.int32), 1, sp, 0)[..., None]  # [B, Sp, 1]
    keys = [_common.pad_axis(x, 1, npad, 0) for x in (ikey, ikey_scale) if x is not None]
    key_specs = [pl.BlockSpec((None, bn, x.shape[2]), lambda b_, s_, n_: (b_, n_, 0)) for x in keys]
    out = pl.pallas_call(
        functools.partial(_scores_kernel, packed=ikey_scale is not None, block_n=bn),
        grid=(b, sp // bs, npad // bn),
        in_specs=[pl.BlockSpec((None, bs, hi, di), lambda b_, s_, n_: (b_, s_, 0, 0)),
                  pl.BlockSpec((None, bs, hi), lambda b_, s_, n_: (b_, s_, 0)),
                  pl.BlockSpec((None, bs, 1), lambda b_, s_, n_: (b_, s_, 0))] + key_specs,
        out_specs=pl.BlockSpec((None, bs, bn), lambda b_, s_, n_: (b_, s_, n_)),
        out_shape=jax.ShapeDtypeStruct((b, sp, npad), jnp.float32),
        interpret=_common.interpret_arg(target), compiler_params=_common.compiler_params(target, num_warps, 3),
        name="csa2_indexer_scores",
    )(q, w, vis, *keys)
    return out[:, :s, :n]


def indexer_scores(q, w, ikey: Stored, visible, *, interpret: bool | None = None, target: str | None = None,
                   block_s: int = 8, block_n: int = 256, num_warps: int = 4) -> Array:
    """Pallas version of `reference.indexer_scores`: [B, S, N] float32, −inf where n ≥ visible[b, s].

    block_s query rows × block_n keys per program (powers of two). On GPU keep block_s · Hi ≥ 16. target: the
    lowering by name (`_common.TARGETS`; None: the platform's, or the interpreter with `interpret=True`).
    """
    _common.check_indexer(q, w, ikey, visible)
    _check_pow2(block_s=block_s, block_n=block_n)
    return _indexer_scores(q, w, ikey, visible, target=_common.pick_target(interpret, target, "indexer_scores"),
                           block_s=block_s, block_n=block_n, num_warps=num_warps)


def _gathered_kernel(*refs, packed: bool):
    q_ref, w_ref, vis_ref, ids_ref, k_ref = refs[:5]
    ks_ref = refs[5] if packed else None
    o_ref = refs[-1]
    ids = ids_ref[...]  # [BP]
    found = (ids >= 0) & (ids < k_ref.shape[0])
    row = jnp.where(found, ids, 0)
    keys = decode_entries(k_ref[row, :], None if ks_ref is None else ks_ref[row, :], INDEX)  # [BP, Di]
    scores = _score_block(q_ref[...].astype(jnp.float32)[None], w_ref[...].astype(jnp.float32)[None], keys)[0]
    o_ref[...] = jnp.where(found & (ids < vis_ref[...]), scores, -jnp.inf)  # vis [1]


@functools.partial(jax.jit, static_argnames=("target", "block_p", "num_warps"))
def _indexer_scores_gathered(q, w, ikey: Stored, ids, visible, *, target, block_p, num_warps):
    b, s, hi, di = q.shape
    p = ids.shape[-1]
    ikey, ikey_scale = ikey.bits()
    bp = max(_common.min_block(target), min(block_p, _common.next_pow2(max(p, 1))))
    pp = _common.round_up(max(p, 1), bp)
    ids = _common.pad_axis(ids.astype(jnp.int32), 2, pp, -1)
    keys = [x for x in (ikey, ikey_scale) if x is not None]
    if _common.mosaic(target):
        return _gathered_tpu_call(q, w, keys, ids, visible, target=target, bp=bp)[:, :, :p]
    key_specs = [pl.BlockSpec((None, *x.shape[1:]), lambda b_, s_, p_: (b_, 0, 0)) for x in keys]
    out = pl.pallas_call(
        functools.partial(_gathered_kernel, packed=ikey_scale is not None),
        grid=(b, s, pp // bp),
        in_specs=[pl.BlockSpec((None, None, hi, di), lambda b_, s_, p_: (b_, s_, 0, 0)),
                  pl.BlockSpec((None, None, hi), lambda b_, s_, p_: (b_, s_, 0)),
                  pl.BlockSpec((None, None, 1), lambda b_, s_, p_: (b_, s_, 0)),
                  pl.BlockSpec((None, None, bp), lambda b_, s_, p_: (b_, s_, p_))] + key_specs,
        out_specs=pl.BlockSpec((None, None, bp), lambda b_, s_, p_: (b_, s_, p_)),
        out_shape=jax.ShapeDtypeStruct((b, s, pp), jnp.float32),
        interpret=_common.interpret_arg(target), compiler_params=_common.compiler_params(target, num_warps, 3),
        name="csa2_indexer_scores_gathered",
    )(q, w, visible.astype(jnp.int32)[..., None], ids, *keys)
    return out[:, :, :p]


def _gathered_tpu_kernel(ids_ref, ids_v_ref, q_ref, w_ref, vis_ref, *refs, packed: bool, steps: int, block_p: int):
    """TPU (Mosaic): the candidates' key rows arrive by DMA (`row_dma`), `block_p` at a time, double-buffered."""
    n_src = 1 + packed
    sources, o_ref = refs[:n_src], refs[n_src]
    slots, sems = refs[n_src + 1:n_src + 1 + n_src], refs[n_src + 1 + n_src:]
    q = q_ref[...].astype(jnp.float32)  # [Hi, Di]
    w = w_ref[...].astype(jnp.float32)  # [Hi, 1]
    visible = vis_ref[...]  # [1, 1]
    rows = sources[0].shape[1]
    gather = row_dma.RowGather(ids_ref, sources, slots, sems, pl.program_id(0), block_p)
    gather.zero()
    gather.prime(steps)

    def body(j, fetched, carry):
        ids = ids_v_ref[pl.ds(j, 1), :]  # [1, block_p]
        keys = decode_entries(fetched[0], fetched[1] if packed else None, INDEX)  # [block_p, Di]
        dots = lax.dot_general(q, keys, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)  # [Hi, block_p]
        scores = jnp.sum(jnp.maximum(dots, 0.0) * w, axis=0, keepdims=True)
        o_ref[pl.ds(j, 1), :] = jnp.where((ids >= 0) & (ids < rows) & (ids < visible), scores, -jnp.inf)
        return carry

    gather.pipeline(steps, body, 0)


def _gathered_tpu_call(q, w, keys, ids, visible, *, target, bp):
    """Grid `(B, S)`: each program scores its row's whole pool, ids in SMEM (addresses) and VMEM (masks)."""
    b, s, hi, di = q.shape
    (ids_smem, ids_vmem), (smem_spec, vmem_spec) = row_dma.ids_blocks(ids, bp)
    steps = ids_vmem.shape[1]
    out = pl.pallas_call(
        functools.partial(_gathered_tpu_kernel, packed=len(keys) > 1, steps=steps, block_p=bp),
        grid=(b, s),
        in_specs=[smem_spec, vmem_spec,
                  pl.BlockSpec((None, None, hi, di), lambda b_, s_: (b_, s_, 0, 0)),
                  pl.BlockSpec((None, None, hi, 1), lambda b_, s_: (b_, s_, 0, 0)),
                  pl.BlockSpec((None, None, 1, 1), lambda b_, s_: (b_, s_, 0, 0))]
                 + [pl.BlockSpec(memory_space=pl.ANY)] * len(keys),
        out_specs=vmem_spec,
        out_shape=jax.ShapeDtypeStruct(ids_vmem.shape, jnp.float32),
        scratch_shapes=row_dma.scratch(bp, *keys), interpret=_common.interpret_arg(target),
        compiler_params=_common.compiler_params(target, 0, 2), name="csa2_indexer_scores_gathered_tpu",
    )(ids_smem, ids_vmem, q, w[..., None], visible.astype(jnp.int32)[..., None, None], *keys)
    return out.reshape(b, s, -1)


def indexer_scores_gathered(q, w, ikey: Stored, ids, visible, *, interpret: bool | None = None,
                            target: str | None = None, block_p: int = 256, num_warps: int = 4) -> Array:
    """Pallas version of `reference.indexer_scores_gathered`: [B, S, P] float32, −inf where id < 0 or id ≥ visible.
    target: the lowering by name (`_common.TARGETS`), as in `indexer_scores`."""
    _common.check_indexer(q, w, ikey, visible, ids)
    _check_pow2(block_p=block_p)
    return _indexer_scores_gathered(q, w, ikey, ids, visible,
                                    target=_common.pick_target(interpret, target, "indexer_scores_gathered"),
                                    block_p=block_p, num_warps=num_warps)


def _block_max_kernel(x_ref, o_ref, *, block: int):
    x = x_ref[...]  # [BS, BB · block]
    o_ref[...] = jnp.max(x.reshape(x.shape[0], -1, block), axis=2)


@functools.partial(jax.jit, static_argnames=("block", "target", "block_s", "block_b", "num_warps"))
def _block_max(scores, *, block, target, block_s, block_b, num_warps):
    b, s, n = scores.shape
    blocks = -(-n // block)
    bs = min(block_s, _common.next_pow2(s))
    bs = max(bs, 8) if _common.mosaic(target) else bs  # Mosaic: rows in whole sublane tiles
    bb = min(block_b, _common.next_pow2(blocks))
    bb = bb if not _common.mosaic(target) or bb >= blocks else max(bb, 128)  # lanes: all blocks or 128s
    sp, bp = _common.round_up(s, bs), _common.round_up(blocks, bb)
    x = _common.pad_axis(_common.pad_axis(scores.astype(jnp.float32), 1, sp, -jnp.inf), 2, bp * block, -jnp.inf)
    out = pl.pallas_call(
        functools.partial(_block_max_kernel, block=block),
        grid=(b, sp // bs, bp // bb),
        in_specs=[pl.BlockSpec((None, bs, bb * block), lambda b_, s_, k_: (b_, s_, k_))],
        out_specs=pl.BlockSpec((None, bs, bb), lambda b_, s_, k_: (b_, s_, k_)),
        out_shape=jax.ShapeDtypeStruct((b, sp, bp), jnp.float32),
        interpret=_common.interpret_arg(target), compiler_params=_common.compiler_params(target, num_warps, 3),
        name="csa2_block_max",
    )(x)
    return out[:, :s, :blocks]


def block_max(scores, block: int, *, interpret: bool | None = None, target: str | None = None, block_s: int = 8,
              block_b: int = 128, num_warps: int = 4) -> Array:
    """Pallas version of `reference.block_max`: scores [B, S, N] → [B, S, ceil(N / block)] (block a power of two).
    target: the lowering by name (`_common.TARGETS`), as in `indexer_scores`."""
    _common.check_block_max(scores, block)
    _check_pow2(block=block, block_s=block_s, block_b=block_b)
    return _block_max(scores, block=block, target=_common.pick_target(interpret, target, "block_max"),
                      block_s=block_s, block_b=block_b, num_warps=num_warps)


def _check_pow2(**sizes: int) -> None:
    for name, v in sizes.items():
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name}={v}: must be a power of two (Triton block shapes)")
