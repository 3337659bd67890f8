"""Model configuration: the released field names of SPEC §1 apart from the framework's own fields.

`ModelConfig` is a frozen, hashable dataclass, so it can be a static argument of `jax.jit`.
Every constructor path (`csa2.presets.preset`, `replace`, `csa2.checkpoints.config_json.from_hf_config`,
direct construction) validates; a bad value raises `ValueError` naming the field, the value and the fix
(DESIGN §7).

Each field belongs to one group, declared once on the field itself (`fields_of`):
- `RELEASED`: a key of the released `config.json` (`csa2.checkpoints.config_json` reads exactly these);
- `VARIANT`: a framework choice that changes what the parameters compute (`mhc_single_pass`);
- `RUNTIME`: how the same model runs (compute dtype, kernel backend, verify width).
A checkpoint is compatible with a config when their RELEASED and VARIANT fields agree.
This module is the schema alone: the presets are data in `csa2.presets`, the released `config.json` is read
and written in `csa2.checkpoints.config_json`. It is the root of the model's import graph: from csa2 it
imports only the host checks (`csa2.checks`), and it reads the kernel choices from `pallas_kernels.ops`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from csa2.checks import fail, is_static_int
from pallas_kernels import ops

RELEASED, VARIANT, RUNTIME = "released", "variant", "runtime"
_DTYPES = ("float32", "bfloat16")
ENGRAM_TABLE_FORMATS = ("float", "fp8")


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN frequency interpolation of the compressed layers' RoPE (SPEC §7; released: 16, 65536, 32, 1)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float


def _released(default: Any) -> Any:
    return dataclasses.field(default=default, metadata={"group": RELEASED})


def _framework(default: Any, group: str) -> Any:
    return dataclasses.field(default=default, metadata={"group": group})


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A CSA2 / CED model. Field names follow the released `text_config` (SPEC §1)."""

    # --- attention / rope (SPEC §3, §7)
    vocab_size: int = _released(129280)
    hidden_size: int = _released(5120)
    num_hidden_layers: int = _released(40)
    num_attention_heads: int = _released(64)
    head_dim: int = _released(512)
    q_lora_rank: int = _released(1280)
    qk_rope_head_dim: int = _released(64)
    rope_theta: float = _released(10000.0)
    compress_rope_theta: float = _released(160000.0)
    rope_scaling: YarnScaling = _released(YarnScaling(factor=16.0, original_max_position_embeddings=65536,
                                                      beta_fast=32.0, beta_slow=1.0))
    max_position_embeddings: int = _released(1048576)
    # --- sliding window + CSA2 (SPEC §2, §4, §5)
    sliding_window: int = _released(128)
    compress_ratios: tuple[int, ...] = _released((0, 0) + (2,) * 18 + (1,) * 20)
    kv_source_layer_ids: tuple[int, ...] = _released((2, 8, 14, 20))
    index_source_layer_ids: tuple[int, ...] = _released((2, 8, 14, 20, 24, 28, 32, 36))
    candidate_source_layer_id: int = _released(20)  # < 0 disables the candidate pool
    candidate_topk_blocks: int = _released(2048)
    candidate_block_size: int = _released(8)
    index_n_heads: int = _released(32)
    index_head_dim: int = _released(128)
    index_topk: int = _released(512)
    # --- grouped output projection (SPEC §3)
    o_groups: int = _released(8)
    o_lora_rank: int = _released(1024)
    # --- MoE (SPEC §9)
    moe_intermediate_size: int = _released(2304)
    n_routed_experts: int = _released(384)
    n_shared_experts: int = _released(1)
    num_experts_per_tok: int = _released(6)
    scoring_func: str = _released("sqrtsoftplus")
    gate_temp: float = _released(1.0)
    routed_scaling_factor: float = _released(1.5)
    swiglu_limit: float = _released(10.0)
    # --- mHC (SPEC §10)
    hc_mult: int = _released(4)
    hc_sinkhorn_iters: int = _released(20)
    hc_eps: float = _released(1e-6)
    # --- Engram (SPEC §10b)
    engram_layer_ids: tuple[int, ...] = _released((1, 14))
    engram_vocab_size: int = _released(16_000_000)
    engram_max_ngram_size: int = _released(4)
    engram_n_heads: int = _released(8)
    engram_head_dim: int = _released(256)
    engram_pad_id: int = _released(2)
    engram_compressed_vocab_size: int = _released(99092)
    # --- DSpark (SPEC §12)
    num_nextn_predict_layers: int = _released(3)
    dspark_block_size: int = _released(5)
    dspark_noise_token_id: int = _released(128799)
    dspark_target_layer_ids: tuple[int, ...] = _released((37, 38, 39))
    dspark_markov_rank: int = _released(256)
    dspark_n_routed_experts: int = _released(128)
    dspark_num_experts_per_tok: int = _released(3)
    # --- misc released
    rms_norm_eps: float = _released(1e-20)
    initializer_range: float = _released(0.02)
    tie_word_embeddings: bool = _released(False)
    # --- framework fields
    dtype: str = _framework("bfloat16", RUNTIME)  # compute dtype; params and statistics stay float32 (DESIGN §6)
    kernel_impl: str = _framework("xla", RUNTIME)  # one of pallas_kernels.ops.CHOICES: kernels off CPU (DESIGN §4)
    # most drafts a verify block carries (γ); SWA rings hold W + max_draft slots
    max_draft: int = _framework(5, RUNTIME)
    mhc_single_pass: bool = _framework(True, VARIANT)  # SPEC §10: V4.1 collapses each site with the previous site's pre
    # "float" (trainable) | "fp8": FP8 rows as released (SPEC §10b)
    engram_table_format: str = _framework("float", VARIANT)

    def __post_init__(self) -> None:
        for name in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids",
                     "engram_layer_ids", "dspark_target_layer_ids"):
            value = getattr(self, name)
            if not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", YarnScaling(**self.rope_scaling))
        validate(self)

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with `changes` applied, validated again."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"replace: unknown field(s) {unknown}; see csa2.config.ModelConfig for the field names")
        return dataclasses.replace(self, **changes)

    # --- derived quantities used across the model
    @property
    def candidates_enabled(self) -> bool:
        return self.candidate_source_layer_id >= 0

    @property
    def candidate_pool_size(self) -> int:
        return self.candidate_topk_blocks * self.candidate_block_size

    @property
    def first_decoder_layer(self) -> int:
        """First ratio-1 layer (SPEC §2: decoder = ratio-1 region); `num_hidden_layers` if none."""
        return next((i for i, r in enumerate(self.compress_ratios) if r == 1), self.num_hidden_layers)

    @property
    def engram_ngram_sizes(self) -> tuple[int, ...]:
        return tuple(range(2, self.engram_max_ngram_size + 1))


