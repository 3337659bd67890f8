"""One CSA2 attention sublayer in every role, over an explicit chunk of tokens (SPEC §3–§6).

Prefill chunks, decode steps (S = 1) and verify blocks (S = γ + 1) run the same code: a chunk
is `S` tokens per row at positions `start + j`, of which the first `n_valid` are real.
Core attention reads, per query, exactly `W` window entries of this layer's SWA ring and
`index_topk` selected entries of the group's Global Main KV, in one softmax with a per-head
sink in the denominator (SPEC §3).

Index sources publish their top-k (and the candidate source its pool) on the `Bus`, which the
model threads through the layers in order; a Reuse layer reads the latest top-k.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

from csa2 import cache, quant
from csa2.compressor import init_compressor_params
from csa2.config import ModelConfig
from csa2.indexer import candidate_pool, full_topk, index_queries, init_indexer_params, reindex_topk
from csa2.layout import LayerSpec
from csa2.norm import rms_norm
from csa2.params import dense, linear, ones
from csa2.rope import apply_rope, rope_frequencies
from csa2.state import GlobalKV

Array = jax.Array


@chex.dataclass(frozen=True)
class Chunk:
    """Where a chunk sits: rows' first position `start [B]`, real tokens `n_valid [B]`, and the
    replay `floor [B]` below which no window entry is visible (SPEC §11; 0 = no floor)."""

    start: Array
    n_valid: Array
    floor: Array

    def positions(self, s: int) -> Array:
        return self.start[:, None] + jnp.arange(s, dtype=jnp.int32)[None, :]  # [B, S]

    def valid(self, s: int) -> Array:
        return jnp.arange(s, dtype=jnp.int32)[None, :] < self.n_valid[:, None]  # [B, S]


@chex.dataclass(frozen=True)
class Bus:
    """What index sources publish to later layers of the same step (SPEC §2, §5).

    topk: [B, S, index_topk] int32 entry ids of the group's Global KV, −1 = none.
    candidates: [B, S, pool] int32 entry ids from the candidate source, −1 = none.
    """

    topk: Array
    candidates: Array


def empty_bus(cfg: ModelConfig, batch: int, s: int) -> Bus:
    """The bus before any index source ran: nothing selected."""
    return Bus(topk=jnp.full((batch, s, cfg.index_topk), -1, jnp.int32),
               candidates=jnp.full((batch, s, cfg.candidate_pool_size if cfg.candidates_enabled else 0), -1, jnp.int32))


def validate_chunk(cfg: ModelConfig, x: Array, chunk: Chunk, capacity: int) -> None:
    """Boundary checks of a chunk (DESIGN §7); value checks run when the values are concrete."""
    if x.ndim != 3 or x.shape[-1] != cfg.hidden_size:
        raise ValueError(f"x.shape={x.shape}: expected [B, S, hidden_size={cfg.hidden_size}]")
    b, s, _ = x.shape
    for name in ("start", "n_valid", "floor"):
        if getattr(chunk, name).shape != (b,):
            raise ValueError(f"chunk.{name}.shape={getattr(chunk, name).shape}: expected [B]=({b},), one per row")
    if s > capacity:
        raise ValueError(f"chunk length {s} exceeds the state capacity {capacity}; split the prompt or "
                         "allocate a larger state")
    if any(isinstance(a, jax.core.Tracer) for a in (chunk.start, chunk.n_valid)):
        return
    start, n_valid = np.asarray(chunk.start), np.asarray(chunk.n_valid)
    if (n_valid < 0).any() or (n_valid > s).any():
        raise ValueError(f"chunk.n_valid={n_valid.tolist()}: each row needs 0 ≤ n_valid ≤ S={s}")
    if (start < 0).any() or (start + n_valid > capacity).any():
        raise ValueError(f"positions up to {(start + n_valid).max() - 1} are beyond the state capacity "
                         f"{capacity} (chunk.start={start.tolist()}); allocate a larger state")


def layer_frequencies(cfg: ModelConfig, ratio: int):
    """RoPE frequencies of a layer: plain θ for ratio-0 layers, YaRN θ' for compressed ones (SPEC §7)."""
    if ratio == 0:
        return rope_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta)
    return rope_frequencies(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling)


