"""The CSA2 hot paths, one entry per op, dispatched on `impl` through one table (tokamax style).

- `"xla"`: `reference.py`, the only XLA implementation of each op (and the oracle of every test).
- `"pallas"`: the kernels. They run in the Pallas interpreter on CPU and compile through Triton on
  GPU (DESIGN §4) and through Mosaic on TPU (the gathering kernels in their SMEM-ids + row-DMA form,
  `row_dma`). Sparse attention has its own backward kernel, in both forms; the indexer ops' gradient is
  the reference's, recomputed from the same inputs
  (`_reference_gradient`: the index loss and Reindex train through it), so a model running the kernels trains.
- `"dense"`: the reference, except sparse attention reads the Global entries densely under a top-k mask where
  that reads less than gathering them (`dense.py`: short rows, e.g. training on CPU; equal to float rounding).
- `"auto"`: `"dense"` on CPU (the interpreter is for tests, not speed), the kernels elsewhere.

The MoE's grouped matmul, `ragged_dot`, has its own implementations: `"xla"` (`lax.ragged_dot`, the reference)
and `"tiled"` (`grouped.py`, the routed rows' work in plain XLA); `"auto"` picks by shape (`ragged_dot_impl`).
A Pallas grouped matmul would be one more entry of its row.

Every op takes plain arrays and `Stored` buffers and returns float32.
"""

from __future__ import annotations

from typing import Callable

import jax

from pallas_kernels import dense, grouped, indexer as _indexer, reference, sparse_attention as _sparse
from pallas_kernels.stored import Stored

Array = jax.Array

IMPLS = ("xla", "pallas", "dense")  # the backends of the table
CHOICES = (*IMPLS, "auto")


def resolve_impl(impl: str, backend: str | None = None) -> str:
    """The table backend of `impl` on `backend` (default: JAX's): "auto" is "dense" on CPU, "pallas" elsewhere."""
    if impl not in CHOICES:
        raise ValueError(f"impl={impl!r}: expected one of {CHOICES}")
    if impl != "auto":
        return impl
    return "dense" if (backend or jax.default_backend()) == "cpu" else "pallas"


def _reference_gradient(kernel: Callable, ref: Callable) -> Callable:
    """`kernel` forward with the gradient of `ref` (same signature, same math), recomputed in the backward pass."""
    op = jax.custom_vjp(kernel)
    op.defvjp(lambda *args: (kernel(*args), args), lambda args, g: jax.vjp(ref, *args)[1](g))
    return op


BACKENDS: dict[str, dict[str, Callable]] = {
    "sparse_attention": {"xla": reference.sparse_attention, "pallas": _sparse.sparse_attention,
                         "dense": dense.sparse_attention},
    "indexer_scores": {"xla": reference.indexer_scores,
                       "pallas": _reference_gradient(_indexer.indexer_scores, reference.indexer_scores),
                       "dense": reference.indexer_scores},
    "indexer_scores_gathered": {"xla": reference.indexer_scores_gathered,
                                "pallas": _reference_gradient(_indexer.indexer_scores_gathered,
                                                              reference.indexer_scores_gathered),
                                "dense": reference.indexer_scores_gathered},
    "block_max": {"xla": reference.block_max, "pallas": _indexer.block_max, "dense": reference.block_max},
    "ragged_dot": {"xla": reference.ragged_dot, "tiled": grouped.ragged_dot},
}


def _backend(op: str, impl: str) -> Callable:
    return BACKENDS[op][resolve_impl(impl)]


def sparse_attention(q: Array, sink: Array, main: Stored, main_idx: Array, window: Stored, window_idx: Array, *,
                     impl: str = "xla") -> Array:
    """Core CSA2 attention over top-k Global entries + window rows, one sink softmax (SPEC §3).

    q [B, S, H, D] float; sink [H] f32; main: `Stored` MAIN entries [B, N, ·]; main_idx [B, S, K] int32
    entry ids, −1 (or ≥ N) = skip; window: `Stored` WINDOW entries [B, M, ·]; window_idx [B, S, W] int32
    rows of `window`, −1 = skip (the caller resolves ring slots, floors, validity).
    → [B, S, H, D] float32 = Σ_e exp(l_e−m)·kv_e / (Σ_e exp(l_e−m) + exp(sink_h−m)), l_e = q_h·kv_e·D^-0.5;
    rows with no valid entry → 0.
    """
    return _backend("sparse_attention", impl)(q, sink, main, main_idx, window, window_idx)


def indexer_scores(q: Array, w: Array, ikey: Stored, visible: Array, *, impl: str = "xla") -> Array:
    """Σ_h w_h · relu(qI_h · k_n) → [B, S, N] f32, −inf where n ≥ visible[b, s] (SPEC §5).

    q [B, S, Hi, Di] f32, w [B, S, Hi] f32, ikey: `Stored` INDEX entries [B, N, ·], visible [B, S] int32.
    """
    return _backend("indexer_scores", impl)(q, w, ikey, visible)


def indexer_scores_gathered(q: Array, w: Array, ikey: Stored, ids: Array, visible: Array, *,
                            impl: str = "xla") -> Array:
    """Scores of candidate ids [B, S, P] only (Reindex): → [B, S, P] f32, −inf where id < 0 or id ≥ visible."""
    return _backend("indexer_scores_gathered", impl)(q, w, ikey, ids, visible)


def block_max(scores: Array, block: int, *, impl: str = "xla") -> Array:
    """Max over runs of `block` entries: scores [B, S, N] → [B, S, ceil(N / block)] (candidate blocks, SPEC §5).

    A routing statistic: it only chooses which blocks enter the candidate pool, so no gradient flows through it.
    """
    return _backend("block_max", impl)(jax.lax.stop_gradient(scores), block)


def ragged_dot_impl(rows: int, groups: int) -> str:
    """The `ragged_dot` implementation `"auto"` runs for `rows` rows in `groups` groups: `"tiled"` when a tile
    holds more than one row (a mean group of ≥ 8 rows), else `"xla"` (decode: one matrix gather per row would
    cost more than XLA's dense groups)."""
    return "tiled" if grouped.tile_rows(rows, groups) > 1 else "xla"


def ragged_dot(lhs: Array, rhs: Array, group_sizes: Array, *, impl: str = "auto", tile: int | None = None) -> Array:
    """The grouped matmul of the MoE (SPEC §9): `lhs [M, K]` rows sorted by group, `group_sizes [G]` int32 rows
    per group, `rhs [G, K, N]` → `[M, N]` float32 (each row times its group's matrix; rows past the sum → 0).
    `impl`: "xla", "tiled" or "auto" (`ragged_dot_impl`); `tile`: the tiled form's rows per tile (default
    `grouped.tile_rows(M, G)`; the expert-parallel MoE passes one device's, so a mesh multiplies the same tiles)."""
    impls = BACKENDS["ragged_dot"]
    if impl == "auto":
        impl = ragged_dot_impl(lhs.shape[0], group_sizes.shape[0])
    if impl not in impls:
        raise ValueError(f"ragged_dot: impl={impl!r}; use one of {(*impls, 'auto')}")
    if impl == "tiled":
        return grouped.ragged_dot(lhs, rhs, group_sizes, tile)
    return impls[impl](lhs, rhs, group_sizes)
