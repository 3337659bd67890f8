"""The XLA implementation of every CSA2 hot path, written once: it is the `impl="xla"` backend and the
oracle every other backend is tested against (SPEC §3, §5).

Reads gather first and dequantize after the gather (`Stored.gather`), with the bit-level decoders
of `formats`, so the reference and the kernels see bit-identical entries. Inner products
accumulate in float32 at `HIGHEST` precision (SPEC: attention logits and indexer scores are fp32), under
the named scopes `fp32_attention` and `fp32_indexer` that `tests/csa2/test_precision.py` finds in the HLO.

Every query reads its own entries, so the three scoring reads run in blocks of queries (`by_query_blocks`): a
block holds at most `block_elements` float32 values of per-query temporaries (gathered entries, logits, indexer
dots), the blocks run one after another (`lax.map`), each under `jax.checkpoint`, so neither the forward pass nor
a backward pass through it ever holds the temporaries of every query at once. At the release's shapes a 4096-token
training row would otherwise gather 34 GB of candidate keys in one Reindex layer. Short inputs are one block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _common
from pallas_kernels.stored import Stored

Array = jax.Array
_HIGHEST = lax.Precision.HIGHEST
BLOCK_ELEMENTS = 1 << 26  # per-query temporaries of one block of queries, in float32 values (256 MB)


def query_block(batch: int, queries: int, per_query: int, block_elements: int = BLOCK_ELEMENTS) -> int:
    """Queries per block: the largest divisor of `queries` whose block holds at most `block_elements` values of
    `per_query` values per query and batch row (at least one query)."""
    most = max(1, block_elements // max(1, batch * per_query))
    if queries <= most:
        return queries
    return next(d for d in range(most, 0, -1) if queries % d == 0)


def by_query_blocks(fn, block: int, *xs: Array) -> Array:
    """`fn(*xs)` a block of `block` queries at a time: every `x [B, S, ...]` is split along S, and `fn` maps a block
    `[B, block, ...]` of each to `[B, block, ...]`; blocks run in sequence, each rematerialized in a backward pass."""
    b, s = xs[0].shape[:2]
    if block >= s:
        return fn(*xs)
    split = [x.reshape(b, s // block, block, *x.shape[2:]).swapaxes(0, 1) for x in xs]
    out = lax.map(jax.checkpoint(lambda parts: fn(*parts)), split)
    return out.swapaxes(0, 1).reshape(b, s, *out.shape[3:])


def gather_entries(store: Stored, idx: Array) -> tuple[Array, Array]:
    """Rows `idx [B, ...]` of per-row buffers `[B, N, ·]` as float32 `[B, ..., D]`, and their validity.

    An id is valid iff 0 ≤ id < N; invalid ids read row 0 and are masked by the caller.
    """
    return store.gather(idx), (idx >= 0) & (idx < store.rows)


def sink_probabilities(q: Array, keys: Array, valid: Array, sink: Array) -> Array:
    """Probabilities [B, S, H, E] of one softmax over the entries with the per-head sink in the
    denominator only (SPEC §3): `exp(l_e − m) / (Σ_e exp(l_e − m) + exp(s_h − m))`, `l_e = q_h·k_e·D^-½`.

    q [B, S, H, D], keys [B, S, E, D], valid [B, S, E], sink [H]. A row with no valid entry puts
    all its mass on the sink (probabilities 0).
    """
    with jax.named_scope("fp32_attention"):
        logits = jnp.einsum("bshd,bsed->bshe", q.astype(jnp.float32), keys.astype(jnp.float32), precision=_HIGHEST,
                            preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
    logits = jnp.where(valid[:, :, None, :], logits, -jnp.inf)
    sink = sink.astype(jnp.float32)[None, None, :, None]
    m = jnp.maximum(jnp.max(logits, axis=-1, keepdims=True, initial=-jnp.inf), sink)  # finite thanks to the sink
    p = jnp.exp(logits - m)
    return p / (jnp.sum(p, axis=-1, keepdims=True) + jnp.exp(sink - m))


def sink_attention(q: Array, keys: Array, valid: Array, sink: Array) -> Array:
    """Core attention with K = V over gathered entries: `Σ_e p_e kv_e` [B, S, H, D] float32 (SPEC §3)."""
    probs = sink_probabilities(q, keys, valid, sink)
    with jax.named_scope("fp32_attention"):
        return jnp.einsum("bshe,bsed->bshd", probs, keys.astype(jnp.float32), precision=_HIGHEST)


@functools.partial(jax.jit, static_argnames="block_elements")
def sparse_attention(q: Array, sink: Array, main: Stored, main_idx: Array, window: Stored,
                     window_idx: Array, *, block_elements: int = BLOCK_ELEMENTS) -> Array:
    """Top-k Global entries (`main_idx`, −1 = skip) and window rows (`window_idx`) in one sink softmax.

    See `ops.sparse_attention` for shapes. → [B, S, H, D] float32.
    """
    _common.check_sparse_attention(q, sink, main, main_idx, window, window_idx)
    b, s, h, d = q.shape

    def block(q, main_idx, window_idx):
        main_keys, main_valid = gather_entries(main, main_idx)  # [B, s, K, D]
        win_keys, win_valid = gather_entries(window, window_idx)  # [B, s, W, D]
        keys = jnp.concatenate([main_keys, win_keys], axis=2)
        return sink_attention(q, keys, jnp.concatenate([main_valid, win_valid], axis=2), sink)

    entries = main_idx.shape[2] + window_idx.shape[2]
    return by_query_blocks(block, query_block(b, s, entries * (d + h), block_elements), q, main_idx, window_idx)


def weighted_relu(dots: Array, w: Array) -> Array:
    """Σ_h w_h · relu(dots_h): dots [B, S, Hi, P], w [B, S, Hi] → [B, S, P] float32 (SPEC §5)."""
    with jax.named_scope("fp32_indexer"):
        return jnp.einsum("bshn,bsh->bsn", jax.nn.relu(dots), w.astype(jnp.float32), precision=_HIGHEST)


@functools.partial(jax.jit, static_argnames="block_elements")
def indexer_scores(q: Array, w: Array, ikey: Stored, visible: Array, *,
                   block_elements: int = BLOCK_ELEMENTS) -> Array:
    """Σ_h w_h · relu(qI_h · k_n) over all entries [B, S, N] float32, −inf where n ≥ visible[b, s] (SPEC §5)."""
    _common.check_indexer(q, w, ikey, visible)
    keys = ikey.decode()  # [B, N, Di]
    b, s, h, _ = q.shape

    def block(q, w, visible):
        with jax.named_scope("fp32_indexer"):
            dots = jnp.einsum("bshd,bnd->bshn", q.astype(jnp.float32), keys, precision=_HIGHEST,
                              preferred_element_type=jnp.float32)
        seen = jnp.arange(keys.shape[1], dtype=jnp.int32) < visible[..., None]  # [B, s, N]
        return jnp.where(seen, weighted_relu(dots, w), -jnp.inf)

    return by_query_blocks(block, query_block(b, s, keys.shape[1] * (h + 1), block_elements), q, w, visible)


@functools.partial(jax.jit, static_argnames="block_elements")
def indexer_scores_gathered(q: Array, w: Array, ikey: Stored, ids: Array, visible: Array, *,
                            block_elements: int = BLOCK_ELEMENTS) -> Array:
    """Scores of the candidate ids `ids [B, S, P]` only (Reindex, SPEC §5): gather, then score.

    → [B, S, P] float32, −inf where id < 0 or id ≥ visible[b, s] (or id ≥ N).
    """
    _common.check_indexer(q, w, ikey, visible, ids)
    b, s, h, d = q.shape

    def block(q, w, ids, visible):
        keys, valid = gather_entries(ikey, ids)  # [B, s, P, Di]
        with jax.named_scope("fp32_indexer"):
            dots = jnp.einsum("bshd,bspd->bshp", q.astype(jnp.float32), keys, precision=_HIGHEST,
                              preferred_element_type=jnp.float32)
        return jnp.where(valid & (ids < visible[..., None]), weighted_relu(dots, w), -jnp.inf)

    return by_query_blocks(block, query_block(b, s, ids.shape[2] * (d + h), block_elements), q, w, ids, visible)


def ragged_dot(lhs: Array, rhs: Array, group_sizes: Array) -> Array:
    """The MoE's grouped matmul (SPEC §9): `lhs [M, K]` (rows sorted by group, `group_sizes [G]` rows per group)
    times each row's `rhs [G, K, N]`; rows past `Σ group_sizes` → 0; float32 accumulation → `[M, N]` float32.
    XLA's `lax.ragged_dot`: native on TPU; elsewhere XLA computes every group densely (G× the flops)."""
    return lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnames="block")
def block_max(scores: Array, block: int) -> Array:
    """Max of each run of `block` entries: scores [B, S, N] → [B, S, ceil(N / block)] (tail padded with −inf)."""
    _common.check_block_max(scores, block)
    b, s, n = scores.shape
    blocks = -(-n // block)
    padded = _common.pad_axis(scores, 2, blocks * block, -jnp.inf)
    return padded.reshape(b, s, blocks, block).max(-1)
