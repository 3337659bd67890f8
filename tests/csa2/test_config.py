"""Tests for csa2.config, csa2.presets and the released config.json (csa2.checkpoints.config_json): presets, hashing,
validation rule by rule, config.json read and written (SPEC §1, DESIGN §7)."""

import ast
import copy
import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import pytest

import csa2.checks
import csa2.config
from csa2.checkpoints.config_json import from_hf_config, to_hf_config
from csa2.config import RELEASED, RUNTIME, VARIANT, ModelConfig, fields_of, model_differences, validate
from csa2.presets import PRESETS, preset
from pallas_kernels import ops

V41_RATIOS = (0, 0) + (2,) * 18 + (1,) * 20
YARN = dict(factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0, beta_slow=1.0)


def yarn(**kw):
    """The config's YaRN parameter object (SPEC §7), built by keyword so its class name does not matter."""
    return type(ModelConfig().rope_scaling)(**kw)


def _with(seq, i, value):
    seq = list(seq)
    seq[i] = value
    return tuple(seq)


# --------------------------------------------------------------------------------------------
# Presets


def test_v41_flash_is_the_released_config():
    """Spot-check the SPEC §1 table against the preset (the full table is pinned by from_hf_config)."""
    cfg = preset("v41_flash")
    assert cfg.vocab_size == 129280 and cfg.hidden_size == 5120 and cfg.num_hidden_layers == 40
    assert cfg.compress_ratios == V41_RATIOS
    assert cfg.kv_source_layer_ids == (2, 8, 14, 20)
    assert cfg.index_source_layer_ids == (2, 8, 14, 20, 24, 28, 32, 36)
    assert cfg.candidate_source_layer_id == 20 and cfg.candidate_pool_size == 16384
    assert cfg.engram_layer_ids == (1, 14) and cfg.engram_ngram_sizes == (2, 3, 4)
    assert cfg.dspark_target_layer_ids == (37, 38, 39)
    assert cfg.rope_scaling == yarn(**YARN)
    hash(cfg.rope_scaling)
    assert cfg.first_decoder_layer == 20


@pytest.mark.parametrize("name", PRESETS)
def test_preset_constructs_and_is_hashable(name):
    cfg = preset(name)
    validate(cfg)
    again = preset(name)
    assert cfg is not again
    assert cfg == again and hash(cfg) == hash(again)
    assert {cfg: 1}[again] == 1
    for other in PRESETS:
        if other != name:
            assert cfg != preset(other)


def test_presets_set_is_complete():
    assert set(PRESETS) == {"v41_flash", "tiny", "mini", "demo"}


def test_list_fields_become_tuples_so_config_stays_hashable():
    cfg = ModelConfig(compress_ratios=list(V41_RATIOS), kv_source_layer_ids=[2, 8, 14, 20],
                      engram_layer_ids=[1, 14], rope_scaling=dict(YARN))
    assert isinstance(cfg.compress_ratios, tuple) and isinstance(cfg.kv_source_layer_ids, tuple)
    assert cfg.rope_scaling == yarn(**YARN)
    assert cfg == preset("v41_flash")
    hash(cfg)


@pytest.mark.parametrize("name", PRESETS)
def test_config_is_a_jit_static_argument(name):
    traces = []

    @functools.partial(jax.jit, static_argnums=0)
    def f(cfg, x):
        traces.append(cfg)
        return x * cfg.hidden_size + cfg.num_hidden_layers

    cfg = preset(name)
    assert float(f(cfg, jnp.float32(1.0))) == cfg.hidden_size + cfg.num_hidden_layers
    # An equal but distinct config object hits the compilation cache: no retrace.
    assert float(f(preset(name), jnp.float32(2.0))) == 2 * cfg.hidden_size + cfg.num_hidden_layers
    assert len(traces) == 1
    # A different config is a different static argument.
    f(cfg.replace(hidden_size=cfg.hidden_size * 2), jnp.float32(1.0))
    assert len(traces) == 2


def test_unknown_preset_raises():
    with pytest.raises(ValueError, match="'nope'") as e:
        preset("nope")
    assert "v41_flash" in str(e.value)


def test_replace_applies_and_keeps_original():
    cfg = preset("tiny")
    new = cfg.replace(dtype="bfloat16", sliding_window=32)
    assert new.dtype == "bfloat16" and new.sliding_window == 32
    assert cfg.dtype == "float32" and cfg.sliding_window == 16


def test_replace_revalidates():
    with pytest.raises(ValueError, match=r"head_dim=48"):
        preset("tiny").replace(head_dim=48)


def test_replace_rejects_unknown_fields():
    with pytest.raises(ValueError, match="head_dims"):
        preset("tiny").replace(head_dims=64)


def test_direct_construction_validates():
    with pytest.raises(ValueError, match=r"o_groups=7"):
        ModelConfig(o_groups=7)


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        preset("tiny").head_dim = 64


# --------------------------------------------------------------------------------------------
# validate(): one case per rule. Each case starts from a valid preset and breaks exactly one rule;
# the message must name the field and the offending value (DESIGN §7).