def init_attention_params(cfg: ModelConfig, spec: LayerSpec, key: Array) -> dict:
    """Parameters of one sublayer; Full layers own a compressor, index sources an indexer."""
    d, h, dh, g = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
    std = cfg.initializer_range
    k = jax.random.split(key, 7)
    p = {
        "wq_a": dense(k[0], (d, cfg.q_lora_rank), std), "q_norm": ones(cfg.q_lora_rank),
        "wq_b": dense(k[1], (cfg.q_lora_rank, h * dh), std),
        "wkv": dense(k[2], (d, dh), std), "kv_norm": ones(dh),
        "sink": jnp.zeros((h,), jnp.float32),
        "wo_a": dense(k[3], (g, h // g * dh, cfg.o_lora_rank), std),
        "wo_b": dense(k[4], (g * cfg.o_lora_rank, d), std),
    }
    if spec.role == "full":
        p["compressor"] = init_compressor_params(cfg, spec.ratio, k[5])
    if spec.role in ("full", "reindex"):
        p["indexer"] = init_indexer_params(cfg, k[6])
    return p


def window_ids(positions: Array, start: Array, window: int, slots: int) -> tuple[Array, Array]:
    """Window positions `[B, S, W]` (oldest first) and their index into `concat(ring, chunk)`.

    Positions before the chunk live in the ring at slot `p % slots`; the chunk's own positions
    follow the ring at `slots + (p − start)`.
    """
    pos = positions[..., None] - (window - 1) + jnp.arange(window, dtype=jnp.int32)  # [B, S, W]
    in_chunk = pos >= start[:, None, None]
    return pos, jnp.where(in_chunk, slots + pos - start[:, None, None], pos % slots)


def sink_attention(q: Array, keys: Array, valid: Array, sink: Array) -> Array:
    """One softmax over the entries with the per-head sink in the denominator only (SPEC §3).

    q [B, S, H, D], keys [B, S, E, D] (K = V), valid [B, S, E], sink [H] → [B, S, H, D] float32.
    A row with no valid entry returns 0.
    """
    scale = q.shape[-1] ** -0.5
    logits = jnp.einsum("bshd,bsed->bshe", q.astype(jnp.float32), keys.astype(jnp.float32)) * scale
    logits = jnp.where(valid[:, :, None, :], logits, -jnp.inf)
    sink = sink.astype(jnp.float32)[None, None, :]  # [1, 1, H]
    m = jnp.maximum(jnp.max(logits, axis=-1), sink)  # [B, S, H]; finite thanks to the sink
    p = jnp.exp(logits - m[..., None])
    denom = jnp.sum(p, axis=-1) + jnp.exp(sink - m)
    return jnp.einsum("bshe,bsed->bshd", p, keys.astype(jnp.float32)) / denom[..., None]


def grouped_output(cfg: ModelConfig, params: dict, o: Array) -> Array:
    """Heads → `o_groups` groups, per-group `W_oa[g]`, concat, `W_ob` (SPEC §3). o [B, S, H, D] → [B, S, d]."""
    b, s, h, dh = o.shape
    g = cfg.o_groups
    grouped = o.reshape(b, s, g, h // g * dh)
    mid = jnp.einsum("bsgi,gio->bsgo", grouped.astype(cfg.dtype), params["wo_a"].astype(cfg.dtype),
                     preferred_element_type=jnp.float32)
    return linear(mid.reshape(b, s, g * cfg.o_lora_rank), params["wo_b"], cfg.dtype)


def attention(
    cfg: ModelConfig,
    spec: LayerSpec,
    params: dict,
    x: Array,
    chunk: Chunk,
    ring: tuple[Array, Array | None],
    gkv: GlobalKV | None,
    bus: Bus,
    *,
    quantize: bool = True,
) -> tuple[Array, tuple[Array, Array | None], Bus]:
    """One sublayer on a chunk. x [B, S, d] is the normed collapsed residual.

    `ring` is this layer's (SWA kv, scales) `[B, slots, ...]`; `gkv` is the group's Global KV,
    already holding the entries this chunk completes (a Full layer's caller runs
    `compressor.compress` first, on this chunk or, under replay, on every prompt position).
    Returns the output [B, S, d], the updated ring and the bus. `quantize=False` (float cache
    only) skips every fake-quant.
    """
    b, s, _ = x.shape
    packed = ring[1] is not None
    positions, valid_q = chunk.positions(s), chunk.valid(s)
    freqs = layer_frequencies(cfg, spec.ratio)

    # Main Q and this layer's SWA KV (SPEC §3).
    q_lat = rms_norm(linear(x, params["wq_a"], cfg.dtype), params["q_norm"], cfg.rms_norm_eps)
    q = linear(q_lat, params["wq_b"], cfg.dtype).reshape(b, s, cfg.num_attention_heads, cfg.head_dim)
    q = apply_rope(q, positions[:, :, None], freqs)
    swa = rms_norm(linear(x, params["wkv"], cfg.dtype), params["kv_norm"], cfg.rms_norm_eps)
    swa = cache.encode(apply_rope(swa, positions, freqs), quant.WINDOW, packed, quantize)

    # Window: positions max(floor, t−W+1) … t, from the ring and this chunk.
    slots = ring[0].shape[1]
    pos, ids = window_ids(positions, chunk.start, cfg.sliding_window, slots)
    source = [jnp.concatenate([r, c], axis=1) if r is not None else None for r, c in zip(ring, swa)]
    keys = [cache.gather(source[0], source[1], ids, quant.WINDOW)]  # [B, S, W, D]
    valid = [pos >= jnp.maximum(chunk.floor, 0)[:, None, None]]

    # Global entries selected by this group's indexer (SPEC §5).
    if spec.role != "swa":
        if spec.role in ("full", "reindex"):
            q_index, w_index = index_queries(cfg, params["indexer"], x, q_lat, positions, quantize=quantize)
            if spec.uses_candidates:
                topk = reindex_topk(cfg, q_index, w_index, gkv, bus.candidates, positions, spec.ratio)
            else:
                topk, scores = full_topk(cfg, q_index, w_index, gkv, positions, spec.ratio)
                if spec.is_candidate_source:
                    bus = bus.replace(candidates=candidate_pool(cfg, scores, positions, spec.ratio))
            bus = bus.replace(topk=topk)
        keys.append(cache.gather(gkv.kv, gkv.kv_scale, bus.topk, quant.MAIN))  # [B, S, K, D]
        valid.append(bus.topk >= 0)

    o = sink_attention(q, jnp.concatenate(keys, axis=2), jnp.concatenate(valid, axis=2), params["sink"])
    o = apply_rope(o, positions[:, :, None], freqs, inverse=True)  # value carries RoPE (K = V)
    out = grouped_output(cfg, params, o)

    new_length = chunk.start + chunk.n_valid
    ring = tuple(None if r is None else cache.ring_scatter(r, positions, c, valid_q, new_length)
                 for r, c in zip(ring, swa))
    return out, ring, bus
