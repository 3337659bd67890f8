"""One CSA2 attention sublayer in every role, over an explicit chunk of tokens (SPEC §3–§6).

Core attention reads, per query, exactly `W` window entries of this layer's SWA ring and
`index_topk` selected entries of the group's Global Main KV, in one softmax with a per-head sink
in the denominator (SPEC §3). It runs in `pallas_kernels.ops.sparse_attention` (the reference or
the kernels, `cfg.kernel_impl`), which gathers and dequantizes the selected rows itself (DESIGN §4).
Index sources publish their top-k (and the candidate source its pool) on the `Bus`; a Reuse layer
reads the latest top-k. A Full layer writes its group's Global KV first (its compressor, SPEC §4).

The sublayer owns its part of the request state: it takes its `LayerKV` (ring, source, compressor tail) and
returns it updated. What a Global-reading layer reads, and what every layer exposes for measurement, is the
call's instrument (`csa2.hooks`): by default its own top-k, and nothing.
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from csa2 import cache
from csa2.chunk import take_rows
from csa2.compressor import Compressor, compress
from csa2.config import ModelConfig
from csa2.context import Context
from csa2.hooks import Sight
from csa2.indexer import Bus, Indexer, candidate_pool, full_topk, index_queries, reindex_topk
from csa2.layout import LayerSpec
from csa2.norm import rms_norm
from csa2.params import linear, normal, ones, zeros
from csa2.replay import DecoderTail
from csa2.rope import apply_rope, rope_frequencies
from csa2.state import LayerKV
from pallas_kernels import ops
from pallas_kernels.formats import MAIN
from pallas_kernels.stored import NO_ENTRY, Stored, concat_rows

Array = jax.Array


class Attention(nnx.Module):
    """Parameters of one sublayer (SPEC §3); Full layers own a compressor, index sources an indexer."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, rngs: nnx.Rngs):
        d, h, dh, g, std = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.o_groups, cfg.initializer_range
        self.wq_a = normal(rngs, (d, cfg.q_lora_rank), std, ("embed", "q_lora"), compute=True)
        self.q_norm = ones((cfg.q_lora_rank,), ("q_lora",))
        self.wq_b = normal(rngs, (cfg.q_lora_rank, h * dh), std, ("q_lora", "heads"), compute=True)
        self.wkv = normal(rngs, (d, dh), std, ("embed", "latent"), compute=True)
        self.kv_norm = ones((dh,), ("latent",))
        self.sink = zeros((h,), ("heads",))
        self.wo_a = normal(rngs, (g, h // g * dh, cfg.o_lora_rank), std, ("o_groups", "o_group_in", "o_lora"),
                           compute=True)
        self.wo_b = normal(rngs, (g * cfg.o_lora_rank, d), std, ("o_lora_all", "embed"), compute=True)
        if spec.role == "full":
            self.compressor = Compressor(cfg, spec.ratio, rngs)
        if spec.role in ("full", "reindex"):
            self.indexer = Indexer(cfg, rngs)


def layer_frequencies(cfg: ModelConfig, ratio: int) -> np.ndarray:
    """RoPE frequencies of a layer: plain θ for ratio-0 layers, YaRN θ' for compressed ones (SPEC §7)."""
    if ratio == 0:
        return rope_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta)
    return rope_frequencies(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling)


def window_ids(positions: Array, start: Array, window: int, slots: int) -> tuple[Array, Array]:
    """Window positions `[B, S, W]` (oldest first) and their index into `concat(ring, chunk)`.

    Positions before the chunk live in the ring at slot `p % slots`; the chunk's own positions
    follow the ring at `slots + (p − start)`.
    """
    pos = positions[..., None] - (window - 1) + jnp.arange(window, dtype=jnp.int32)  # [B, S, W]
    in_chunk = pos >= start[:, None, None]
    return pos, jnp.where(in_chunk, slots + pos - start[:, None, None], pos % slots)