POSITIVE_INT_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
    "sliding_window", "candidate_topk_blocks", "candidate_block_size", "index_n_heads", "index_head_dim",
    "index_topk", "o_groups", "o_lora_rank", "moe_intermediate_size", "n_routed_experts",
    "num_experts_per_tok", "hc_mult", "hc_sinkhorn_iters", "engram_n_heads", "engram_head_dim",
    "engram_vocab_size", "engram_compressed_vocab_size", "dspark_block_size", "dspark_markov_rank",
    "max_position_embeddings",
)
POSITIVE_FLOAT_FIELDS = ("rms_norm_eps", "hc_eps", "gate_temp", "routed_scaling_factor", "swiglu_limit",
                         "rope_theta", "compress_rope_theta")

# (id, preset, changes, field named in the message, offending value named in the message, extra substring)
RULES = [
    # framework enums
    ("dtype", "v41_flash", dict(dtype="float16"), "dtype", "float16", None),
    ("kernel_impl", "tiny", dict(kernel_impl="triton"), "kernel_impl", "triton", None),
    ("scoring_func", "v41_flash", dict(scoring_func="softmax"), "scoring_func", "softmax", None),
    # misc scalars
    ("max_draft_negative", "v41_flash", dict(max_draft=-1), "max_draft", -1, None),
    ("n_shared_experts_2", "v41_flash", dict(n_shared_experts=2), "n_shared_experts", 2, None),
    ("n_shared_experts_neg", "tiny", dict(n_shared_experts=-1), "n_shared_experts", -1, None),
    # compress_ratios
    ("ratios_too_short", "v41_flash", dict(compress_ratios=V41_RATIOS[:-1]), "compress_ratios", V41_RATIOS[:-1],
     "39 given"),
    ("ratios_too_long", "v41_flash", dict(compress_ratios=V41_RATIOS + (1,)), "compress_ratios", V41_RATIOS + (1,),
     "41 given"),
    ("ratio_negative", "v41_flash", dict(compress_ratios=_with(V41_RATIOS, 5, -1)), "compress_ratios",
     _with(V41_RATIOS, 5, -1), None),
    ("ratio_not_int", "tiny", dict(compress_ratios=_with(V41_RATIOS, 5, 2.0)), "compress_ratios",
     _with(V41_RATIOS, 5, 2.0), None),
    ("ratio_change_at_non_source", "v41_flash", dict(compress_ratios=(0, 0) + (2,) * 9 + (1,) * 29),
     "compress_ratios", (0, 0) + (2,) * 9 + (1,) * 29, "at layer 11"),
    ("ratio_starts_before_first_source", "v41_flash", dict(compress_ratios=(0,) + (2,) * 19 + (1,) * 20),
     "compress_ratios", (0,) + (2,) * 19 + (1,) * 20, "at layer 1"),
    ("ratio_0_after_ratio_2", "v41_flash", dict(compress_ratios=(0, 0) + (2,) * 17 + (0,) + (1,) * 20),
     "compress_ratios", (0, 0) + (2,) * 17 + (0,) + (1,) * 20, "changes to 0 at layer 19"),
    ("ratio_0_after_ratio_1_mini", "mini", dict(compress_ratios=(0, 2, 2, 2, 1, 1, 1, 0)),
     "compress_ratios", (0, 2, 2, 2, 1, 1, 1, 0), "at layer 7"),
    # layer-id lists: unsorted, duplicate, out of range (high and negative)
    ("kv_unsorted", "v41_flash", dict(kv_source_layer_ids=(2, 14, 8, 20)), "kv_source_layer_ids", (2, 14, 8, 20),
     "increasing order"),
    ("kv_duplicate", "v41_flash", dict(kv_source_layer_ids=(2, 8, 8, 14, 20)), "kv_source_layer_ids",
     (2, 8, 8, 14, 20), "once"),
    ("kv_out_of_range", "v41_flash", dict(kv_source_layer_ids=(2, 8, 14, 20, 40)), "kv_source_layer_ids",
     (2, 8, 14, 20, 40), "layer 40"),
    ("kv_negative", "v41_flash", dict(kv_source_layer_ids=(-1, 2, 8, 14, 20)), "kv_source_layer_ids",
     (-1, 2, 8, 14, 20), "layer -1"),
    ("idx_unsorted", "v41_flash", dict(index_source_layer_ids=(2, 8, 14, 20, 28, 24, 32, 36)),
     "index_source_layer_ids", (2, 8, 14, 20, 28, 24, 32, 36), "increasing order"),
    ("idx_duplicate", "v41_flash", dict(index_source_layer_ids=(2, 8, 14, 20, 24, 24, 28, 32, 36)),
     "index_source_layer_ids", (2, 8, 14, 20, 24, 24, 28, 32, 36), "once"),
    ("idx_out_of_range", "v41_flash", dict(index_source_layer_ids=(2, 8, 14, 20, 24, 28, 32, 36, 40)),
     "index_source_layer_ids", (2, 8, 14, 20, 24, 28, 32, 36, 40), "layer 40"),
    ("engram_unsorted", "v41_flash", dict(engram_layer_ids=(14, 1)), "engram_layer_ids", (14, 1), "increasing order"),
    ("engram_duplicate", "v41_flash", dict(engram_layer_ids=(1, 1, 14)), "engram_layer_ids", (1, 1, 14), "once"),
    ("engram_out_of_range", "mini", dict(engram_layer_ids=(1, 8)), "engram_layer_ids", (1, 8), "layer 8"),
    ("engram_negative", "v41_flash", dict(engram_layer_ids=(-1, 14)), "engram_layer_ids", (-1, 14), "layer -1"),
    ("dspark_unsorted", "v41_flash", dict(dspark_target_layer_ids=(39, 38, 37)), "dspark_target_layer_ids",
     (39, 38, 37), "increasing order"),
    ("dspark_duplicate", "v41_flash", dict(dspark_target_layer_ids=(37, 37, 39)), "dspark_target_layer_ids",
     (37, 37, 39), "once"),
    ("dspark_out_of_range", "v41_flash", dict(dspark_target_layer_ids=(37, 38, 40)), "dspark_target_layer_ids",
     (37, 38, 40), "layer 40"),
    # sources at ratio-0 layers
    ("kv_source_at_ratio_0", "v41_flash", dict(kv_source_layer_ids=(1, 2, 8, 14, 20)), "kv_source_layer_ids",
     (1, 2, 8, 14, 20), "layer 1 has compress ratio 0"),
    ("index_source_at_ratio_0", "v41_flash", dict(index_source_layer_ids=(0, 2, 8, 14, 20, 24, 28, 32, 36)),
     "index_source_layer_ids", (0, 2, 8, 14, 20, 24, 28, 32, 36), "layer 0 has compress ratio 0"),
    # KV sources ⊆ index sources
    ("kv_source_not_index_source", "v41_flash", dict(index_source_layer_ids=(2, 14, 20, 24, 28, 32, 36)),
     "index_source_layer_ids", (2, 14, 20, 24, 28, 32, 36), "[8]"),
    ("extra_kv_source_not_index_source", "v41_flash", dict(kv_source_layer_ids=(2, 8, 11, 14, 20)),
     "index_source_layer_ids", (2, 8, 14, 20, 24, 28, 32, 36), "[11]"),
    # candidate source
    ("candidate_not_index_source", "v41_flash", dict(candidate_source_layer_id=21), "candidate_source_layer_id", 21,
     None),
    ("candidate_outside_model", "v41_flash", dict(candidate_source_layer_id=40), "candidate_source_layer_id", 40,
     None),
    ("candidate_ratio_2", "v41_flash", dict(candidate_source_layer_id=14), "candidate_source_layer_id", 14,
     "ratio 2"),
    ("candidate_pool_too_small", "v41_flash", dict(candidate_topk_blocks=63), "candidate_topk_blocks", 63,
     "index_topk=512"),
    ("candidate_pool_below_topk", "v41_flash", dict(index_topk=16385), "candidate_topk_blocks", 2048,
     "index_topk=16385"),
    # head geometry / quant blocks
    ("rope_dim_odd", "v41_flash", dict(qk_rope_head_dim=63), "qk_rope_head_dim", 63, None),
    ("rope_dim_zero", "tiny", dict(qk_rope_head_dim=0), "qk_rope_head_dim", 0, None),
    ("head_dim_not_div_32", "v41_flash", dict(head_dim=528), "head_dim", 528, "32"),
    ("index_head_dim_not_div_32", "v41_flash", dict(index_head_dim=144), "index_head_dim", 144, "32"),
    ("index_head_dim_16_tiny", "tiny", dict(index_head_dim=16), "index_head_dim", 16, "32"),
    ("head_dim_below_rope", "tiny", dict(qk_rope_head_dim=64), "head_dim", 32, "qk_rope_head_dim=64"),
    ("index_head_dim_below_rope", "v41_flash", dict(index_head_dim=32), "index_head_dim", 32, "qk_rope_head_dim=64"),
    ("o_groups_not_dividing_heads", "v41_flash", dict(o_groups=7), "o_groups", 7, "num_attention_heads=64"),
    ("o_groups_not_dividing_heads_tiny", "tiny", dict(o_groups=3), "o_groups", 3, "num_attention_heads=4"),
    # MoE
    ("experts_per_tok_above_experts", "v41_flash", dict(num_experts_per_tok=385), "num_experts_per_tok", 385,
     "n_routed_experts=384"),
    ("dspark_experts_per_tok_above_experts", "v41_flash", dict(dspark_num_experts_per_tok=129),
     "dspark_num_experts_per_tok", 129, "dspark_n_routed_experts=128"),
    # mHC (the generic positive-integer rule catches it first; it must still name hc_mult)
    ("hc_mult_0", "v41_flash", dict(hc_mult=0), "hc_mult", 0, None),
    # Engram
    ("engram_max_ngram_1", "v41_flash", dict(engram_max_ngram_size=1), "engram_max_ngram_size", 1, None),
    ("engram_pad_id_at_vocab", "v41_flash", dict(engram_pad_id=99092), "engram_pad_id", 99092, "99092"),
    ("engram_pad_id_negative", "tiny", dict(engram_pad_id=-1), "engram_pad_id", -1, None),
    ("engram_compressed_vocab_overflow", "v41_flash", dict(engram_compressed_vocab_size=2**62 + 1),
     "engram_compressed_vocab_size", 2**62 + 1, None),
    ("engram_table_format_unknown", "v41_flash", dict(engram_table_format="fp4"), "engram_table_format", "fp4",
     "'fp8'"),
    ("engram_table_fp8_narrow_rows", "tiny", dict(engram_table_format="fp8"), "engram_table_format", "fp8",
     "engram_head_dim=16 must be a multiple of 32"),
    # DSpark / verify
    ("max_draft_below_block", "v41_flash", dict(max_draft=4), "max_draft", 4, "dspark_block_size = 5"),
    ("max_draft_below_block_tiny", "tiny", dict(dspark_block_size=6), "max_draft", 5, "= 6"),
    ("noise_token_at_vocab", "v41_flash", dict(dspark_noise_token_id=129280), "dspark_noise_token_id", 129280,
     "129280"),
    ("noise_token_negative", "tiny", dict(dspark_noise_token_id=-1), "dspark_noise_token_id", -1, None),
    ("noise_token_tiny_vocab", "tiny", dict(dspark_noise_token_id=259), "dspark_noise_token_id", 259, None),
]
RULES += [(f"positive_{name}_0", "v41_flash", {name: 0}, name, 0, "positive") for name in POSITIVE_INT_FIELDS]
RULES += [
    ("positive_negative", "tiny", dict(index_topk=-4), "index_topk", -4, "positive"),
    ("positive_float", "v41_flash", dict(sliding_window=128.0), "sliding_window", 128.0, "integer"),
    ("positive_bool", "v41_flash", dict(hc_sinkhorn_iters=True), "hc_sinkhorn_iters", True, "integer"),
]
RULES += [(f"float_{name}_0", "v41_flash", {name: 0.0}, name, 0.0, "> 0") for name in POSITIVE_FLOAT_FIELDS]
RULES += [(f"float_{name}_neg", "tiny", {name: -1e-6}, name, -1e-6, "> 0") for name in ("rms_norm_eps", "hc_eps")]
RULES += [("float_nan", "v41_flash", dict(rms_norm_eps=float("nan")), "rms_norm_eps", float("nan"), "> 0")]


