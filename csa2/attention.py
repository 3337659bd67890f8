"""One CSA2 attention sublayer in every role, over an explicit chunk of tokens (SPEC §3–§6).

Prefill chunks, decode steps (S = 1) and verify blocks (S = γ + 1) run the same code: a chunk
is `S` tokens per row at positions `start + j`, of which the first `n_valid` are real.
Core attention reads, per query, exactly `W` window entries of this layer's SWA ring and
`index_topk` selected entries of the group's Global Main KV, in one softmax with a per-head
sink in the denominator (SPEC §3).

Index sources publish their top-k (and the candidate source its pool) on the `Bus`, which the
model threads through the layers in order; a Reuse layer reads the latest top-k.

`cfg.kernel_impl == "pallas"` runs the core attention in `pallas_kernels.ops.sparse_attention`,
which gathers and dequantizes the selected ring / Main KV rows itself (DESIGN §4); the jnp
gather + `sink_attention` below is the "xla" path and its oracle. The indexer loss (SPEC §13,
training only) needs the gathered keys, so a call with `index_loss` always takes the jnp path.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

from csa2 import cache, quant
from csa2.compressor import init_compressor_params
from csa2.config import ModelConfig
from csa2 import index_loss as index_loss_lib
from csa2.indexer import (candidate_pool, full_topk, index_queries, index_scores, init_indexer_params, reindex_topk,
                          uses_pallas, visible_entries)
from csa2.layout import LayerSpec
from csa2.norm import rms_norm
from csa2.params import dense, linear, ones
from csa2.rope import apply_rope, rope_frequencies
from csa2.state import GlobalKV
from pallas_kernels import ops

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


def attention_probs(q: Array, keys: Array, valid: Array, sink: Array) -> Array:
    """Probabilities [B, S, H, E] of one softmax over the entries with the per-head sink in the
    denominator only (SPEC §3). q [B, S, H, D], keys [B, S, E, D], valid [B, S, E], sink [H]."""
    logits = jnp.einsum("bshd,bsed->bshe", q.astype(jnp.float32), keys.astype(jnp.float32)) * q.shape[-1] ** -0.5
    logits = jnp.where(valid[:, :, None, :], logits, -jnp.inf)
    sink = sink.astype(jnp.float32)[None, None, :, None]
    m = jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), sink)  # finite thanks to the sink
    p = jnp.exp(logits - m)
    return p / (jnp.sum(p, axis=-1, keepdims=True) + jnp.exp(sink - m))


def sink_attention(q: Array, keys: Array, valid: Array, sink: Array) -> Array:
    """Core attention with K = V: `Σ_e p_e kv_e` [B, S, H, D] float32 (SPEC §3). A row with no
    valid entry returns 0 (all its mass is on the sink)."""
    return jnp.einsum("bshe,bsed->bshd", attention_probs(q, keys, valid, sink), keys.astype(jnp.float32))


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
    index_loss: str | None = None,
) -> tuple[Array, tuple[Array, Array | None], Bus, Array]:
    """One sublayer on a chunk. x [B, S, d] is the normed collapsed residual.

    `ring` is this layer's (SWA kv, scales) `[B, slots, ...]`; `gkv` is the group's Global KV,
    already holding the entries this chunk completes (a Full layer's caller runs
    `compressor.compress` first, on this chunk or, under replay, on every prompt position).
    Returns the output [B, S, d], the updated ring, the bus and the indexer KL loss of SPEC §13
    (an index source with `index_loss` "sparse" or "dense"; 0 otherwise). `quantize=False`
    (float cache only) skips every fake-quant.
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
    in_window = pos >= jnp.maximum(chunk.floor, 0)[:, None, None]  # [B, S, W]

    # Global entries selected by this group's indexer (SPEC §5).
    if spec.role in ("full", "reindex"):
        # The indexer only feeds top-k and its own loss: detach its inputs from the main graph (SPEC §13).
        q_index, w_index = index_queries(cfg, params["indexer"], jax.lax.stop_gradient(x),
                                         jax.lax.stop_gradient(q_lat), positions, quantize=quantize)
        if spec.uses_candidates:
            topk = reindex_topk(cfg, q_index, w_index, gkv, bus.candidates, positions, spec.ratio)
        else:
            topk, scores = full_topk(cfg, q_index, w_index, gkv, positions, spec.ratio)
            if spec.is_candidate_source:
                bus = bus.replace(candidates=candidate_pool(cfg, scores, positions, spec.ratio))
        bus = bus.replace(topk=topk)

    # Core attention: the W window rows and the selected Global entries in one sink softmax (SPEC §3).
    kl = jnp.zeros((), jnp.float32)
    if uses_pallas(cfg) and index_loss is None:  # the kernel gathers and dequantizes the rows itself
        main = (gkv.kv, gkv.kv_scale, bus.topk) if spec.role != "swa" else _no_entries(q)
        o = ops.sparse_attention(q, params["sink"], *main, *source, jnp.where(in_window, ids, -1), impl="pallas")
    else:
        keys = [cache.gather(source[0], source[1], ids, quant.WINDOW)]  # [B, S, W, D]
        valid = [in_window]
        if spec.role != "swa":
            keys.append(cache.gather(gkv.kv, gkv.kv_scale, bus.topk, quant.MAIN))  # [B, S, K, D]
            valid.append(bus.topk >= 0)
        keys, valid = jnp.concatenate(keys, axis=2), jnp.concatenate(valid, axis=2)
        if index_loss is not None and spec.role in ("full", "reindex"):
            kl = _index_loss(cfg, spec, index_loss, q, keys, valid, params["sink"], q_index, w_index, gkv, bus.topk,
                             positions, valid_q)
        o = sink_attention(q, keys, valid, params["sink"])
    o = apply_rope(o, positions[:, :, None], freqs, inverse=True)  # value carries RoPE (K = V)
    out = grouped_output(cfg, params, o)

    new_length = chunk.start + chunk.n_valid
    ring = tuple(None if r is None else cache.ring_scatter(r, positions, c, valid_q, new_length)
                 for r, c in zip(ring, swa))
    return out, ring, bus, kl


