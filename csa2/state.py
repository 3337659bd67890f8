"""The request state: frozen pytrees with static shapes, everything keyed by absolute position.

DESIGN §2. `length[B]` (tokens committed per row) is the single source of truth:
- Global entry `i` of a ratio-r source is valid iff `i < length // r` (SPEC §4);
- ring slot `p % slots` holds position `p` for the valid positions `[length − W, length)`;
- the compressor tail of a ratio-r source is the positions `[r·(length // r), length)`;
- the Engram token history holds the last `engram_max_ngram_size − 1` positions;
- each DSpark draft stage's context window (SPEC §12) is a ring like the SWA rings, written by every
  call for the rows whose target features it computed.
Everything beyond `length` is scratch, so commit after verify is "set `length`", rollback is
"keep the previous pytree" and fork is "gather rows" (all in `csa2.model`).

`floor[B]` is the one other value that changes what a row reads: the decoder SWA floor of SPEC §11.
The layers from the replay split on never read a window entry below `floor`. A prefill with a replay
window R runs those layers only on its extend's decoder tail `[end − T, end)`, T = min(R, end − start)
(`csa2.replay.Extend`: the prompt's new tokens, in however many chunks), so their rings hold nothing
older; each such call that gives a row tokens raises the row's floor to `end − T` (never lowers it; a
"borrow" short extend on a prefix hit raises it to `end − R` only, `csa2.replay.ReplayPolicy`).
Exact prefills, decode steps, verify and a row with no tokens in the call leave it where it is.

Every leaf has the batch axis first, so `fork` is one tree map. Same-ratio KV sources are stacked
(`layout.kv_stacks`): `global_kv[k]` holds every source of stack k, `[B, G, N, ·]`, and the SWA
rings of all layers are one buffer `[B, L, slots, ·]`.

What is bitwise, and what is equal to rounding. A row's outputs and state never depend on the other rows of
its batch, but "the same" means two things:
- **bitwise**, at fixed shapes and batch positions: in one program (the same batch size, chunk length and
  capacity), changing another row's tokens or length changes no bit of a row's logits or state; `fork` is a
  gather, so a forked row holds its source row's bits; resume, checkpoints, storage formats and gathers are
  bit-exact.
- **to float rounding**, across shapes or positions: the same rows run at a different batch size, chunking or
  length are a different program, and XLA:CPU promises no bitwise equality between those (vector widths, tiling,
  summation order and library kernels follow the shape and the host's ISA). A row moved to another batch position
  (a forked row continued where its source was not) is in the same place: XLA:CPU may round a row by its position
  in the batch (on AVX2 the DSpark block's attention does, by up to 2.7e-7). With the float numerics
  (`numerics="float"`) they agree to a few ulps; with the SPEC §8 numerics those ulps can flip a rare FP4/FP8
  element at a rounding midpoint, moving later logits by ~1e-3, and a greedy token can flip where two logits tie
  to that precision.
The tests state each promise where it applies (`tests/csa2/test_model.py`, the fuzz harness `infer.fuzz` and its
fast slice `tests/infer/test_fuzz.py`), and the cross-shape ones run again under another instruction set
(`tests/test_isa.py`).

Cache formats: `"fp4"` stores the SPEC §8 formats (FP4/MXFP4 payloads packed two per byte with
e4m3 / ue8m0 scales, FP8 rings with ue8m0 scales); `"float"` stores float32 values (QAT and the
exact reference) with `scale=None`. Either way a buffer is one `Stored` value.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import chex
import jax
import jax.numpy as jnp

from csa2.checks import is_int, tree_bytes
from csa2.config import ModelConfig
from csa2.layout import kv_stacks
from pallas_kernels.formats import INDEX, MAIN, WINDOW, entry_bytes
from pallas_kernels.stored import NO_ENTRY, Stored

CACHE_FORMATS = ("fp4", "float")
Array = jax.Array


@chex.dataclass(frozen=True)
class GlobalKV:
    """The compressed cache of one stack of same-ratio KV sources (SPEC §4): `capacity // ratio` entries each.

    kv:   Main KV, MAIN entries    [B, G, N, ·] (G sources of the stack, N = capacity // ratio)
    ikey: Indexer K, INDEX entries [B, G, N, ·]
    """

    kv: Stored
    ikey: Stored

    def source(self, slot: Array) -> "SourceKV":
        """Source `slot` of the stack (a traced int32 is fine), as a view over the flattened buffers."""
        b, g, n = self.kv.payload.shape[:3]
        return SourceKV(kv=self.kv.reshape_rows(b, g * n), ikey=self.ikey.reshape_rows(b, g * n),
                        offset=jnp.asarray(slot, jnp.int32) * n, entries=n, sources=g)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["kv", "ikey", "offset"],
                   meta_fields=["entries", "sources"])
@dataclasses.dataclass(frozen=True)
class SourceKV:
    """One KV source's Global KV inside its stack, read and written in place (the stack is never copied).

    `kv` / `ikey` are the stack's buffers flattened to `[B, G·N, ·]` (a free reshape); the source's
    entry i is row `offset + i`. Selections (top-k, candidate pools) hold entry ids `0..N−1` (−1 =
    none); `rows` turns them into row ids of the flat buffers for the gathers.
    """

    kv: Stored
    ikey: Stored
    offset: Array  # int32 scalar: slot · N
    entries: int  # N
    sources: int  # G

    def rows(self, ids: Array) -> Array:
        """Row ids of the flat buffers for entry ids (−1 stays −1)."""
        return jnp.where(ids >= 0, ids + self.offset, NO_ENTRY)

    def ikeys(self) -> Stored:
        """This source's Indexer K `[B, N, ·]`, for the full scan that reads every entry anyway."""
        return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, self.offset, self.entries, axis=1), self.ikey)

    def write(self, entry: Array, main: Stored, ikey: Stored, valid: Array) -> "SourceKV":
        """Entries `entry [B, n]` (written where `valid [B, n]`) of this source; nothing else changes: an
        entry outside `[0, N)` is dropped, never written into a neighbouring source of the stack."""
        valid = valid & (entry >= 0) & (entry < self.entries)
        rows = entry + self.offset
        return dataclasses.replace(self, kv=self.kv.write(rows, main, valid), ikey=self.ikey.write(rows, ikey, valid))

    def stack(self) -> GlobalKV:
        """The stack's buffers back in their `[B, G, N, ·]` shape."""
        b = self.kv.payload.shape[0]
        return GlobalKV(kv=self.kv.reshape_rows(b, self.sources, self.entries),
                        ikey=self.ikey.reshape_rows(b, self.sources, self.entries))


