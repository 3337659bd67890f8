"""The request state: frozen pytrees with static shapes, everything keyed by absolute position.

DESIGN §2. `length[B]` (tokens committed per row) is the single source of truth:
- Global entry `i` of a ratio-r source is valid iff `i < length // r` (SPEC §4);
- ring slot `p % slots` holds position `p` for the valid positions `[length − W, length)`;
- the compressor tail of a ratio-r source is the positions `[r·(length // r), length)`;
- the Engram token history holds the last `engram_max_ngram_size − 1` positions.
Everything beyond `length` is scratch, so commit after verify is "set `length`", rollback is
"keep the previous pytree" and fork is "gather rows" (all in `csa2.model`).

Cache formats: `"fp4"` stores the SPEC §8 formats (FP4/MXFP4 payloads packed two per byte with
e4m3 / ue8m0 scales, FP8 rings with ue8m0 scales); `"float"` stores float32 values (QAT and the
exact reference) and leaves the scale fields `None`.
"""

from __future__ import annotations

import math
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np

from csa2 import quant
from csa2.config import ModelConfig

CACHE_FORMATS = ("fp4", "float")
Array = jax.Array


@chex.dataclass(frozen=True)
class GlobalKV:
    """One KV source's compressed cache (SPEC §4): `capacity // ratio` entries per row.

    kv:   Main KV  [B, N, head_dim // 2] uint8 (FP4 packed) | [B, N, head_dim] float32
    ikey: Indexer K [B, N, index_head_dim // 2] uint8 (MXFP4 packed) | [B, N, index_head_dim] float32
    """

    kv: Array
    kv_scale: Array | None  # [B, N, head_dim // 16] float8_e4m3fn, or None in float format
    ikey: Array
    ikey_scale: Array | None  # [B, N, index_head_dim // 32] float8_e8m0fnu, or None


@chex.dataclass(frozen=True)
class SwaRing:
    """Every layer's sliding-window KV, stacked over layers: `W + max_draft` slots, slot = pos % slots.

    kv: [L, B, slots, head_dim] float8_e4m3fn (fp4 format) | float32
    """

    kv: Array
    scale: Array | None  # [L, B, slots, head_dim // 32] float8_e8m0fnu, or None


@chex.dataclass(frozen=True)
class CompressorTail:
    """Pre-pool projections of a ratio-r source's recent tokens (SPEC §4), slot = pos % slots.

    Only the incomplete group `[r·(length // r), length)` is ever read; `ratio + max_draft`
    slots keep it intact while a verify block writes speculative positions after it.
    kv, gate: [B, slots, head_dim] float32 (W_ckv x and W_cg x).
    """

    kv: Array
    gate: Array


@chex.dataclass(frozen=True)
class AcceptBuffer:
    """Tokens emitted by the last verify/commit (accepted drafts + bonus, SPEC §12).

    tokens: [B, max_draft + 1] int32; count: [B] int32 valid entries. The last one is the
    next step's R (sampled, not yet in the cache).
    """

    tokens: Array
    count: Array


@chex.dataclass(frozen=True)
class State:
    """All per-request state of the model (DESIGN §2)."""

    length: Array  # [B] int32 committed tokens per row
    floor: Array  # [B] int32 decoder SWA floor: replay prefill ran decoder layers only from here (SPEC §11)
    global_kv: tuple[GlobalKV, ...]  # one per KV source, in kv_source_layer_ids order
    swa: SwaRing
    tails: tuple[CompressorTail, ...]  # one per KV source (empty arrays for ratio-1 sources)
    tokens: Array  # [B, history_slots] int32 Engram token history, slot = pos % history_slots
    accept: AcceptBuffer

    @property
    def batch(self) -> int:
        return self.length.shape[0]


def ring_slots(cfg: ModelConfig) -> int:
    """SWA ring size: the window plus room for a verify block's speculative writes."""
    return cfg.sliding_window + cfg.max_draft


def tail_slots(cfg: ModelConfig, ratio: int) -> int:
    """Tail buffer size of a ratio-`ratio` source (0 when no pooling happens)."""
    return ratio + cfg.max_draft if ratio > 1 else 0


def history_slots(cfg: ModelConfig) -> int:
    """Engram token history size: n−1 past tokens plus a verify block."""
    return (cfg.engram_max_ngram_size - 1 + cfg.max_draft + 1) if cfg.engram_layer_ids else 0


def token_granule(cfg: ModelConfig) -> int:
    """Capacity must be a multiple of every compress ratio so entry counts are exact."""
    return math.lcm(1, *(r for r in cfg.compress_ratios if r > 0))


def _quantized(fn, dim: int) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """Shapes/dtypes of one quantized entry, read from the quantizer itself."""
    return jax.eval_shape(fn, jax.ShapeDtypeStruct((dim,), jnp.float32))


def _entries(lead: tuple[int, ...], entry: jax.ShapeDtypeStruct) -> Array:
    return jnp.zeros(lead + entry.shape, entry.dtype)


def _scales(lead: tuple[int, ...], entry: jax.ShapeDtypeStruct) -> Array:
    """Empty scales are 1: ue8m0 has no zero (0.0 would become NaN and poison masked reads)."""
    return jnp.ones(lead + entry.shape, entry.dtype)


