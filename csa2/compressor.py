"""Compressor of a Full layer (SPEC §4): pools groups of `ratio` tokens into Global KV entries.

Entry `i` of a ratio-r source pools positions `r·i … r·i+r−1`:
- r > 1: `latent_i = RMSNorm(Σ_j softmax_j(z)[ch] · kv_j[ch])`, `kv_j = W_ckv x_j`, `z_j = W_cg x_j`,
  a per-channel softmax over the r group members;
- r = 1: `latent_i = RMSNorm(W_ckv x_i)`, no gate and no tail.
Then `main_i = RoPE(latent_i, r·i)` and `ikey_i = RoPE(RMSNorm_k(W_ik latent_i), r·i)` (SPEC §7
YaRN frequencies of ratio≠0 layers), stored in the MAIN / INDEX formats of SPEC §8.

Streaming (DESIGN §2): a chunk at positions `start + j` completes the entries
`[start // r, (start + n_valid) // r)`. Members before `start` are read from the tail ring
(slot `pos % slots`), so every chunking — prefill, decode, verify — writes the same entries, and
commit after verify is "set length". An incomplete group is never written to Global KV.

Encoder replay (SPEC §11) re-runs the last tokens of a cached prefix with `written_from` = the hit:
the entries completed before it are the cache's and are not rewritten; the tail ring is rebuilt, so
an entry straddling the hit pools the replayed member with the new one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from csa2 import cache
from csa2.checks import is_static_int
from csa2.config import ModelConfig
from csa2.norm import rms_norm
from csa2.params import normal, ones
from csa2.rope import apply_rope, rope_frequencies
from csa2.state import CompressorTail, SourceKV, tail_slots

Array = jax.Array


class Compressor(nnx.Module):
    """Weights of a ratio-`ratio` compressor; `wgate` exists only when tokens are pooled (ratio > 1)."""

    def __init__(self, cfg: ModelConfig, ratio: int, rngs: nnx.Rngs):
        _check_ratio(ratio)
        d, D, Di, std = cfg.hidden_size, cfg.head_dim, cfg.index_head_dim, cfg.initializer_range
        self.wkv = normal(rngs, (d, D), std, ("embed", "latent"))
        self.norm = ones((D,), ("latent",))
        self.wik = normal(rngs, (D, Di), std, ("latent", "index_dim"))
        self.ik_norm = ones((Di,), ("index_dim",))
        if ratio > 1:
            self.wgate = normal(rngs, (d, D), std, ("embed", "latent"))


def compress(cfg: ModelConfig, params: dict, ratio: int, source: SourceKV, tail: CompressorTail,
             x: Array, start: Array, n_valid: Array, *, quantize: bool,
             written_from: Array | None = None) -> tuple[SourceKV, CompressorTail]:
    """Write the entries completed by a chunk into `source` and its pre-pool projections into `tail`.

    x [B, S, hidden_size]: the Full layer's attention input at positions `start[b] + j`;
    start [B] int32: committed length before the chunk; n_valid [B] int32 (≤ S): valid tokens per
    row, the rest is padding and changes nothing. `tail` is this source's tail ring, kv and gate
    `[B, slots, D]` (0 slots at ratio 1). Entries are stored in `source`'s storage (packed, or
    float32 fake-quantized if `quantize`). `written_from [B]` (None: 0): only the entries whose last
    member lies at or after it are written.
    """
    x, start, n_valid = jnp.asarray(x), jnp.asarray(start), jnp.asarray(n_valid)
    _check_inputs(cfg, ratio, source, tail, x, start, n_valid)
    S = x.shape[1]
    start, n_valid = start.astype(jnp.int32), n_valid.astype(jnp.int32)
    positions = start[:, None] + jnp.arange(S, dtype=jnp.int32)  # [B, S]
    valid = jnp.arange(S)[None, :] < n_valid[:, None]  # [B, S]
    x = jnp.where(valid[..., None], x.astype(jnp.float32), 0.0)  # padding reaches no value
    kv = _project(x, params["wkv"])  # [B, S, D]
    if ratio == 1:
        entry, complete, latent = positions, valid, kv  # [B, S], [B, S], [B, S, D]
    else:
        gate = _project(x, params["wgate"])  # [B, S, D]
        entry, complete, latent = _pool(tail, kv, gate, start, n_valid, ratio)
        end = start + n_valid
        tail = CompressorTail(kv=cache.ring_scatter(tail.kv, positions, kv, valid, end),
                              gate=cache.ring_scatter(tail.gate, positions, gate, valid, end))
    if written_from is not None:
        complete = complete & (entry * ratio + ratio - 1 >= written_from[:, None])
    latent = rms_norm(latent, params["norm"], cfg.rms_norm_eps)
    return _write_entries(cfg, params, ratio, source, latent, entry, complete, quantize), tail


def _project(x: Array, w: Array) -> Array:
    """`x @ w` in float32 at full precision (SPEC §4: kv_j and z_j are fp32): default-precision float32
    matmuls are bfloat16 passes on TPU and TF32 on some GPUs."""
    with jax.named_scope("fp32_compressor"):
        return jnp.matmul(x, w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32)


def _pool(tail: CompressorTail, kv: Array, gate: Array, start: Array, n_valid: Array,
          ratio: int) -> tuple[Array, Array, Array]:
    """Candidate entries of the chunk, which of them it completes, and their gated member sums."""
    B, S, D = kv.shape
    n = S // ratio + 1  # most entries a chunk of S tokens can complete
    entry = start[:, None] // ratio + jnp.arange(n, dtype=jnp.int32)  # [B, n]
    members = entry[..., None] * ratio + jnp.arange(ratio, dtype=jnp.int32)  # [B, n, r]
    in_tail = (members < start[:, None, None])[..., None]  # [B, n, r, 1]
    chunk_idx = jnp.clip(members - start[:, None, None], 0, S - 1)  # [B, n, r]
    slot = members % tail.kv.shape[1]  # [B, n, r]

    def take(values: Array, idx: Array) -> Array:
        """values [B, N, D] at idx [B, n, r] → [B, n, r, D]."""
        return jnp.take_along_axis(values, idx.reshape(B, -1, 1), axis=1).reshape(B, n, ratio, D)

    kv_m = jnp.where(in_tail, take(tail.kv, slot), take(kv, chunk_idx))  # [B, n, r, D]
    z_m = jnp.where(in_tail, take(tail.gate, slot), take(gate, chunk_idx))  # [B, n, r, D]
    pooled = jnp.sum(jax.nn.softmax(z_m, axis=2) * kv_m, axis=2)  # [B, n, D]
    complete = entry < ((start + n_valid) // ratio)[:, None]  # [B, n]
    return entry, complete, pooled


def _write_entries(cfg: ModelConfig, params: dict, ratio: int, source: SourceKV, latent: Array,
                   entry: Array, complete: Array, quantize: bool) -> SourceKV:
    """RoPE at each group's first position, encode (SPEC §8) and write the complete entries."""
    freqs = rope_frequencies(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling)
    pos = entry * ratio  # [B, n]
    main = apply_rope(latent, pos, freqs)  # [B, n, D]
    # Indexer K feeds only top-k and the indexer loss: detach the latent (SPEC §13).
    ikey = rms_norm(jax.lax.stop_gradient(latent) @ params["wik"], params["ik_norm"], cfg.rms_norm_eps)  # [B, n, Di]
    ikey = apply_rope(ikey, pos, freqs)
    return source.write(entry, cache.encode(main, source.kv, quantize), cache.encode(ikey, source.ikey, quantize),
                        complete)


