"""The lightning indexer and hierarchical candidates of CSA2 (SPEC §5), and the `Bus` that shares them.

    qI = FP4-fakequant(RoPE(W_iq q_lat → [Hi, Di]))      w = W_w x · Di^-0.5 · Hi^-0.5
    score(t, i) = Σ_h w_h · relu(qI_h · ikey_i)           (float32), −inf where i is not visible

- Full layers score every visible entry of the group's Indexer K and keep the top `index_topk`
  (`full_topk`).
- The candidate source also groups its scores into blocks of `candidate_block_size` entries,
  block score = max over the block's visible entries, the newest block pinned (+inf), and keeps the
  top `candidate_topk_blocks` blocks: the candidate pool (`candidate_pool`), a per-query routing object.
- Reindex layers gather the pool's Indexer K first and score only those positions (`reindex_topk`),
  so their work is bounded by the pool size, not by the number of entries N.

Scores come from `pallas_kernels.ops` (the reference or the kernels, `cfg.kernel_impl`), which read
the stored Indexer K directly. Every selection goes through `select_topk`: the chosen entry ids
sorted ascending, padded with −1 to a static width. Entry i is visible to a query at position t iff
`i < (t + 1) // ratio` (SPEC §4). Index sources publish their selections on the `Bus`, which the
stack threads through the layers of one call in order (SPEC §2).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from csa2.config import ModelConfig
from csa2.params import linear, normal
from csa2.quant import INDEX, fake_quant
from csa2.rope import apply_rope, rope_frequencies
from csa2.state import SourceKV
from pallas_kernels import ops
from pallas_kernels.stored import NO_ENTRY

Array = jax.Array

_NO_ID = jnp.iinfo(jnp.int32).max  # sorts after every real id, replaced by −1


class Indexer(nnx.Module):
    """Indexer query projection `wq [q_lora_rank, Hi·Di]` and head weights `ww [d, Hi]` (SPEC §5)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        heads, std = cfg.index_n_heads * cfg.index_head_dim, cfg.initializer_range
        self.wq = normal(rngs, (cfg.q_lora_rank, heads), std, ("q_lora", "index_heads"), compute=True)
        self.ww = normal(rngs, (cfg.hidden_size, cfg.index_n_heads), std, ("embed", "index_n"), compute=True)


@chex.dataclass(frozen=True)
class Bus:
    """What index sources publish to later layers of the same call (SPEC §2, §5).

    topk: [B, S, index_topk] int32 entry ids of the group's KV source, −1 = none.
    candidates: [B, S, pool] int32 entry ids from the candidate source, −1 = none.
    """

    topk: Array
    candidates: Array

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, s: int) -> "Bus":
        """The bus before any index source ran: nothing selected."""
        pool = cfg.candidate_pool_size if cfg.candidates_enabled else 0
        return cls(topk=jnp.full((batch, s, cfg.index_topk), NO_ENTRY, jnp.int32),
                   candidates=jnp.full((batch, s, pool), NO_ENTRY, jnp.int32))


def index_queries(cfg: ModelConfig, params: dict, x: Array, q_lat: Array, positions: Array, *,
                  quantize: bool) -> tuple[Array, Array]:
    """Indexer queries qI [B, S, Hi, Di] (RoPE'd, MXFP4 fake-quantized if `quantize`) and head weights w [B, S, Hi]."""
    if q_lat.shape[-1] != cfg.q_lora_rank or x.shape[-1] != cfg.hidden_size or x.shape[:2] != q_lat.shape[:2]:
        raise ValueError(f"index_queries: x.shape={x.shape}, q_lat.shape={q_lat.shape}; expected "
                         f"[B, S, {cfg.hidden_size}] and [B, S, {cfg.q_lora_rank}] with the same B, S")
    b, s = x.shape[:2]
    hi, di = cfg.index_n_heads, cfg.index_head_dim
    q = linear(q_lat, params["wq"], cfg.dtype).reshape(b, s, hi, di)  # [B, S, Hi, Di]
    freqs = rope_frequencies(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling)
    q = apply_rope(q, positions[:, :, None], freqs)
    if quantize:
        q = fake_quant(q, INDEX)
    w = linear(x, params["ww"], cfg.dtype) * (di**-0.5 * hi**-0.5)  # [B, S, Hi]
    return q, w