@chex.dataclass(frozen=True)
class CompressorTail:
    """Pre-pool projections of a stack's ratio-r sources' recent tokens (SPEC §4), slot = pos % slots.

    Only the incomplete group `[r·(length // r), length)` is ever read; `ratio + max_draft`
    slots keep it intact while a verify block writes speculative positions after it.
    kv, gate: [B, G, slots, head_dim] float32 (W_ckv x and W_cg x); 0 slots for ratio-1 sources.
    """

    kv: Array
    gate: Array


@chex.dataclass(frozen=True)
class LayerKV:
    """One layer's view of the request state: what its attention reads and returns updated (`csa2.stack`
    reads it out of the `State` and writes it back, the only writer).

    ring: this layer's SWA ring, WINDOW entries [B, slots, ·]; source: its group's Global KV (None on SWA
    layers); tail: the compressor tail of that source [B, tail_slots, head_dim] (Full layers only, else None).
    """

    ring: Stored
    source: SourceKV | None = None
    tail: CompressorTail | None = None


@chex.dataclass(frozen=True)
class AcceptBuffer:
    """The speculative step's tokens (SPEC §12), per row.

    After `verify`: `tokens[:, :width]` is the verify block [R, d1 … dγ], `width` = γ + 1 rows that
    `commit` may accept, `count` = 0. After `commit(n + 1, C)`: `tokens[:, :count]` are the n + 1
    emitted tokens (d1 … dn, C), C last (the next step's R, sampled, not yet in the cache);
    `width` = 0, so nothing more can be committed until the next verify.

    tokens: [B, max_draft + 1] int32; count, width: [B] int32.
    """

    tokens: Array
    count: Array
    width: Array


