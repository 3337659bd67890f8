"""The named configurations, as data: `preset(name)` builds one, `PRESETS` lists them.

`v41_flash` is the released model (the `ModelConfig` defaults, SPEC §1); the others are small models
for tests and demos: `tiny` (the released schedule, tiny dimensions), `mini` (8 layers with every role,
for unit tests) and `demo` (mini's schedule with a wider window and top-k, trained by `make demo`).
The tiny models read bytes (`csa2.tokenizer`): their vocabulary is defined here.
"""

from __future__ import annotations

from typing import Any

from csa2.config import ModelConfig

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

# Each preset: the fields it sets on top of the `ModelConfig` defaults (the released model).
_FIELDS: dict[str, dict[str, Any]] = {
    "v41_flash": {},
    "tiny": _TINY_DIMS,
    "mini": {**_TINY_DIMS, **_MINI_SCHEDULE},
    "demo": {**_TINY_DIMS, **_MINI_SCHEDULE, "sliding_window": 32, "index_topk": 32,
             "candidate_topk_blocks": 8, "candidate_block_size": 8},
}

PRESETS = tuple(_FIELDS)


def preset(name: str) -> ModelConfig:
    """A new, validated `ModelConfig` for preset `name` (one of `PRESETS`)."""
    if name not in PRESETS:
        raise ValueError(f"preset: unknown name {name!r}; use one of {PRESETS}")
    return ModelConfig(**_FIELDS[name])
