"""Model configuration: the released field names of SPEC §1 apart from the framework's own fields.

`ModelConfig` is a frozen, hashable dataclass, so it can be a static argument of `jax.jit`.
Every constructor path (`preset`, `replace`, `from_hf_config`, direct construction) validates;
a bad value raises `ValueError` naming the field, the value and the fix (DESIGN §7).

Each field belongs to one group, declared once on the field itself (`fields_of`):
- `RELEASED`: a key of the released `config.json` (`from_hf_config` reads exactly these);
- `VARIANT`: a framework choice that changes what the parameters compute (`mhc_single_pass`);
- `RUNTIME`: how the same model runs (compute dtype, kernel backend, verify width).
A checkpoint is compatible with a config when their RELEASED and VARIANT fields agree.
This module is the root of the import graph: it imports nothing from csa2.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

RELEASED, VARIANT, RUNTIME = "released", "variant", "runtime"
_DTYPES = ("float32", "bfloat16")
_KERNEL_IMPLS = ("xla", "pallas", "auto")  # pallas_kernels.ops.CHOICES
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
    rope_scaling: YarnScaling = _released(YarnScaling(factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0, beta_slow=1.0))
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
    kernel_impl: str = _framework("xla", RUNTIME)  # "xla" | "pallas" | "auto": kernels off CPU (DESIGN §4)
    max_draft: int = _framework(5, RUNTIME)  # most drafts a verify block carries (γ); SWA rings hold W + max_draft slots
    mhc_single_pass: bool = _framework(True, VARIANT)  # SPEC §10: V4.1 collapses each site with the previous site's pre
    engram_table_format: str = _framework("float", VARIANT)  # "float" (trainable) | "fp8": FP8 rows as released (SPEC §10b)

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


def _fail(field: str, value: Any, fix: str) -> None:
    raise ValueError(f"ModelConfig.{field}={value!r}: {fix}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_layer_ids(cfg: ModelConfig, field: str) -> None:
    ids = getattr(cfg, field)
    if not all(_is_int(i) for i in ids):
        _fail(field, ids, "layer ids are integers")
    if list(ids) != sorted(set(ids)):
        _fail(field, ids, "list each layer once, in increasing order")
    for i in ids:
        if not 0 <= i < cfg.num_hidden_layers:
            _fail(field, ids, f"layer {i} is outside the model; use ids in [0, {cfg.num_hidden_layers})")


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
        if not _is_int(value) or value < 1:
            _fail(name, value, "must be a positive integer")
    for name in ("max_draft", "num_nextn_predict_layers"):
        value = getattr(cfg, name)
        if not _is_int(value) or value < 0:
            _fail(name, value, "must be an integer ≥ 0")
    if cfg.dtype not in _DTYPES:
        _fail("dtype", cfg.dtype, f"use one of {_DTYPES}")
    if cfg.kernel_impl not in _KERNEL_IMPLS:
        _fail("kernel_impl", cfg.kernel_impl, f"use one of {_KERNEL_IMPLS}")
    block = cfg.candidate_block_size
    if cfg.kernel_impl != "xla" and block & (block - 1):
        _fail("candidate_block_size", block, "the Pallas block-max kernel needs a power of two; use 4, 8, … "
              "or kernel_impl='xla'")
    if cfg.scoring_func != "sqrtsoftplus":
        _fail("scoring_func", cfg.scoring_func, "V4.1 routes with 'sqrtsoftplus' (SPEC §9); no other router is implemented")
    for name in ("rms_norm_eps", "hc_eps", "gate_temp", "routed_scaling_factor", "swiglu_limit",
                 "rope_theta", "compress_rope_theta"):
        value = getattr(cfg, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            _fail(name, value, "must be a number > 0")
    y = cfg.rope_scaling
    if not (isinstance(y, YarnScaling) and y.factor >= 1 and y.original_max_position_embeddings >= 1
            and y.beta_fast > y.beta_slow > 0):
        _fail("rope_scaling", y, "YaRN needs factor ≥ 1, original_max_position_embeddings ≥ 1 and beta_fast > beta_slow > 0")
    if cfg.n_shared_experts not in (0, 1):
        _fail("n_shared_experts", cfg.n_shared_experts, "use 0 or 1 (V4.1 has one always-on shared expert)")

    # per-layer schedule (SPEC §2)
    n = cfg.num_hidden_layers
    ratios = cfg.compress_ratios
    if len(ratios) != n:
        _fail("compress_ratios", ratios, f"give one ratio per layer: {len(ratios)} given, num_hidden_layers={n}")
    if any(not _is_int(r) or r < 0 for r in ratios):
        _fail("compress_ratios", ratios, "ratios are integers in {0, 1, 2, ...} (0 = sliding window only)")
    for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids", "dspark_target_layer_ids"):
        _check_layer_ids(cfg, name)
    kv, idx = set(cfg.kv_source_layer_ids), set(cfg.index_source_layer_ids)
    for i in sorted(kv | idx):
        if ratios[i] == 0:
            field = "kv_source_layer_ids" if i in kv else "index_source_layer_ids"
            _fail(field, getattr(cfg, field), f"layer {i} has compress ratio 0 (sliding window only) and cannot be a source")
    for i in range(n):
        changed = ratios[i] != (ratios[i - 1] if i else 0)
        if changed and i not in kv:
            _fail("compress_ratios", ratios,
                  f"the ratio changes to {ratios[i]} at layer {i}, which is not a KV source; "
                  "a ratio may only change at a layer listed in kv_source_layer_ids (ratio-0 layers come first)")
    if not kv <= idx:
        _fail("index_source_layer_ids", cfg.index_source_layer_ids,
              f"every KV source is an index source; add {sorted(kv - idx)}")
    if cfg.candidates_enabled:
        c = cfg.candidate_source_layer_id
        if c not in idx:
            _fail("candidate_source_layer_id", c, f"must be one of index_source_layer_ids {cfg.index_source_layer_ids}, or -1 to disable")
        if ratios[c] != 1:
            _fail("candidate_source_layer_id", c, f"must be a ratio-1 layer (layer {c} has ratio {ratios[c]})")
        if cfg.candidate_pool_size < cfg.index_topk:
            _fail("candidate_topk_blocks", cfg.candidate_topk_blocks,
                  f"the pool ({cfg.candidate_topk_blocks}×{cfg.candidate_block_size}) must hold index_topk={cfg.index_topk} entries")

    # head geometry and quant blocks (SPEC §3, §8)
    if cfg.qk_rope_head_dim % 2 or cfg.qk_rope_head_dim < 2:
        _fail("qk_rope_head_dim", cfg.qk_rope_head_dim, "must be a positive even number (RoPE rotates pairs)")
    if cfg.head_dim % 32:
        _fail("head_dim", cfg.head_dim, "must be divisible by 32 (FP4 main blocks of 16, FP8 window blocks of 32)")
    if cfg.index_head_dim % 32:
        _fail("index_head_dim", cfg.index_head_dim, "must be divisible by 32 (MXFP4 blocks of 32)")
    for name in ("head_dim", "index_head_dim"):
        if getattr(cfg, name) < cfg.qk_rope_head_dim:
            _fail(name, getattr(cfg, name), f"must be ≥ qk_rope_head_dim={cfg.qk_rope_head_dim}")
    if cfg.num_attention_heads % cfg.o_groups:
        _fail("o_groups", cfg.o_groups, f"must divide num_attention_heads={cfg.num_attention_heads}")
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        _fail("num_experts_per_tok", cfg.num_experts_per_tok, f"must be ≤ n_routed_experts={cfg.n_routed_experts}")
    if cfg.dspark_num_experts_per_tok > cfg.dspark_n_routed_experts:
        _fail("dspark_num_experts_per_tok", cfg.dspark_num_experts_per_tok,
              f"must be ≤ dspark_n_routed_experts={cfg.dspark_n_routed_experts}")

    # Engram (SPEC §10b)
    if cfg.engram_layer_ids:
        if cfg.engram_max_ngram_size < 2:
            _fail("engram_max_ngram_size", cfg.engram_max_ngram_size, "must be ≥ 2 (n-grams of size 2..N)")
        if not 0 <= cfg.engram_pad_id < cfg.engram_compressed_vocab_size:
            _fail("engram_pad_id", cfg.engram_pad_id, f"must be a token of the compressed vocabulary [0, {cfg.engram_compressed_vocab_size})")
        bound = (2**63 - 1) // cfg.engram_compressed_vocab_size // 2
        if bound < 1:
            _fail("engram_compressed_vocab_size", cfg.engram_compressed_vocab_size, "too large for 63-bit hash multipliers")
    if cfg.engram_table_format not in ENGRAM_TABLE_FORMATS:
        _fail("engram_table_format", cfg.engram_table_format, f"use one of {ENGRAM_TABLE_FORMATS}")
    if cfg.engram_table_format == "fp8" and cfg.engram_head_dim % 32:
        _fail("engram_table_format", cfg.engram_table_format, f"FP8 rows carry one scale per 32 values: engram_head_dim="
              f"{cfg.engram_head_dim} must be a multiple of 32 (or keep the table in 'float')")

    # DSpark / speculative verify (SPEC §12)
    if cfg.num_nextn_predict_layers and cfg.max_draft < cfg.dspark_block_size:
        _fail("max_draft", cfg.max_draft, f"must be ≥ dspark_block_size = {cfg.dspark_block_size}: γ drafts verify "
              "as a block of γ + 1 rows [R, d1 … dγ]")
    if not 0 <= cfg.dspark_noise_token_id < cfg.vocab_size:
        _fail("dspark_noise_token_id", cfg.dspark_noise_token_id, f"must be a token id in [0, {cfg.vocab_size})")


# ---------------------------------------------------------------------------------------------
# Presets

# Byte-level vocabulary of the tiny presets: ids 0..255 are bytes, then the specials.
BYTE_VOCAB_SIZE = 259
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258

_TINY_DIMS = dict(
    vocab_size=BYTE_VOCAB_SIZE, hidden_size=64, num_attention_heads=4, head_dim=32, q_lora_rank=32,
    qk_rope_head_dim=16, sliding_window=16, max_position_embeddings=65536,
    candidate_topk_blocks=8, candidate_block_size=4,
    # index_head_dim 32 (not 16): MXFP4 scales cover blocks of 32 (SPEC §8).
    index_n_heads=4, index_head_dim=32, index_topk=16, o_groups=2, o_lora_rank=32,
    moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2,
    engram_vocab_size=1000, engram_max_ngram_size=3, engram_n_heads=2, engram_head_dim=16,
    engram_pad_id=PAD_ID, engram_compressed_vocab_size=BYTE_VOCAB_SIZE,
    num_nextn_predict_layers=1, dspark_block_size=5, dspark_noise_token_id=PAD_ID,
    dspark_markov_rank=16, dspark_n_routed_experts=4, dspark_num_experts_per_tok=2,
    rms_norm_eps=1e-6, dtype="float32", max_draft=5,
)


_MINI_SCHEDULE = dict(
    num_hidden_layers=8,
    compress_ratios=(0, 2, 2, 2, 1, 1, 1, 1),
    kv_source_layer_ids=(1, 4),
    index_source_layer_ids=(1, 4, 6),
    candidate_source_layer_id=4,
    engram_layer_ids=(1,),
    dspark_target_layer_ids=(5, 6, 7),
)


def preset(name: str) -> ModelConfig:
    """A validated preset: `v41_flash` (released numbers), `tiny` (released schedule, tiny dims),
    `mini` (8 layers with every role, for unit tests), `demo` (mini's schedule with a wider window
    and top-k, trained by `make demo`)."""
    if name == "v41_flash":
        return ModelConfig()
    if name == "tiny":
        return ModelConfig(**_TINY_DIMS)
    if name == "mini":
        return ModelConfig(**_TINY_DIMS, **_MINI_SCHEDULE)
    if name == "demo":
        return ModelConfig(**{**_TINY_DIMS, **_MINI_SCHEDULE, "sliding_window": 32, "index_topk": 32,
                              "candidate_topk_blocks": 8, "candidate_block_size": 8})
    raise ValueError(f"preset: unknown name {name!r}; use one of {PRESETS}")


PRESETS = ("v41_flash", "tiny", "mini", "demo")


# ---------------------------------------------------------------------------------------------
# Released config.json

# Released keys this framework reads but does not store, with the only value it supports
# (None = any value is accepted because it is derived or irrelevant to the math).
_HF_FIXED: dict[str, Any] = {
    "num_key_value_heads": 1, "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
    "norm_topk_prob": True, "topk_method": "noaux_tc",
}
# ("dtype"/"torch_dtype" there is the stored weights' torch dtype, not this framework's compute dtype.)
_HF_IGNORED = {
    "model_type", "architectures", "torch_dtype", "dtype", "transformers_version", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "output_router_logits", "router_aux_loss_coef",
    "router_jitter_noise", "engram_num_embeddings", "rope_parameters", "layer_types",
    "quantization_config", "auto_map", "base_config_key",
}


# Released keys spelled differently from the field they set.
_HF_RENAMED = {"engram_pad_token_id": "engram_pad_id"}


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The released `text_config` of `cfg` (what `from_hf_config` reads back to an equal config, up to
    the framework fields): released key names, `rope_scaling` as a YaRN dict, one trailing 0 in
    `compress_ratios` per draft layer."""
    out: dict[str, Any] = {"model_type": "deepseek_v41_text", **_HF_FIXED}
    spelled = {field: key for key, field in _HF_RENAMED.items()}
    for name in fields_of(RELEASED):
        value = getattr(cfg, name)
        if name == "rope_scaling":
            value = {"rope_type": "yarn", **dataclasses.asdict(value)}
        elif name == "compress_ratios":
            value = list(value) + [0] * cfg.num_nextn_predict_layers
        elif isinstance(value, tuple):
            value = list(value)
        out[spelled.get(name, name)] = value
    return out