@chex.dataclass(frozen=True)
class State:
    """All per-request state of the model (DESIGN §2)."""

    length: Array  # [B] int32 committed tokens per row
    floor: Array  # [B] int32 decoder SWA floor (SPEC §11): see the module docstring
    global_kv: tuple[GlobalKV, ...]  # one per stack of `layout.kv_stacks(cfg)`
    swa: Stored  # every layer's SWA ring, WINDOW entries [B, L, W + max_draft, ·], slot = pos % slots
    tails: tuple[CompressorTail, ...]  # one per stack of `layout.kv_stacks(cfg)`
    tokens: Array  # [B, history_slots] int32 Engram token history, slot = pos % history_slots
    accept: AcceptBuffer
    draft: Stored  # DSpark context windows, WINDOW entries [B, stages, W + max_draft + 1, ·], slot = pos % slots

    @property
    def batch(self) -> int:
        return self.length.shape[0]


def default_cache_format(numerics: str) -> str:
    """The cache a numerics (`csa2.quant.NUMERICS`) runs on unless told otherwise: the packed SPEC §8 formats for
    "spec", float32 for "float" (the only one it may use)."""
    return "float" if numerics == "float" else "fp4"


def cache_format(buffer: Stored) -> str:
    """The `CACHE_FORMATS` name of a state buffer's storage: "fp4" when packed, "float" otherwise."""
    return "fp4" if buffer.packed else "float"


def ring_slots(cfg: ModelConfig) -> int:
    """SWA ring size: the window plus room for a verify block's speculative writes."""
    return cfg.sliding_window + cfg.max_draft


def draft_slots(cfg: ModelConfig) -> int:
    """DSpark context ring size: the window `[L − W, L − 1]` ends one position before a backbone window, so it
    needs one slot more than `ring_slots` to stay intact while a verify block writes `L … L + max_draft`."""
    return ring_slots(cfg) + 1


def tail_slots(cfg: ModelConfig, ratio: int) -> int:
    """Tail buffer size of a ratio-`ratio` source (0 when no pooling happens)."""
    return ratio + cfg.max_draft if ratio > 1 else 0


def history_slots(cfg: ModelConfig) -> int:
    """Engram token history size: n−1 past tokens plus a verify block."""
    return (cfg.engram_max_ngram_size - 1 + cfg.max_draft + 1) if cfg.engram_layer_ids else 0


def token_granule(cfg: ModelConfig) -> int:
    """Capacity must be a multiple of every compress ratio so entry counts are exact."""
    return math.lcm(1, *(r for r in cfg.compress_ratios if r > 0))


