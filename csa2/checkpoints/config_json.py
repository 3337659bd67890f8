"""The released `config.json` ↔ `ModelConfig` (SPEC §1): `from_hf_config` reads it, `to_hf_config` writes its
`text_config`. Only the RELEASED fields come from the file; VARIANT and RUNTIME fields are passed by keyword.

A key this framework cannot honour raises `ValueError` naming it. Accepted without being stored: metadata
(`model_type`, `dtype`, token ids, ...), keys the released values fix (`num_key_value_heads`: 1, ...), and
the generic keys that transformers' `PreTrainedConfig` writes into every config it saves (a checkpoint that
transformers re-saved carries them in its `text_config`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from csa2.config import RELEASED, RUNTIME, VARIANT, ModelConfig, YarnScaling, fields_of

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
# Keys that transformers' generic `PreTrainedConfig.to_dict` writes for any model (`save_pretrained` of a
# `DeepseekV41ForCausalLM` puts them in `text_config`): task heads, output switches, the load path.
_HF_GENERIC = {
    "_name_or_path", "chunk_size_feed_forward", "id2label", "label2id", "is_encoder_decoder",
    "output_attentions", "output_hidden_states", "problem_type", "return_dict",
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
        elif key in _HF_IGNORED or key in _HF_GENERIC:
            continue
        elif key == "rope_scaling":
            if value is not None and not isinstance(value, Mapping):
                raise ValueError(f"config.json rope_scaling={value!r}: expected a dict like "
                                 "{'rope_type': 'yarn', 'factor': 16, ...} or null")
            if value is not None:
                kind = value.get("rope_type", value.get("type", "yarn"))
                if kind != "yarn":
                    raise ValueError(f"config.json rope_scaling.rope_type={kind!r}: only 'yarn' is implemented "
                                     "(SPEC §7)")
                known = {f.name for f in dataclasses.fields(YarnScaling)}
                extra = sorted(set(value) - known - {"rope_type", "type"})
                if extra:
                    raise ValueError(f"config.json rope_scaling has unknown keys {extra}; known: {sorted(known)}")
                missing = sorted(known - set(value))
                if missing:
                    raise ValueError(f"config.json rope_scaling lacks {missing}; the YaRN of SPEC §7 needs all of "
                                     f"{sorted(known)}")
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