def _no_entries(q: Array) -> tuple[Array, None, Array]:
    """An empty Main KV source for an SWA-only layer: float rows [B, 0, D], no scales, ids [B, S, 0]."""
    b, s, _, d = q.shape
    return jnp.zeros((b, 0, d), jnp.float32), None, jnp.zeros((b, s, 0), jnp.int32)


def _index_loss(cfg, spec, mode, q, keys, valid, sink, q_index, w_index, gkv, topk, positions, valid_q):
    """SPEC §13 on this layer: main attention mass vs the indexer's scores, on the selected or visible set."""
    if mode not in index_loss_lib.MODES:
        raise ValueError(f"index_loss={mode!r}: use one of {index_loss_lib.MODES} or None")
    w = cfg.sliding_window
    if mode == "sparse":
        probs = attention_probs(q, keys, valid, sink)[..., w:]  # [B, S, H, K]
        ikeys = cache.gather(gkv.ikey, gkv.ikey_scale, topk, quant.INDEX)  # [B, S, K, Di]
        return index_loss_lib.indexer_kl(probs, index_scores(q_index, w_index, ikeys), topk >= 0, valid_q)
    every = cache.decode(gkv.kv, gkv.kv_scale, quant.MAIN)  # [B, N, D]
    n = every.shape[1]
    visible = jnp.arange(n) < visible_entries(positions, spec.ratio)[..., None]  # [B, S, N]
    all_keys = jnp.concatenate([keys[:, :, :w], jnp.broadcast_to(every[:, None], (*q.shape[:2], *every.shape[1:]))], 2)
    probs = attention_probs(q, all_keys, jnp.concatenate([valid[..., :w], visible], -1), sink)[..., w:]
    scores = index_scores(q_index, w_index, cache.decode(gkv.ikey, gkv.ikey_scale, quant.INDEX))
    return index_loss_lib.indexer_kl(probs, scores, visible, valid_q)