def fields_of(*groups: str) -> tuple[str, ...]:
    """Names of the `ModelConfig` fields in `groups` (RELEASED, VARIANT, RUNTIME), in declaration order."""
    unknown = sorted(set(groups) - {RELEASED, VARIANT, RUNTIME})
    if unknown:
        raise ValueError(f"fields_of: unknown group(s) {unknown}; use {RELEASED!r}, {VARIANT!r} or {RUNTIME!r}")
    return tuple(f.name for f in dataclasses.fields(ModelConfig) if f.metadata["group"] in groups)


def model_differences(a: ModelConfig, b: ModelConfig) -> tuple[str, ...]:
    """The RELEASED and VARIANT fields where `a` and `b` differ: parameters of `a` mean something else under `b`."""
    return tuple(name for name in fields_of(RELEASED, VARIANT) if getattr(a, name) != getattr(b, name))


def _check_layer_ids(cfg: ModelConfig, field: str) -> None:
    ids = getattr(cfg, field)
    if not all(is_static_int(i) for i in ids):
        fail(f"ModelConfig.{field}", ids, "layer ids are integers")
    if list(ids) != sorted(set(ids)):
        fail(f"ModelConfig.{field}", ids, "list each layer once, in increasing order")
    for i in ids:
        if not 0 <= i < cfg.num_hidden_layers:
            fail(f"ModelConfig.{field}", ids,
                 f"layer {i} is outside the model; use ids in [0, {cfg.num_hidden_layers})")


