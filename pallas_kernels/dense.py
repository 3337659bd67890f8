"""Sparse attention read densely (`impl="dense"`): every Global entry scored, the top-k kept by a mask (SPEC §3).

The reference gathers each query's K entries, `[B, S, K, D]` float32 per layer, and a backward pass keeps and
scatters them back. When a query could see few entries, that copy costs more than scoring all of them: at a training
row of 128 tokens the long-context recipe's `tiny` queries list K = 128 ids of N ≤ 128 entries, and the gathered
keys hold K·D = 4096 values per query where the dense logits hold H·N ≤ 512. This form decodes the main buffer
whole, once per call (N·D values per row, at most K·D²/H under the rule below, against the reference's K·D per
query), scores its N entries with one matmul per row, weights each by the number of times the query lists it
(`multiplicity`: 0 drops it, a repeated id counts as often as the reference gathers it), and gathers only the W
window rows. The sums then run over entries in buffer order rather than top-k order, so values match the reference
to float rounding, not bit for bit; where the dense read is not the smaller one (H·N > K·D: long rows, decode
against a long cache) the reference runs instead.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _common, reference
from pallas_kernels.stored import Stored

Array = jax.Array
_HIGHEST = lax.Precision.HIGHEST


def multiplicity(idx: Array, rows: int) -> Array:
    """How many times each of `rows` entries is listed in `idx [B, S, K]` (ids outside `[0, rows)` are not):
    `[B, S, rows]` float32."""
    b, s, _ = idx.shape
    listed = jnp.where((idx >= 0) & (idx < rows), idx, rows)  # out of bounds: dropped by the scatter
    batch, query = jnp.arange(b)[:, None, None], jnp.arange(s)[None, :, None]
    return jnp.zeros((b, s, rows), jnp.float32).at[batch, query, listed].add(1.0, mode="drop")


def reads_densely(q: Array, main: Stored, main_idx: Array) -> bool:
    """Whether the dense read is the smaller one: H·N logits per query against the reference's K·D gathered
    values."""
    h, d = q.shape[2:]
    return h * main.rows <= main_idx.shape[2] * d


@functools.partial(jax.jit, static_argnames="block_elements")
def sparse_attention(q: Array, sink: Array, main: Stored, main_idx: Array, window: Stored, window_idx: Array, *,
                     block_elements: int = reference.BLOCK_ELEMENTS) -> Array:
    """`ops.sparse_attention`'s op (same arguments and result) with the main entries read densely when that reads
    less (`reads_densely`), else the reference."""
    _common.check_sparse_attention(q, sink, main, main_idx, window, window_idx)
    if not reads_densely(q, main, main_idx):
        return reference.sparse_attention(q, sink, main, main_idx, window, window_idx, block_elements=block_elements)
    keys = main.decode()  # [B, N, D]
    b, s, h, d = q.shape
    scale = d ** -0.5

    def block(q, main_idx, window_idx):
        count = multiplicity(main_idx, main.rows)[:, :, None, :]  # [B, s, 1, N]
        win_keys, win_valid = reference.gather_entries(window, window_idx)  # [B, s, W, D]
        qf = q.astype(jnp.float32)
        with jax.named_scope("fp32_attention"):
            main_logits = jnp.einsum("bshd,bnd->bshn", qf, keys, precision=_HIGHEST,
                                     preferred_element_type=jnp.float32) * scale
            win_logits = jnp.einsum("bshd,bswd->bshw", qf, win_keys, precision=_HIGHEST,
                                    preferred_element_type=jnp.float32) * scale
        main_logits = jnp.where(count > 0, main_logits, -jnp.inf)
        win_logits = jnp.where(win_valid[:, :, None, :], win_logits, -jnp.inf)
        # One sink softmax over both sources (reference.sink_probabilities), each main entry `count` times.
        sink_logit = sink.astype(jnp.float32)[None, None, :, None]
        m = jnp.maximum(jnp.maximum(jnp.max(main_logits, axis=-1, keepdims=True, initial=-jnp.inf),
                                    jnp.max(win_logits, axis=-1, keepdims=True, initial=-jnp.inf)), sink_logit)
        main_p = count * jnp.exp(main_logits - m)
        win_p = jnp.exp(win_logits - m)
        total = (jnp.sum(main_p, axis=-1, keepdims=True) + jnp.sum(win_p, axis=-1, keepdims=True)
                 + jnp.exp(sink_logit - m))
        with jax.named_scope("fp32_attention"):
            out = (jnp.einsum("bshn,bnd->bshd", main_p, keys, precision=_HIGHEST)
                   + jnp.einsum("bshw,bswd->bshd", win_p, win_keys, precision=_HIGHEST))
        return out / total

    per_query = h * (2 * main.rows + window_idx.shape[2]) + main.rows + window_idx.shape[2] * d
    return reference.by_query_blocks(block, reference.query_block(b, s, per_query, block_elements),
                                     q, main_idx, window_idx)