def _is_count(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def validate_state_args(cfg: ModelConfig, batch: int, capacity: int, cache_format: str) -> None:
    if not _is_count(batch) or batch < 1:
        raise ValueError(f"init_state: batch={batch!r} must be a positive integer")
    granule = token_granule(cfg)
    if not _is_count(capacity) or capacity < 1 or capacity % granule:
        raise ValueError(f"init_state: capacity={capacity!r} must be a positive multiple of {granule} "
                         "(the compress ratios), e.g. a power of two")
    if capacity > cfg.max_position_embeddings:
        raise ValueError(f"init_state: capacity={capacity} exceeds max_position_embeddings="
                         f"{cfg.max_position_embeddings}; lower it or raise the config field")
    if cache_format not in CACHE_FORMATS:
        raise ValueError(f"init_state: cache_format={cache_format!r}; use one of {CACHE_FORMATS}")


def init_state(cfg: ModelConfig, batch: int, capacity: int, cache_format: str = "fp4") -> State:
    """An empty state for `batch` rows of up to `capacity` tokens (all lengths 0)."""
    validate_state_args(cfg, batch, capacity, cache_format)
    packed = cache_format == "fp4"
    f32 = jax.ShapeDtypeStruct((cfg.head_dim,), jnp.float32)
    f32_index = jax.ShapeDtypeStruct((cfg.index_head_dim,), jnp.float32)
    main = _quantized(quant.quantize_main, cfg.head_dim) if packed else (f32, None)
    index = _quantized(quant.quantize_index, cfg.index_head_dim) if packed else (f32_index, None)
    window = _quantized(quant.quantize_window, cfg.head_dim) if packed else (f32, None)

    def maybe(lead, entry):
        return None if entry is None else _scales(lead, entry)

    global_kv, tails = [], []
    for src in cfg.kv_source_layer_ids:
        ratio = cfg.compress_ratios[src]
        lead = (batch, capacity // ratio)
        global_kv.append(GlobalKV(kv=_entries(lead, main[0]), kv_scale=maybe(lead, main[1]),
                                  ikey=_entries(lead, index[0]), ikey_scale=maybe(lead, index[1])))
        t = (batch, tail_slots(cfg, ratio), cfg.head_dim)
        tails.append(CompressorTail(kv=jnp.zeros(t, jnp.float32), gate=jnp.zeros(t, jnp.float32)))
    ring_lead = (cfg.num_hidden_layers, batch, ring_slots(cfg))
    return State(
        length=jnp.zeros((batch,), jnp.int32),
        floor=jnp.zeros((batch,), jnp.int32),
        global_kv=tuple(global_kv),
        swa=SwaRing(kv=_entries(ring_lead, window[0]), scale=maybe(ring_lead, window[1])),
        tails=tuple(tails),
        tokens=jnp.full((batch, history_slots(cfg)), cfg.engram_pad_id, jnp.int32),
        accept=AcceptBuffer(tokens=jnp.zeros((batch, cfg.max_draft + 1), jnp.int32),
                            count=jnp.zeros((batch,), jnp.int32)),
    )


def abstract_state(cfg: ModelConfig, batch: int, capacity: int, cache_format: str = "fp4") -> State:
    """`init_state` as shapes only (`jax.eval_shape`): no memory is allocated, so 1M tokens is fine."""
    validate_state_args(cfg, batch, capacity, cache_format)
    return jax.eval_shape(lambda: init_state(cfg, batch, capacity, cache_format))


def _nbytes(tree: Any) -> int:
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))


def state_bytes(state: State) -> dict[str, int]:
    """Bytes per component, from the actual arrays (or `ShapeDtypeStruct`s of `abstract_state`)."""
    parts = {
        "global_kv": _nbytes(state.global_kv),
        "swa": _nbytes(state.swa),
        "tails": _nbytes(state.tails),
        "tokens": _nbytes(state.tokens),
        "accept": _nbytes(state.accept),
        "length": _nbytes(state.length),
        "floor": _nbytes(state.floor),
    }
    parts["total"] = sum(parts.values())
    return parts


def kv_bytes_per_token(cfg: ModelConfig, cache_format: str = "fp4") -> float:
    """Global KV bytes per token (SPEC §8): Σ over KV sources of (Main + Indexer K entry) / ratio.

    890.0 for `v41_flash` in fp4: (3 × ½ + 1) × (288 + 68).
    """
    if cache_format == "fp4":
        entry = quant.entry_bytes(quant.MAIN, cfg.head_dim) + quant.entry_bytes(quant.INDEX, cfg.index_head_dim)
    elif cache_format == "float":
        entry = 4 * (cfg.head_dim + cfg.index_head_dim)
    else:
        raise ValueError(f"kv_bytes_per_token: cache_format={cache_format!r}; use one of {CACHE_FORMATS}")
    return float(sum(entry / cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids))


def swa_bytes_per_sequence(cfg: ModelConfig, cache_format: str = "fp4") -> int:
    """SPEC §8's fixed SWA cost: every layer keeps W window entries (excluding verify slots)."""
    if cache_format == "fp4":
        entry = quant.entry_bytes(quant.WINDOW, cfg.head_dim)
    elif cache_format == "float":
        entry = 4 * cfg.head_dim
    else:
        raise ValueError(f"swa_bytes_per_sequence: cache_format={cache_format!r}; use one of {CACHE_FORMATS}")
    return cfg.num_hidden_layers * cfg.sliding_window * entry


def capacity(cfg: ModelConfig, state: State) -> int:
    """Tokens per row the state can hold (static: read from the Global KV shapes)."""
    if not state.global_kv:
        raise ValueError("capacity: the config has no KV source, so the state has no token capacity")
    src = cfg.kv_source_layer_ids[0]
    return state.global_kv[0].kv.shape[1] * cfg.compress_ratios[src]