def validate(cfg: ModelConfig) -> None:
    """Raise ValueError on the first inconsistency (DESIGN §7). One rule per block, tested one by one."""
    positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                "q_lora_rank", "sliding_window", "candidate_topk_blocks", "candidate_block_size",
                "index_n_heads", "index_head_dim", "index_topk", "o_groups", "o_lora_rank",
                "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "hc_mult",
                "hc_sinkhorn_iters", "engram_n_heads", "engram_head_dim", "engram_vocab_size",
                "engram_compressed_vocab_size", "dspark_block_size", "dspark_markov_rank",
                "dspark_n_routed_experts", "dspark_num_experts_per_tok", "max_position_embeddings")
    for name in positive:
        value = getattr(cfg, name)
        if not is_static_int(value) or value < 1:
            fail(f"ModelConfig.{name}", value, "must be a positive integer")
    for name in ("max_draft", "num_nextn_predict_layers"):
        value = getattr(cfg, name)
        if not is_static_int(value) or value < 0:
            fail(f"ModelConfig.{name}", value, "must be an integer ≥ 0")
    if cfg.dtype not in _DTYPES:
        fail("ModelConfig.dtype", cfg.dtype, f"use one of {_DTYPES}")
    if cfg.kernel_impl not in ops.CHOICES:
        fail("ModelConfig.kernel_impl", cfg.kernel_impl, f"use one of {ops.CHOICES}")
    block = cfg.candidate_block_size
    if cfg.kernel_impl in ("pallas", "auto") and block & (block - 1):
        fail("ModelConfig.candidate_block_size", block, "the Pallas block-max kernel needs a power of two; use 4, 8, … "
              "or kernel_impl='xla' or 'dense'")
    if cfg.scoring_func != "sqrtsoftplus":
        fail("ModelConfig.scoring_func", cfg.scoring_func,
              "V4.1 routes with 'sqrtsoftplus' (SPEC §9); no other router is implemented")
    for name in ("rms_norm_eps", "hc_eps", "gate_temp", "routed_scaling_factor", "swiglu_limit",
                 "rope_theta", "compress_rope_theta"):
        value = getattr(cfg, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            fail(f"ModelConfig.{name}", value, "must be a number > 0")
    y = cfg.rope_scaling
    if not (isinstance(y, YarnScaling) and y.factor >= 1 and y.original_max_position_embeddings >= 1
            and y.beta_fast > y.beta_slow > 0):
        fail("ModelConfig.rope_scaling", y,
              "YaRN needs factor ≥ 1, original_max_position_embeddings ≥ 1 and beta_fast > beta_slow > 0")
    if cfg.n_shared_experts not in (0, 1):
        fail("ModelConfig.n_shared_experts", cfg.n_shared_experts, "use 0 or 1 (V4.1 has one always-on shared expert)")

    # per-layer schedule (SPEC §2)
    n = cfg.num_hidden_layers
    ratios = cfg.compress_ratios
    if len(ratios) != n:
        fail("ModelConfig.compress_ratios", ratios,
              f"give one ratio per layer: {len(ratios)} given, num_hidden_layers={n}")
    if any(not is_static_int(r) or r < 0 for r in ratios):
        fail("ModelConfig.compress_ratios", ratios, "ratios are integers in {0, 1, 2, ...} (0 = sliding window only)")
    for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids", "dspark_target_layer_ids"):
        _check_layer_ids(cfg, name)
    kv, idx = set(cfg.kv_source_layer_ids), set(cfg.index_source_layer_ids)
    for i in sorted(kv | idx):
        if ratios[i] == 0:
            field = "kv_source_layer_ids" if i in kv else "index_source_layer_ids"
            fail(f"ModelConfig.{field}", getattr(cfg, field),
                  f"layer {i} has compress ratio 0 (sliding window only) and cannot be a source")
    for i in range(n):
        changed = ratios[i] != (ratios[i - 1] if i else 0)
        if changed and i not in kv:
            fail("ModelConfig.compress_ratios", ratios,
                  f"the ratio changes to {ratios[i]} at layer {i}, which is not a KV source; "
                  "a ratio may only change at a layer listed in kv_source_layer_ids (ratio-0 layers come first)")
    if not kv <= idx:
        fail("ModelConfig.index_source_layer_ids", cfg.index_source_layer_ids,
              f"every KV source is an index source; add {sorted(kv - idx)}")
    if cfg.candidates_enabled:
        c = cfg.candidate_source_layer_id
        if c not in idx:
            fail("ModelConfig.candidate_source_layer_id", c,
                  f"must be one of index_source_layer_ids {cfg.index_source_layer_ids}, or -1 to disable")
        if ratios[c] != 1:
            fail("ModelConfig.candidate_source_layer_id", c,
                  f"must be a ratio-1 layer (layer {c} has ratio {ratios[c]})")
        if cfg.candidate_pool_size < cfg.index_topk:
            fail("ModelConfig.candidate_topk_blocks", cfg.candidate_topk_blocks,
                  f"the pool ({cfg.candidate_topk_blocks}×{cfg.candidate_block_size}) must hold "
                  f"index_topk={cfg.index_topk} entries")

    # head geometry and quant blocks (SPEC §3, §8)
    if cfg.qk_rope_head_dim % 2 or cfg.qk_rope_head_dim < 2:
        fail("ModelConfig.qk_rope_head_dim", cfg.qk_rope_head_dim,
              "must be a positive even number (RoPE rotates pairs)")
    if cfg.head_dim % 32:
        fail("ModelConfig.head_dim", cfg.head_dim,
              "must be divisible by 32 (FP4 main blocks of 16, FP8 window blocks of 32)")
    if cfg.index_head_dim % 32:
        fail("ModelConfig.index_head_dim", cfg.index_head_dim, "must be divisible by 32 (MXFP4 blocks of 32)")
    for name in ("head_dim", "index_head_dim"):
        if getattr(cfg, name) < cfg.qk_rope_head_dim:
            fail(f"ModelConfig.{name}", getattr(cfg, name), f"must be ≥ qk_rope_head_dim={cfg.qk_rope_head_dim}")
    if cfg.num_attention_heads % cfg.o_groups:
        fail("ModelConfig.o_groups", cfg.o_groups, f"must divide num_attention_heads={cfg.num_attention_heads}")
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        fail("ModelConfig.num_experts_per_tok", cfg.num_experts_per_tok,
              f"must be ≤ n_routed_experts={cfg.n_routed_experts}")
    if cfg.dspark_num_experts_per_tok > cfg.dspark_n_routed_experts:
        fail("ModelConfig.dspark_num_experts_per_tok", cfg.dspark_num_experts_per_tok,
              f"must be ≤ dspark_n_routed_experts={cfg.dspark_n_routed_experts}")

    # Engram (SPEC §10b)
    if cfg.engram_layer_ids:
        if cfg.engram_max_ngram_size < 2:
            fail("ModelConfig.engram_max_ngram_size", cfg.engram_max_ngram_size, "must be ≥ 2 (n-grams of size 2..N)")
        if not 0 <= cfg.engram_pad_id < cfg.engram_compressed_vocab_size:
            fail("ModelConfig.engram_pad_id", cfg.engram_pad_id,
                  f"must be a token of the compressed vocabulary [0, {cfg.engram_compressed_vocab_size})")
        bound = (2**63 - 1) // cfg.engram_compressed_vocab_size // 2
        if bound < 1:
            fail("ModelConfig.engram_compressed_vocab_size", cfg.engram_compressed_vocab_size,
                  "too large for 63-bit hash multipliers")
    if cfg.engram_table_format not in ENGRAM_TABLE_FORMATS:
        fail("ModelConfig.engram_table_format", cfg.engram_table_format, f"use one of {ENGRAM_TABLE_FORMATS}")
    if cfg.engram_table_format == "fp8" and cfg.engram_head_dim % 32:
        fail("ModelConfig.engram_table_format", cfg.engram_table_format,
              f"FP8 rows carry one scale per 32 values: engram_head_dim={cfg.engram_head_dim} must be a multiple of 32 "
              "(or keep the table in 'float')")

    # DSpark / speculative verify (SPEC §12)
    if cfg.num_nextn_predict_layers and cfg.max_draft < cfg.dspark_block_size:
        fail("ModelConfig.max_draft", cfg.max_draft,
              f"must be ≥ dspark_block_size = {cfg.dspark_block_size}: γ drafts verify as a block of γ + 1 rows "
              "[R, d1 … dγ]")
    if not 0 <= cfg.dspark_noise_token_id < cfg.vocab_size:
        fail("ModelConfig.dspark_noise_token_id", cfg.dspark_noise_token_id,
              f"must be a token id in [0, {cfg.vocab_size})")