def visible_entries(positions: Array, ratio: int) -> Array:
    """Number of Global entries a query at position t may read: (t + 1) // ratio (SPEC §4)."""
    return ((positions + 1) // ratio).astype(jnp.int32)  # [B, S]


def select_topk(scores: Array, valid: Array, k: int, ids: Array | None = None) -> Array:
    """Top-min(k, n) valid columns by score, mapped through `ids`, sorted ascending and −1-padded to k."""
    n = scores.shape[-1]
    _, col = lax.top_k(jnp.where(valid, scores, -jnp.inf), min(k, n))  # [B, S, min(k, n)]
    chosen = col if ids is None else jnp.take_along_axis(ids, col, axis=-1)
    keep = jnp.take_along_axis(valid, col, axis=-1)
    chosen = jnp.sort(jnp.where(keep, chosen, _NO_ID), axis=-1)
    chosen = jnp.where(chosen == _NO_ID, NO_ENTRY, chosen).astype(jnp.int32)
    return jnp.pad(chosen, [(0, 0)] * (chosen.ndim - 1) + [(0, k - chosen.shape[-1])], constant_values=NO_ENTRY)


def full_topk(cfg: ModelConfig, qI: Array, w: Array, source: SourceKV, positions: Array,
              ratio: int) -> tuple[Array, Array]:
    """Top-`index_topk` over all visible entries of the group's Indexer K, and the masked scores [B, S, N]."""
    count = visible_entries(positions, ratio)  # [B, S]
    scores = ops.indexer_scores(qI, w, source.ikeys(), count, impl=cfg.kernel_impl)  # [B, S, N], −inf masked
    visible = jnp.arange(source.entries) < count[..., None]  # [B, S, N]
    return select_topk(scores, visible, cfg.index_topk), scores


def candidate_pool(cfg: ModelConfig, scores: Array, positions: Array, ratio: int) -> Array:
    """Entry ids of the top `candidate_topk_blocks` blocks (newest pinned), −1 where missing or not visible."""
    b, s, n = scores.shape
    size = cfg.candidate_block_size
    blocks = -(-n // size)
    vis = jnp.minimum(visible_entries(positions, ratio), n)[..., None]  # [B, S, 1]
    # Only the newest block mixes visible and not-yet-visible entries, and it is pinned, so the
    # plain max is the max over visible entries for every block that can be kept.
    block_max = ops.block_max(scores, size, impl=cfg.kernel_impl)  # [B, S, blocks]
    block = jnp.arange(blocks)
    block_max = jnp.where(block == (vis - 1) // size, jnp.inf, block_max)  # newest block pinned
    kept = select_topk(block_max, block * size < vis, cfg.candidate_topk_blocks)  # [B, S, Kb]
    pool = kept[..., None] * size + jnp.arange(size)  # [B, S, Kb, size]
    pool = jnp.where((kept[..., None] >= 0) & (pool < vis[..., None]), pool, NO_ENTRY)
    return pool.reshape(b, s, cfg.candidate_pool_size)  # [B, S, P]


def reindex_topk(cfg: ModelConfig, qI: Array, w: Array, source: SourceKV, pool: Array, positions: Array,
                 ratio: int) -> Array:
    """Top-`index_topk` inside the candidate pool [B, S, P]: gather its Indexer K, then score only it.

    The gathered op reads the stack's flat buffer at rows `offset + id`, so nothing of size N is
    touched; its visibility bound is shifted the same way.
    """
    count = visible_entries(positions, ratio)  # [B, S]
    scores = ops.indexer_scores_gathered(qI, w, source.ikey, source.rows(pool), count + source.offset,
                                         impl=cfg.kernel_impl)  # [B, S, P], −inf where invalid
    valid = (pool >= 0) & (pool < count[..., None])  # [B, S, P]
    return select_topk(scores, valid, cfg.index_topk, ids=pool)