def from_hf_config(d: Mapping[str, Any], **framework: Any) -> ModelConfig:
    """Build a config from a released `config.json` dict (`text_config` or flat).

    Unknown keys and values this framework cannot reproduce raise ValueError. `framework`
    sets the VARIANT and RUNTIME fields (dtype, kernel_impl, max_draft, mhc_single_pass).
    """
    if "text_config" in d:
        d = d["text_config"]
    released = set(fields_of(RELEASED))
    framework_fields = set(fields_of(VARIANT, RUNTIME))
    kwargs: dict[str, Any] = {}
    for key, value in d.items():
        key = _HF_RENAMED.get(key, key)
        if key in kwargs:
            raise ValueError(f"config.json sets {key!r} twice (as {key!r} and as its released spelling); keep one")
        if key in _HF_FIXED:
            if value != _HF_FIXED[key]:
                raise ValueError(f"config.json {key}={value!r}: csa2 implements only {key}={_HF_FIXED[key]!r} (V4.1)")
        elif key in _HF_IGNORED:
            continue
        elif key == "rope_scaling":
            if value is not None and not isinstance(value, Mapping):
                raise ValueError(f"config.json rope_scaling={value!r}: expected a dict like "
                                 "{'rope_type': 'yarn', 'factor': 16, ...} or null")
            if value is not None:
                kind = value.get("rope_type", value.get("type", "yarn"))
                if kind != "yarn":
                    raise ValueError(f"config.json rope_scaling.rope_type={kind!r}: only 'yarn' is implemented (SPEC §7)")
                known = {f.name for f in dataclasses.fields(YarnScaling)}
                extra = sorted(set(value) - known - {"rope_type", "type"})
                if extra:
                    raise ValueError(f"config.json rope_scaling has unknown keys {extra}; known: {sorted(known)}")
                missing = sorted(known - set(value))
                if missing:
                    raise ValueError(f"config.json rope_scaling lacks {missing}; the YaRN of SPEC §7 needs all of {sorted(known)}")
                kwargs["rope_scaling"] = YarnScaling(**{k: v for k, v in value.items() if k in known})
        elif key in released:
            kwargs[key] = value
        else:
            if key in framework_fields:
                raise ValueError(f"config.json has key {key!r}, a framework field of csa2 (not a released one); "
                                 f"pass it as from_hf_config(d, {key}=...)")
            raise ValueError(f"config.json has unknown key {key!r}; csa2 does not know how to honour it")
    n = kwargs.get("num_hidden_layers", ModelConfig.num_hidden_layers)
    ratios = kwargs.get("compress_ratios")
    if ratios is not None and len(ratios) > n:
        # Released ratios carry one trailing 0 per DSpark draft layer.
        drafts = kwargs.get("num_nextn_predict_layers", ModelConfig.num_nextn_predict_layers)
        if len(ratios) != n + drafts or any(ratios[n:]):
            raise ValueError(f"config.json compress_ratios has {len(ratios)} entries: give {n} (one per layer), "
                             f"optionally followed by {drafts} zeros for the draft layers")
        kwargs["compress_ratios"] = tuple(ratios[:n])
    if kwargs.get("candidate_source_layer_id", -1) is None:
        # The released config class defaults the candidate source to the last KV source.
        kwargs["candidate_source_layer_id"] = max(kwargs.get("kv_source_layer_ids", ModelConfig.kv_source_layer_ids))
    unknown = sorted(set(framework) - framework_fields)
    if unknown:
        raise ValueError(f"from_hf_config: {unknown} are not framework fields; use {sorted(framework_fields)}")
    return ModelConfig(**kwargs, **framework)