@pytest.mark.parametrize("base,changes,field,value,extra", [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_validate_rule(base, changes, field, value, extra):
    cfg = preset(base)
    validate(cfg)  # the unmodified preset passes, so only `changes` can trigger the error
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    with pytest.raises(ValueError) as e:
        ModelConfig(**{**fields, **changes})
    msg = str(e.value)
    assert f"ModelConfig.{field}={value!r}" in msg, msg
    if extra is not None:
        assert extra in msg, msg
    # The same break through `replace` raises the same error.
    with pytest.raises(ValueError) as e2:
        cfg.replace(**changes)
    assert str(e2.value) == msg


def test_rule_ids_are_unique():
    ids = [r[0] for r in RULES]
    assert len(ids) == len(set(ids))


# Valid neighbours of the rules above: each rule is exactly as strict as SPEC/DESIGN require.
VALID = [
    ("pool_equals_topk", "v41_flash", dict(candidate_topk_blocks=64)),
    ("candidates_disabled_small_pool", "v41_flash", dict(candidate_source_layer_id=-1, candidate_topk_blocks=1)),
    ("candidate_at_later_reindex", "v41_flash", dict(candidate_source_layer_id=28)),
    ("experts_per_tok_equals_experts", "v41_flash", dict(num_experts_per_tok=384)),
    ("dspark_experts_per_tok_equals", "v41_flash", dict(dspark_num_experts_per_tok=128)),
    ("o_groups_16", "v41_flash", dict(o_groups=16)),
    ("head_dim_equals_rope", "tiny", dict(qk_rope_head_dim=32)),
    ("index_head_dim_equals_rope", "v41_flash", dict(index_head_dim=64)),
    ("pad_id_last", "v41_flash", dict(engram_pad_id=99091)),
    ("pad_id_zero", "v41_flash", dict(engram_pad_id=0)),
    ("noise_last", "v41_flash", dict(dspark_noise_token_id=129279)),
    ("max_draft_equals_block", "tiny", dict(dspark_block_size=5, max_draft=5)),
    ("no_drafter_no_draft", "v41_flash", dict(num_nextn_predict_layers=0, max_draft=0)),
    ("ngram_2", "v41_flash", dict(engram_max_ngram_size=2)),
    ("no_shared_expert", "v41_flash", dict(n_shared_experts=0)),
    ("extra_source_both_lists", "v41_flash",
     dict(kv_source_layer_ids=(2, 8, 11, 14, 20), index_source_layer_ids=(2, 8, 11, 14, 20, 24, 28, 32, 36))),
    ("ratio_change_at_source", "v41_flash", dict(compress_ratios=(0, 0) + (2,) * 6 + (4,) * 12 + (1,) * 20)),
    ("bf16_pallas", "tiny", dict(dtype="bfloat16", kernel_impl="pallas")),
]


@pytest.mark.parametrize("base,changes", [v[1:] for v in VALID], ids=[v[0] for v in VALID])
def test_validate_accepts_valid_neighbours(base, changes):
    cfg = preset(base).replace(**changes)
    for k, v in changes.items():
        assert getattr(cfg, k) == v


# --------------------------------------------------------------------------------------------
# Released config.json


def released_text_config() -> dict:
    """Every released field of SPEC §1 with the released values, as in the checkpoint's config.json."""
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41_text",
        "torch_dtype": "bfloat16",
        "transformers_version": "5.0.0",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "use_cache": True,
        "vocab_size": 129280,
        "hidden_size": 5120,
        "num_hidden_layers": 40,
        "num_attention_heads": 64,
        "num_key_value_heads": 1,
        "head_dim": 512,
        "q_lora_rank": 1280,
        "qk_rope_head_dim": 64,
        "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 1048576,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "sliding_window": 128,
        "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
        "kv_source_layer_ids": [2, 8, 14, 20],
        "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
        "candidate_source_layer_id": 20,
        "candidate_topk_blocks": 2048,
        "candidate_block_size": 8,
        "index_n_heads": 32,
        "index_head_dim": 128,
        "index_topk": 512,
        "o_groups": 8,
        "o_lora_rank": 1024,
        "moe_intermediate_size": 2304,
        "n_routed_experts": 384,
        "n_shared_experts": 1,
        "num_experts_per_tok": 6,
        "scoring_func": "sqrtsoftplus",
        "gate_temp": 1.0,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "topk_method": "noaux_tc",
        "swiglu_limit": 10.0,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "engram_layer_ids": [1, 14],
        "engram_vocab_size": 16000000,
        "engram_num_embeddings": [384006168, 384016682],
        "engram_max_ngram_size": 4,
        "engram_n_heads": 8,
        "engram_head_dim": 256,
        "engram_pad_id": 2,
        "engram_compressed_vocab_size": 99092,
        "num_nextn_predict_layers": 3,
        "dspark_block_size": 5,
        "dspark_noise_token_id": 128799,
        "dspark_target_layer_ids": [37, 38, 39],
        "dspark_markov_rank": 256,
        "dspark_n_routed_experts": 128,
        "dspark_num_experts_per_tok": 3,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-20,
        "tie_word_embeddings": False,
    }


def test_from_hf_config_flat_equals_preset():
    cfg = from_hf_config(released_text_config())
    assert cfg == preset("v41_flash")
    assert hash(cfg) == hash(preset("v41_flash"))


def test_from_hf_config_nested_equals_preset():
    d = {"architectures": ["DeepseekV41ForConditionalGeneration"], "model_type": "deepseek_v41",
         "torch_dtype": "bfloat16", "text_config": released_text_config()}
    assert from_hf_config(d) == preset("v41_flash")


@pytest.mark.parametrize("name", PRESETS)
def test_to_hf_config_reads_back_to_the_same_config(name):
    cfg = preset(name)
    text = to_hf_config(cfg)
    assert text["engram_pad_token_id"] == cfg.engram_pad_id and "engram_pad_id" not in text
    assert len(text["compress_ratios"]) == cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    assert from_hf_config(json.loads(json.dumps(text)), dtype=cfg.dtype, max_draft=cfg.max_draft) == cfg


def test_from_hf_config_reads_the_released_spelling_of_the_engram_pad_id():
    d = released_text_config()
    d.pop("engram_pad_id")  # the HF port's spelling; the release spells it engram_pad_token_id
    assert from_hf_config({**d, "engram_pad_token_id": 7}).engram_pad_id == 7
    with pytest.raises(ValueError, match="sets 'engram_pad_id' twice"):
        from_hf_config({**d, "engram_pad_token_id": 7, "engram_pad_id": 7})


def test_from_hf_config_framework_fields():
    cfg = from_hf_config(released_text_config(), dtype="float32", kernel_impl="pallas", max_draft=6)
    assert cfg == preset("v41_flash").replace(dtype="float32", kernel_impl="pallas", max_draft=6)
    with pytest.raises(ValueError, match="vocab_size"):
        from_hf_config(released_text_config(), vocab_size=10)


def test_from_hf_config_rope_scaling_type_alias_and_none():
    d = released_text_config()
    d["rope_scaling"] = {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                         "beta_fast": 32.0, "beta_slow": 1.0}
    assert from_hf_config(d) == preset("v41_flash")


def test_from_hf_config_reads_every_value():
    """Non-default values land in the config (equality with the preset alone could not tell)."""
    d = released_text_config()
    changed = {
        "vocab_size": 130000, "hidden_size": 4096, "num_attention_heads": 32, "head_dim": 256, "q_lora_rank": 1024,
        "qk_rope_head_dim": 32, "rope_theta": 5000.0, "compress_rope_theta": 80000.0,
        "max_position_embeddings": 524288, "sliding_window": 64,
        "num_hidden_layers": 20, "compress_ratios": [0] + [2] * 9 + [1] * 10,
        "kv_source_layer_ids": [1, 5, 10], "index_source_layer_ids": [1, 5, 10, 14],
        "candidate_source_layer_id": 10, "candidate_topk_blocks": 1024, "candidate_block_size": 4,
        "index_n_heads": 16, "index_head_dim": 64, "index_topk": 256, "o_groups": 4, "o_lora_rank": 512,
        "moe_intermediate_size": 1024, "n_routed_experts": 64, "n_shared_experts": 0, "num_experts_per_tok": 4,
        "gate_temp": 0.5, "routed_scaling_factor": 2.0, "swiglu_limit": 7.0, "hc_mult": 2,
        "hc_sinkhorn_iters": 10, "hc_eps": 1e-5, "engram_layer_ids": [1], "engram_vocab_size": 1000,
        "engram_max_ngram_size": 3, "engram_n_heads": 4, "engram_head_dim": 128, "engram_pad_id": 3,
        "engram_compressed_vocab_size": 5000, "num_nextn_predict_layers": 2, "dspark_block_size": 4,
        "dspark_noise_token_id": 100, "dspark_target_layer_ids": [17, 18, 19], "dspark_markov_rank": 128,
        "dspark_n_routed_experts": 64, "dspark_num_experts_per_tok": 2, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    }
    d.update(changed)
    d["compress_ratios"] = changed["compress_ratios"] + [0, 0]
    d["rope_scaling"] = {"rope_type": "yarn", "factor": 8, "original_max_position_embeddings": 4096,
                         "beta_fast": 16, "beta_slow": 2}
    cfg = from_hf_config(d)
    for key, value in changed.items():
        expected = tuple(value) if isinstance(value, list) else value
        assert getattr(cfg, key) == expected, key
    assert cfg.rope_scaling == yarn(factor=8.0, original_max_position_embeddings=4096, beta_fast=16.0, beta_slow=2.0)


def test_from_hf_config_unknown_key():
    d = released_text_config()
    d["frobnicate_heads"] = 3
    with pytest.raises(ValueError, match="frobnicate_heads"):
        from_hf_config(d)
    with pytest.raises(ValueError, match="frobnicate_heads"):
        from_hf_config({"text_config": d})


def _saved_by_transformers(text: dict, directory: pathlib.Path) -> dict:
    """The config.json that transformers' `save_pretrained` writes for a composite config whose `text_config`
    is `text` (the layout of a saved `DeepseekV41ForCausalLM`), read back from `directory`."""
    from transformers import PreTrainedConfig

    class TextConfig(PreTrainedConfig):
        model_type = "deepseek_v41_text"
        base_config_key = "text_config"
        rope_scaling: dict | None = None  # a field of the V4.1 text config, not transformers' generic RoPE alias

    class Config(PreTrainedConfig):
        model_type = "deepseek_v41"
        sub_configs = {"text_config": TextConfig}
        text_config: dict | PreTrainedConfig | None = None

        def __post_init__(self, **kwargs):
            if isinstance(self.text_config, dict):
                self.text_config = TextConfig(**self.text_config)
            super().__post_init__(**kwargs)

    Config(architectures=["DeepseekV41ForCausalLM"], text_config=text).save_pretrained(directory)
    return json.loads((directory / "config.json").read_text())


@pytest.mark.parametrize("name", PRESETS)
def test_from_hf_config_reads_a_config_json_that_transformers_saved(name, tmp_path):
    """transformers writes its generic `PreTrainedConfig` keys (`_name_or_path`, `id2label`, `return_dict`, ...)
    into the `text_config` of every config it saves: a re-saved checkpoint reads back to the same config,
    and a real unknown key beside them is still refused by name."""
    from transformers import PreTrainedConfig

    from csa2.checkpoints.hf import read_config

    cfg = preset(name)
    saved = _saved_by_transformers(to_hf_config(cfg), tmp_path)
    generic = set(PreTrainedConfig().to_dict()) - {"transformers_version"}
    assert generic <= set(saved["text_config"]), "every generic key transformers writes is under test"
    assert from_hf_config(saved, dtype=cfg.dtype, max_draft=cfg.max_draft) == cfg
    assert model_differences(read_config(tmp_path), cfg) == ()  # the checkpoint directory loads
    saved["text_config"]["frobnicate_heads"] = 3
    with pytest.raises(ValueError, match="unknown key 'frobnicate_heads'"):
        from_hf_config(saved)


def test_from_hf_config_rejects_framework_field_keys():
    d = released_text_config()
    d["max_draft"] = 4
    with pytest.raises(ValueError, match="max_draft"):
        from_hf_config(d)


@pytest.mark.parametrize("heads", [8, 64])
def test_from_hf_config_rejects_multi_kv_heads(heads):
    d = released_text_config()
    d["num_key_value_heads"] = heads
    with pytest.raises(ValueError, match=f"num_key_value_heads={heads}"):
        from_hf_config(d)


@pytest.mark.parametrize("key,value", [("attention_bias", True), ("hidden_act", "gelu"), ("topk_method", "greedy"),
                                       ("norm_topk_prob", False)])
def test_from_hf_config_rejects_unsupported_fixed_values(key, value):
    d = released_text_config()
    d[key] = value
    with pytest.raises(ValueError, match=key):
        from_hf_config(d)


@pytest.mark.parametrize("rope_scaling", [
    {"rope_type": "linear", "factor": 2.0},
    {"type": "dynamic", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192},
], ids=["linear", "dynamic", "llama3"])
def test_from_hf_config_rejects_non_yarn(rope_scaling):
    d = released_text_config()
    d["rope_scaling"] = rope_scaling
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    with pytest.raises(ValueError, match=kind):
        from_hf_config(d)


def test_from_hf_config_rejects_unknown_yarn_keys():
    d = released_text_config()
    d["rope_scaling"] = {**d["rope_scaling"], "mscale": 0.707}
    with pytest.raises(ValueError, match="mscale"):
        from_hf_config(d)


@pytest.mark.parametrize("trailing", [[0, 1, 0], [2, 0, 0], [0, 0, 1]])
def test_from_hf_config_rejects_nonzero_trailing_ratio(trailing):
    d = released_text_config()
    d["compress_ratios"] = [0, 0] + [2] * 18 + [1] * 20 + trailing
    with pytest.raises(ValueError, match="compress_ratios"):
        from_hf_config(d)


def test_from_hf_config_validates():
    d = released_text_config()
    d["kv_source_layer_ids"] = [2, 8, 14, 21]
    with pytest.raises(ValueError, match="kv_source_layer_ids|compress_ratios"):
        from_hf_config(d)
    d = copy.deepcopy(released_text_config())
    d["compress_ratios"] = [0, 0] + [2] * 18 + [1] * 19  # one short: not padded, not truncated
    with pytest.raises(ValueError, match="compress_ratios"):
        from_hf_config(d)


def test_from_hf_config_does_not_mutate_input():
    d = released_text_config()
    before = copy.deepcopy(d)
    from_hf_config(d)
    assert d == before


# --------------------------------------------------------------------------------------------
# Rules found missing in review, fixed, and kept under test.


@pytest.mark.parametrize("changes", [dict(dspark_num_experts_per_tok=0), dict(num_nextn_predict_layers=-1)],
                         ids=["dspark_topk_0", "nextn_negative"])
def test_dspark_counts_are_validated(changes):
    with pytest.raises(ValueError, match=next(iter(changes))):
        preset("v41_flash").replace(**changes)


def test_non_numeric_float_field_is_a_value_error():
    with pytest.raises(ValueError, match="rms_norm_eps"):
        preset("v41_flash").replace(rms_norm_eps="1e-6")


def test_from_hf_config_honours_initializer_range():
    d = released_text_config()
    d["initializer_range"] = 0.006
    assert from_hf_config(d).initializer_range == 0.006


def test_from_hf_config_candidate_none_defaults_to_last_kv_source():
    d = released_text_config()
    d.update(candidate_source_layer_id=None, num_hidden_layers=20, compress_ratios=[0] + [2] * 9 + [1] * 10,
             kv_source_layer_ids=[1, 5, 10], index_source_layer_ids=[1, 5, 10, 14], engram_layer_ids=[1],
             dspark_target_layer_ids=[17, 18, 19])
    assert from_hf_config(d).candidate_source_layer_id == 10


@pytest.mark.parametrize("rope_scaling", [{"rope_type": "yarn", "factor": 16}, "yarn"], ids=["partial", "str"])
def test_from_hf_config_malformed_rope_scaling_is_a_value_error(rope_scaling):
    d = released_text_config()
    d["rope_scaling"] = rope_scaling
    with pytest.raises(ValueError, match="rope_scaling"):
        from_hf_config(d)


def test_pallas_needs_a_power_of_two_candidate_block():
    preset("mini").replace(kernel_impl="pallas")
    preset("mini").replace(candidate_block_size=6, candidate_topk_blocks=8)  # fine for the XLA path
    with pytest.raises(ValueError, match="candidate_block_size=6"):
        preset("mini").replace(kernel_impl="pallas", candidate_block_size=6, candidate_topk_blocks=8)


# --------------------------------------------------------------------------------------------
# Field groups: RELEASED (config.json), VARIANT (changes the math), RUNTIME (how it runs)

# Keys of the released config.json that the config does not store: metadata, and fixed or derived values.
NOT_STORED = {"architectures", "model_type", "torch_dtype", "transformers_version", "bos_token_id", "eos_token_id",
              "use_cache", "num_key_value_heads", "attention_bias", "attention_dropout", "norm_topk_prob",
              "topk_method", "engram_num_embeddings", "hidden_act"}


def test_released_fields_are_exactly_the_released_config_json_keys():
    released = fields_of(RELEASED)
    assert len(released) == len(set(released))
    assert set(released) == set(released_text_config()) - NOT_STORED
    assert NOT_STORED <= set(released_text_config())
    names = [f.name for f in dataclasses.fields(ModelConfig)]
    assert list(released) == [n for n in names if n in released]  # declaration order


@pytest.mark.parametrize("name", fields_of(RELEASED))
def test_each_released_field_is_read_from_config_json(name):
    """The class accepts every RELEASED field as a config.json key, by that name."""
    d = released_text_config()
    assert name in d
    cfg = from_hf_config({k: v for k, v in d.items() if k not in set(fields_of(RELEASED)) - {name}})
    assert getattr(cfg, name) == getattr(preset("v41_flash"), name)


def test_variant_and_runtime_fields():
    assert fields_of(VARIANT) == ("mhc_single_pass", "engram_table_format")
    assert fields_of(RUNTIME) == ("dtype", "kernel_impl", "max_draft")
    assert fields_of(VARIANT, RUNTIME) == ("dtype", "kernel_impl", "max_draft", "mhc_single_pass",
                                           "engram_table_format")


def test_groups_partition_the_fields():
    names = tuple(f.name for f in dataclasses.fields(ModelConfig))
    assert fields_of(RELEASED, VARIANT, RUNTIME) == names
    groups = [set(fields_of(g)) for g in (RELEASED, VARIANT, RUNTIME)]
    assert sum(len(g) for g in groups) == len(names)
    assert fields_of() == ()
    with pytest.raises(ValueError, match="'bogus'"):
        fields_of("bogus")


@pytest.mark.parametrize("name", ["kernel_impl", "max_draft", "mhc_single_pass"])
def test_from_hf_config_refuses_framework_fields_as_config_json_keys(name):
    """VARIANT and RUNTIME fields are set by keyword (`from_hf_config(d, name=...)`), never read from config.json."""
    d = released_text_config()
    d[name] = getattr(preset("v41_flash"), name)
    with pytest.raises(ValueError, match=f"{name}.*framework field.*from_hf_config"):
        from_hf_config(d)
    with pytest.raises(ValueError, match=name):
        from_hf_config({"text_config": d})
    value = {"kernel_impl": "pallas", "max_draft": 6, "mhc_single_pass": False}[name]
    assert getattr(from_hf_config(released_text_config(), **{name: value}), name) == value


def test_from_hf_config_dtype_key_is_the_weights_storage_dtype_not_the_compute_dtype():
    """config.json's `dtype` (transformers' name for `torch_dtype`) is metadata: it never sets the RUNTIME dtype."""
    d = released_text_config()
    d["dtype"] = "float32"
    assert from_hf_config(d).dtype == preset("v41_flash").dtype == "bfloat16"
    assert from_hf_config(d, dtype="float32").dtype == "float32"


def test_from_hf_config_keyword_must_be_a_framework_field():
    for name in fields_of(RELEASED):
        with pytest.raises(ValueError, match=name):
            from_hf_config(released_text_config(), **{name: getattr(preset("v41_flash"), name)})


def test_model_differences():
    a = preset("tiny")
    assert model_differences(a, a) == ()
    assert model_differences(a, preset("tiny")) == ()
    # RUNTIME fields never make a difference
    runtime = a.replace(dtype="bfloat16", kernel_impl="pallas", max_draft=6)
    assert model_differences(a, runtime) == model_differences(runtime, a) == ()
    # VARIANT and RELEASED fields do, named in declaration order, symmetric
    b = a.replace(mhc_single_pass=False)
    assert model_differences(a, b) == model_differences(b, a) == ("mhc_single_pass",)
    c = a.replace(hidden_size=128, rms_norm_eps=1e-5, mhc_single_pass=False, dtype="bfloat16")
    assert model_differences(a, c) == model_differences(c, a) == ("hidden_size", "rms_norm_eps", "mhc_single_pass")
    assert set(model_differences(preset("tiny"), preset("mini"))) == {
        "num_hidden_layers", "compress_ratios", "kv_source_layer_ids", "index_source_layer_ids",
        "candidate_source_layer_id", "engram_layer_ids", "dspark_target_layer_ids"}
    assert "rope_scaling" in model_differences(
        a, a.replace(rope_scaling=yarn(factor=8.0, original_max_position_embeddings=4096, beta_fast=32.0,
                                       beta_slow=1.0)))


def _csa2_imports(module) -> list[str]:
    """The csa2 modules (and relative imports) that `module`'s source imports."""
    source = pathlib.Path(module.__file__).read_text()
    imported = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            imported.append("." * node.level + (node.module or ""))
    assert imported, "the walk sees the module's imports"
    return [m for m in imported if m.startswith(".") or m == "csa2" or m.startswith("csa2.")]


def test_config_imports_only_the_host_checks_from_csa2():
    """csa2.config is the root of the model's import graph (every other module may import it): from csa2 it
    imports only csa2.checks, which imports nothing from csa2."""
    assert _csa2_imports(csa2.config) == ["csa2.checks"]
    assert _csa2_imports(csa2.checks) == []


def test_kernel_impl_takes_the_choices_of_the_ops_table():
    """config reads the kernel choices from the ops table: each is accepted, and a refusal names them all."""
    for choice in ops.CHOICES:
        assert preset("mini").replace(kernel_impl=choice).kernel_impl == choice
    assert preset("mini").replace(kernel_impl="auto").kernel_impl == "auto"
    with pytest.raises(ValueError, match="kernel_impl='bogus'") as e:
        preset("mini").replace(kernel_impl="bogus")
    assert str(ops.CHOICES) in str(e.value)