def validate_state_args(cfg: ModelConfig, batch: int, capacity: int, cache_format: str) -> None:
    if not is_int(batch) or batch < 1:
        raise ValueError(f"init_state: batch={batch!r} must be a positive integer")
    granule = token_granule(cfg)
    if not is_int(capacity) or capacity < 1 or capacity % granule:
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
    global_kv, tails = [], []
    for sources in kv_stacks(cfg):
        ratio = cfg.compress_ratios[sources[0]]
        lead = (batch, len(sources), capacity // ratio)
        global_kv.append(GlobalKV(kv=Stored.empty(lead, cfg.head_dim, MAIN, packed),
                                  ikey=Stored.empty(lead, cfg.index_head_dim, INDEX, packed)))
        t = (batch, len(sources), tail_slots(cfg, ratio), cfg.head_dim)
        tails.append(CompressorTail(kv=jnp.zeros(t, jnp.float32), gate=jnp.zeros(t, jnp.float32)))
    return State(
        length=jnp.zeros((batch,), jnp.int32),
        floor=jnp.zeros((batch,), jnp.int32),
        global_kv=tuple(global_kv),
        swa=Stored.empty((batch, cfg.num_hidden_layers, ring_slots(cfg)), cfg.head_dim, WINDOW, packed),
        tails=tuple(tails),
        tokens=jnp.full((batch, history_slots(cfg)), cfg.engram_pad_id, jnp.int32),
        accept=AcceptBuffer(tokens=jnp.zeros((batch, cfg.max_draft + 1), jnp.int32),
                            count=jnp.zeros((batch,), jnp.int32), width=jnp.zeros((batch,), jnp.int32)),
        draft=Stored.empty((batch, cfg.num_nextn_predict_layers, draft_slots(cfg)), cfg.head_dim, WINDOW, packed),
    )


def abstract_state(cfg: ModelConfig, batch: int, capacity: int, cache_format: str = "fp4") -> State:
    """`init_state` as shapes only (`jax.eval_shape`): no memory is allocated, so 1M tokens is fine."""
    validate_state_args(cfg, batch, capacity, cache_format)
    return jax.eval_shape(lambda: init_state(cfg, batch, capacity, cache_format))


def state_bytes(state: State) -> dict[str, int]:
    """Bytes per component, from the actual arrays (or `ShapeDtypeStruct`s of `abstract_state`)."""
    parts = {
        "global_kv": tree_bytes(state.global_kv),
        "swa": tree_bytes(state.swa),
        "tails": tree_bytes(state.tails),
        "tokens": tree_bytes(state.tokens),
        "accept": tree_bytes(state.accept),
        "draft": tree_bytes(state.draft),
        "length": tree_bytes(state.length),
        "floor": tree_bytes(state.floor),
    }
    parts["total"] = sum(parts.values())
    return parts


def kv_bytes_per_token(cfg: ModelConfig, cache_format: str = "fp4") -> float:
    """Global KV bytes per token (SPEC §8): Σ over KV sources of (Main + Indexer K entry) / ratio.

    890.0 for `v41_flash` in fp4: (3 × ½ + 1) × (288 + 68).
    """
    if cache_format == "fp4":
        entry = entry_bytes(MAIN, cfg.head_dim) + entry_bytes(INDEX, cfg.index_head_dim)
    elif cache_format == "float":
        entry = 4 * (cfg.head_dim + cfg.index_head_dim)
    else:
        raise ValueError(f"kv_bytes_per_token: cache_format={cache_format!r}; use one of {CACHE_FORMATS}")
    return float(sum(entry / cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids))


def swa_bytes_per_sequence(cfg: ModelConfig, cache_format: str = "fp4") -> int:
    """SPEC §8's fixed SWA cost: every layer keeps W window entries (excluding verify slots)."""
    if cache_format == "fp4":
        entry = entry_bytes(WINDOW, cfg.head_dim)
    elif cache_format == "float":
        entry = 4 * cfg.head_dim
    else:
        raise ValueError(f"swa_bytes_per_sequence: cache_format={cache_format!r}; use one of {CACHE_FORMATS}")
    return cfg.num_hidden_layers * cfg.sliding_window * entry


def capacity(cfg: ModelConfig, state: State) -> int:
    """Tokens per row the state can hold (static: read from the Global KV shapes)."""
    if not state.global_kv:
        raise ValueError("capacity: the config has no KV source, so the state has no token capacity")
    return state.global_kv[0].kv.rows * cfg.compress_ratios[kv_stacks(cfg)[0][0]]