def queries(cfg: ModelConfig, params: dict, x: Array, positions: Array, freqs: np.ndarray) -> tuple[Array, Array]:
    """The query latent `[B, S, q_lora]` (the indexer reads it) and the rotated main queries `[B, S, H, D]` of
    the normed collapsed residual x [B, S, d] (SPEC §3)."""
    b, s, _ = x.shape
    q_lat = rms_norm(linear(x, params["wq_a"], cfg.dtype), params["q_norm"], cfg.rms_norm_eps)
    q = linear(q_lat, params["wq_b"], cfg.dtype).reshape(b, s, cfg.num_attention_heads, cfg.head_dim)
    return q_lat, apply_rope(q, positions[:, :, None], freqs)


def window_kv(cfg: ModelConfig, params: dict, x: Array, positions: Array, freqs: np.ndarray) -> Array:
    """The rotated single-head window KV `[B, S, D]` (K = V) of inputs x [B, S, d] (SPEC §3), before storage."""
    kv = rms_norm(linear(x, params["wkv"], cfg.dtype), params["kv_norm"], cfg.rms_norm_eps)
    return apply_rope(kv, positions, freqs)


def output(cfg: ModelConfig, params: dict, o: Array, positions: Array, freqs: np.ndarray) -> Array:
    """Attention values o [B, S, H, D] → the sublayer output [B, S, d]: undo the value's RoPE (K = V carries
    it), then the grouped output projection (SPEC §3)."""
    return grouped_output(cfg, params, apply_rope(o, positions[:, :, None], freqs, inverse=True))


