"""Backend dispatch of the CSA2 hot paths: `impl="xla"` (jnp oracles) or `impl="pallas"` (kernels).

The Pallas path runs in the interpreter on CPU (`interpret=None` → True there) and compiles
through Triton on GPU (DESIGN §4). Both paths take plain arrays and return float32.
"""

from __future__ import annotations

import jax

from pallas_kernels import indexer as _indexer
from pallas_kernels import reference
from pallas_kernels import sparse_attention as _sparse

Array = jax.Array

IMPLS = ("xla", "pallas")


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")


def sparse_attention(q, sink, main, main_scale, main_idx, window, window_scale, window_idx, *, impl: str = "xla",
                     interpret: bool | None = None) -> Array:
    """Core CSA2 attention over top-k Global entries + window rows, one sink softmax (SPEC §3).

    q [B, S, H, D] float; sink [H] f32;
    main [B, N, D/2] uint8 + main_scale [B, N, D/16] float8_e4m3fn (or float [B, N, D] + None);
    main_idx [B, S, K] int32 entry ids, −1 (or ≥ N) = skip;
    window [B, M, D] float8_e4m3fn + window_scale [B, M, D/32] float8_e8m0fnu (or float [B, M, D] + None);
    window_idx [B, S, W] int32 rows of `window`, −1 = skip (the caller resolves ring slots, floors, validity).
    → [B, S, H, D] float32 = Σ_e exp(l_e−m)·kv_e / (Σ_e exp(l_e−m) + exp(sink_h−m)), l_e = q_h·kv_e·D^-0.5;
    rows with no valid entry → 0.
    """
    _check_impl(impl)
    args = (q, sink, main, main_scale, main_idx, window, window_scale, window_idx)
    if impl == "xla":
        return reference.sparse_attention(*args)
    return _sparse.sparse_attention(*args, interpret=interpret)


def indexer_scores(q, w, ikey, ikey_scale, visible, *, impl: str = "xla", interpret: bool | None = None) -> Array:
    """Σ_h w_h · relu(qI_h · k_n) → [B, S, N] f32, −inf where n ≥ visible[b, s] (SPEC §5).

    q [B, S, Hi, Di] f32, w [B, S, Hi] f32, ikey [B, N, Di/2] uint8 + ikey_scale [B, N, Di/32]
    float8_e8m0fnu (or float [B, N, Di] + None), visible [B, S] int32.
    """
    _check_impl(impl)
    if impl == "xla":
        return reference.indexer_scores(q, w, ikey, ikey_scale, visible)
    return _indexer.indexer_scores(q, w, ikey, ikey_scale, visible, interpret=interpret)


def indexer_scores_gathered(q, w, ikey, ikey_scale, ids, visible, *, impl: str = "xla",
                            interpret: bool | None = None) -> Array:
    """Scores of candidate ids [B, S, P] only (Reindex): → [B, S, P] f32, −inf where id < 0 or id ≥ visible."""
    _check_impl(impl)
    if impl == "xla":
        return reference.indexer_scores_gathered(q, w, ikey, ikey_scale, ids, visible)
    return _indexer.indexer_scores_gathered(q, w, ikey, ikey_scale, ids, visible, interpret=interpret)


def block_max(scores, block: int, *, impl: str = "xla", interpret: bool | None = None) -> Array:
    """Max over runs of `block` entries: scores [B, S, N] → [B, S, ceil(N / block)] (candidate blocks, SPEC §5)."""
    _check_impl(impl)
    if impl == "xla":
        return reference.block_max(scores, block)
    return _indexer.block_max(scores, block, interpret=interpret)