def _check_ratio(ratio: int) -> None:
    """A compressor pools ratio ≥ 1 tokens per entry (ratio-0 layers have none)."""
    if not is_static_int(ratio) or ratio < 1:
        raise ValueError(f"ratio={ratio!r}: a compressor needs an integer ratio ≥ 1 (ratio-0 layers have none)")


def _check_inputs(cfg: ModelConfig, ratio: int, source: SourceKV, tail: CompressorTail, x: Array, start: Array,
                  n_valid: Array) -> None:
    """Raise ValueError on inconsistent shapes at the public boundary (DESIGN §7)."""
    _check_ratio(ratio)
    if x.ndim != 3 or x.shape[-1] != cfg.hidden_size:
        raise ValueError(f"x.shape={x.shape}: expected [B, S, {cfg.hidden_size}] (batch, chunk, hidden_size)")
    B = x.shape[0]
    for name, value in (("start", start), ("n_valid", n_valid)):
        if value.shape != (B,):
            raise ValueError(f"{name}.shape={value.shape}: expected ({B},), one value per row of x")
        if not jnp.issubdtype(value.dtype, jnp.integer):
            raise ValueError(f"{name}.dtype={value.dtype}: pass integer (int32) positions")
    for name, store, dim in (("source.kv", source.kv, cfg.head_dim), ("source.ikey", source.ikey, cfg.index_head_dim)):
        if store.payload.shape[0] != B or store.dim != dim:
            raise ValueError(f"{name}.payload.shape={store.payload.shape}: expected batch {B} (x.shape={x.shape}) "
                             f"and {dim} features per entry")
    expected_tail = (B, tail_slots(cfg, ratio), cfg.head_dim)
    if tail.kv.shape != expected_tail or tail.gate.shape != expected_tail:
        raise ValueError(f"tail.kv.shape={tail.kv.shape}, tail.gate.shape={tail.gate.shape}: expected {expected_tail} "
                         f"(batch, tail_slots(cfg, {ratio}), head_dim)")