def grouped_output(cfg: ModelConfig, params: dict, o: Array) -> Array:
    """Heads → `o_groups` groups, per-group `W_oa[g]`, concat, `W_ob` (SPEC §3). o [B, S, H, D] → [B, S, d]."""
    b, s, h, dh = o.shape
    g = cfg.o_groups
    grouped = o.reshape(b, s, g, h // g * dh).astype(cfg.dtype)
    wo_a = params["wo_a"].astype(cfg.dtype)
    if jax.default_backend() == "cpu":  # XLA:CPU has no bf16 batched matmul with an inner batch axis: the same
        grouped, wo_a = grouped.astype(jnp.float32), wo_a.astype(jnp.float32)  # products, exact in float32
    mid = jnp.einsum("bsgi,gio->bsgo", grouped, wo_a, preferred_element_type=jnp.float32)
    return linear(mid.reshape(b, s, g * cfg.o_lora_rank), params["wo_b"], cfg.dtype)


def read_attention(cfg: ModelConfig, q: Array, sink: Array, main: Stored, main_idx: Array, window: Stored,
                   window_idx: Array) -> Array:
    """`ops.sparse_attention` over the Global rows `main_idx [B, S, K]` that the heads share, or, given one set per
    head `[B, S, H, K]` (an instrument's read, `csa2.hooks`), each head over its own set with its own sink."""
    if main_idx.ndim == 3:
        return ops.sparse_attention(q, sink, main, main_idx, window, window_idx, impl=cfg.kernel_impl)

    def one_head(q_h, sink_h, idx_h):  # [B, S, D], [], [B, S, K]
        return ops.sparse_attention(q_h[:, :, None], sink_h[None], main, idx_h, window, window_idx,
                                    impl=cfg.kernel_impl)[:, :, 0]

    return jax.vmap(one_head, in_axes=(2, 0, 2), out_axes=2)(q, sink, main_idx)


def attention(cfg: ModelConfig, spec: LayerSpec, params: dict, x: Array, kv: LayerKV, bus: Bus, ctx: Context,
              layer: Array | int, enter: DecoderTail | None = None) -> tuple[Array, LayerKV, Bus, Any]:
    """One sublayer on a chunk (`ctx.chunk`); x [B, S, d] is the normed collapsed residual, `kv` the layer's
    view of the request state, `layer` its index (may be traced).

    A Full layer first compresses x into its group's Global KV (SPEC §4), so the source it reads holds the
    entries this chunk completes. At the replay split (`enter`, SPEC §11) its compressor sees every row and the
    rest of the layer continues on the decoder tail's rows, with the tail's chunk. Returns the output
    [B, S', d] (S' = the tail's rows when entering it, else S), the view with this chunk's entries written
    (ring; source and tail on Full layers), the bus, and the layer's tap (`ctx.instrument`, `csa2.hooks`).
    """
    chunk = ctx.chunk
    b, s, _ = x.shape
    chex.assert_shape(x, (b, s, cfg.hidden_size))
    chex.assert_shape([chunk.start, chunk.n_valid, chunk.floor], (b,))
    chex.assert_shape(kv.ring.payload, (b, None, None))
    if spec.compresses:
        with jax.named_scope("compress"):
            source, tail = compress(cfg, params["compressor"], spec.ratio, kv.source, kv.tail, x, chunk.start,
                                    chunk.n_valid, quantize=ctx.quantize, written_from=ctx.written_from)
        kv = kv.replace(source=source, tail=tail)
    if enter is not None:
        x, bus = jax.tree.map(lambda a: take_rows(a, enter.rows), (x, bus))
        chunk, s = enter.chunk, enter.rows.shape[1]
    ring, source = kv.ring, kv.source
    positions, valid_q = chunk.positions(s), chunk.valid(s)
    freqs = layer_frequencies(cfg, spec.ratio)

    # Main Q and this layer's SWA KV (SPEC §3).
    with jax.named_scope("queries"):
        q_lat, q = queries(cfg, params, x, positions, freqs)
    with jax.named_scope("window_kv"):
        swa = cache.encode(window_kv(cfg, params, x, positions, freqs), ring, ctx.quantize)  # [B, S, ·]

    # Window: positions max(floor, t−W+1) … t, from the ring and this chunk.
    pos, ids = window_ids(positions, chunk.start, cfg.sliding_window, ring.rows)
    window = concat_rows(ring, swa)  # [B, slots + S, ·]
    floor = ctx.window_floor(layer) if enter is None else chunk.floor  # the tail's chunk: the decoder floor
    window_idx = jnp.where(pos >= jnp.maximum(floor, 0)[:, None, None], ids, NO_ENTRY)  # [B, S, W]

    # Global entries selected by this group's indexer (SPEC §5).
    q_index = w_index = None
    if spec.role in ("full", "reindex"):
        with jax.named_scope("indexer"):
            # The indexer only feeds top-k and its own loss: detach its inputs from the main graph (SPEC §13).
            q_index, w_index = index_queries(cfg, params["indexer"], jax.lax.stop_gradient(x),
                                             jax.lax.stop_gradient(q_lat), positions, quantize=ctx.quantize)
            if spec.uses_candidates:
                topk = reindex_topk(cfg, q_index, w_index, source, bus.candidates, positions, spec.ratio)
            else:
                topk, scores = full_topk(cfg, q_index, w_index, source, positions, spec.ratio)
                if spec.is_candidate_source:
                    bus = bus.replace(candidates=candidate_pool(cfg, scores, positions, spec.ratio))
        bus = bus.replace(topk=topk)

    # Core attention: the W window rows and the selected Global entries in one sink softmax (SPEC §3).
    sight = Sight(spec=spec, entries=ctx.entries, layer=jnp.asarray(layer, jnp.int32), q=q, sink=params["sink"],
                  window=window, window_idx=window_idx, source=source, bus=bus, q_index=q_index, w_index=w_index,
                  positions=positions, valid=valid_q)
    if spec.role == "swa":
        main, main_idx = Stored.empty((b, 0), cfg.head_dim, MAIN, ring.packed), jnp.zeros((b, s, 0), jnp.int32)
        heads = ctx.instrument.heads(cfg)
        read = jnp.full((b, s) + (heads,) * (heads > 1) + (ctx.instrument.width(cfg),), NO_ENTRY, jnp.int32)
    else:
        with jax.named_scope("read_hook"):
            read = ctx.instrument.read(cfg, sight)
        main, main_idx = source.kv, source.rows(read)
    with jax.named_scope("sparse_attention"):
        o = read_attention(cfg, q, params["sink"], main, main_idx, window, window_idx)
    with jax.named_scope("tap"):
        tap = ctx.instrument.tap(cfg, sight, read)
    with jax.named_scope("attn_output"):
        out = output(cfg, params, o, positions, freqs)

    slot, keep = cache.ring_slots(positions, valid_q, chunk.end, ring.rows)
    return out, kv.replace(ring=ring.write(slot, swa, keep), source=source), bus, tap
