"""The released checkpoint's tensor names, and the parameter each one becomes (the name map).

One `Tensor` per released tensor of a config: its name in the safetensors files, its logical shape
(torch layout, `nn.Linear` weights `[out, in]`), how it is stored (a `WeightFormat` with a sibling
`<base>.scale`, or a float dtype), and where it lands: `path` into the pure dict of parameters,
`index` into that leaf's stacked axes (`[iterations, layers of the run]` of `layout.layer_groups`, then
the expert; none for an Engram memory, `engram[k]`), and the `layout` that turns one into the other (layout:
released → parameter; tensors):

- `as_is`: unchanged; norms, sinks, biases, mHC base/scale, embed, Engram table and norm weights, Markov embedding
- `linear`: transposed: `[out, in]` → `[in, out]` (x @ w); every projection, router, experts, mHC `fn`, LM head,
  Markov head
- `grouped`: `wo_a [G·R, in]` viewed `[G, R, in]` → `[G, in, R]`; `attn.wo_a`
- `row`: `[1, n]` → `[n]`; DSpark `confidence_head.proj`

Names (DeepSeek-V4.1 release; no `model.` prefix):

    embed.weight, norm.weight, head.weight
    layers.{i}.{attn_norm,ffn_norm}.weight, layers.{i}.hc_{attn,ffn}_{fn,base,scale}
    layers.{i}.attn.{wq_a,q_norm,wq_b,wkv,kv_norm,wo_a,wo_b}.weight, layers.{i}.attn.attn_sink
    layers.{i}.attn.compressor.{wkv,wgate,norm}.weight, layers.{i}.attn.indexer.{wk,k_norm}.weight   (Full)
    layers.{i}.attn.indexer.{wq_b,weights_proj}.weight                                         (Full, Reindex)
    layers.{i}.ffn.gate.{weight,bias,bias_vl}, layers.{i}.ffn.experts.{e}.{w1,w2,w3}.weight,
    layers.{i}.ffn.shared_experts.{w1,w2,w3}.weight
    layers.{i}.engram.{embed.weight,wkv.weight,q_weight,k_weight}                              (Engram layers)
    mtp.{s}.<a block as above, SWA-only, dspark_n_routed_experts experts>; mtp.0.{main_proj,main_norm}.weight;
    mtp.{last}.{norm.weight, markov_head.embed.weight, markov_head.head.weight, confidence_head.proj.weight}

RoPE needs no permutation: the release rotates interleaved pairs of the last `qk_rope_head_dim` channels,
as csa2 does (SPEC §7). The compressor's `wkv` feeds SPEC §4's pooling, the indexer's `wk` (the index-key projection,
applied to the pooled latent) becomes the compressor's `wik` and `k_norm` its `ik_norm`: in csa2 the compressor
publishes both the Main KV and the Indexer K of its group. `SKIPPED` lists the released tensors a
text model has no parameter for (the vision tower), with the reason.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterator

import numpy as np

from csa2.checkpoints.weights import FP4, FP8_BLOCK, FP8_ROWS, WeightFormat
from csa2.config import ModelConfig
from csa2.dspark import DRAFTER, draft_moe_config, stage_spec
from csa2.engram import engram_table_rows, n_tables
from csa2.layout import LayerSpec, addresses, layer_plan

LAYOUTS = ("as_is", "linear", "grouped", "row")
SKIPPED = (
    (re.compile(r"^(vision|aligner)\."), "the vision tower and its aligner: csa2 is a text model"),
    (re.compile(r"^image_(start|end|newline|pad)$"), "image delimiter embeddings: csa2 is a text model"),
)


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One released tensor and the parameter slot it fills."""

    name: str  # e.g. "layers.2.attn.wq_a.weight"
    shape: tuple[int, ...]  # logical shape, torch layout
    fmt: WeightFormat | None  # quantized storage (payload `name`, scale `scale_name`), or None for a float tensor
    dtype: str  # the released dtype code of a float tensor ("BF16", "F32"); the payload code when quantized
    path: tuple  # keys into `nnx.to_pure_dict(params)`
    index: tuple[int, ...]  # position inside that (stacked) leaf
    layout: str  # one of LAYOUTS
    groups: int = 1  # G of the `grouped` layout

    @property
    def scale_name(self) -> str | None:
        return None if self.fmt is None else scale_of(self.name)


def scale_of(name: str) -> str | None:
    """The name of the `.scale` beside weight `name` (`a.b.weight` → `a.b.scale`); None for a name without `.weight`."""
    return name[: -len(".weight")] + ".scale" if name.endswith(".weight") else None


def skip_reason(name: str) -> str | None:
    """Why a released tensor without a parameter is skipped, or None if it must be mapped."""
    return next((why for pattern, why in SKIPPED if pattern.search(name)), None)


def to_param(t: Tensor, x: np.ndarray) -> np.ndarray:
    """The parameter slice of released tensor `t` (logical value `x`, float)."""
    if x.shape != t.shape:
        raise ValueError(f"tensor {t.name!r}: shape {x.shape}; the config expects {t.shape}")
    if t.layout == "linear":
        return x.T
    if t.layout == "grouped":
        return x.reshape(t.groups, -1, x.shape[1]).transpose(0, 2, 1)
    if t.layout == "row":
        return x.reshape(-1)
    return x


def from_param(t: Tensor, p: np.ndarray) -> np.ndarray:
    """The released tensor `t` (logical shape) from its parameter slice: the inverse of `to_param`."""
    if t.layout == "linear":
        x = p.T
    elif t.layout == "grouped":
        x = p.transpose(0, 2, 1).reshape(t.shape)
    else:
        x = p.reshape(t.shape)
    if x.shape != t.shape:
        raise ValueError(f"parameter {'/'.join(map(str, t.path))}{list(t.index)}: shape {p.shape} gives {x.shape}, "
                         f"not the released {t.shape} of {t.name!r}")
    return x


def _float(name, shape, dtype, path, index, layout="as_is") -> Tensor:
    return Tensor(name, tuple(shape), None, dtype, tuple(path), tuple(index), layout)


def _quant(name, shape, fmt, path, index, layout="linear") -> Tensor:
    return Tensor(name, tuple(shape), fmt, fmt.payload, tuple(path), tuple(index), layout)


def _block(cfg: ModelConfig, spec: LayerSpec, n_experts: int, pre: str, path: tuple, index: tuple) -> Iterator[Tensor]:
    """The tensors of one block (a backbone layer or a DSpark stage) named `pre.*`."""
    d, q, h, dh = cfg.hidden_size, cfg.q_lora_rank, cfg.num_attention_heads, cfg.head_dim
    g, r, i, hc = cfg.o_groups, cfg.o_lora_rank, cfg.moe_intermediate_size, cfg.hc_mult
    mix = (2 + hc) * hc
    for site in ("attn", "ffn"):
        yield _float(f"{pre}.{site}_norm.weight", (d,), "BF16", path + (f"{site}_norm",), index)
        yield _float(f"{pre}.hc_{site}_fn", (mix, hc * d), "F32", path + (f"{site}_hc", "fn"), index, "linear")
        yield _float(f"{pre}.hc_{site}_base", (mix,), "F32", path + (f"{site}_hc", "base"), index)
        yield _float(f"{pre}.hc_{site}_scale", (3,), "F32", path + (f"{site}_hc", "scale"), index)
    a, ap = f"{pre}.attn", path + ("attn",)
    yield _quant(f"{a}.wq_a.weight", (q, d), FP8_BLOCK, ap + ("wq_a",), index)
    yield _float(f"{a}.q_norm.weight", (q,), "BF16", ap + ("q_norm",), index)
    yield _quant(f"{a}.wq_b.weight", (h * dh, q), FP8_BLOCK, ap + ("wq_b",), index)
    yield _quant(f"{a}.wkv.weight", (dh, d), FP8_BLOCK, ap + ("wkv",), index)
    yield _float(f"{a}.kv_norm.weight", (dh,), "BF16", ap + ("kv_norm",), index)
    wo_a = _quant(f"{a}.wo_a.weight", (g * r, h // g * dh), FP8_BLOCK, ap + ("wo_a",), index, "grouped")
    yield dataclasses.replace(wo_a, groups=g)
    yield _quant(f"{a}.wo_b.weight", (d, g * r), FP8_BLOCK, ap + ("wo_b",), index)
    yield _float(f"{a}.attn_sink", (h,), "F32", ap + ("sink",), index)
    if spec.role == "full":
        cp = ap + ("compressor",)
        yield _float(f"{a}.compressor.wkv.weight", (dh, d), "BF16", cp + ("wkv",), index, "linear")
        if spec.ratio > 1:
            yield _float(f"{a}.compressor.wgate.weight", (dh, d), "BF16", cp + ("wgate",), index, "linear")
        yield _float(f"{a}.compressor.norm.weight", (dh,), "BF16", cp + ("norm",), index)
        yield _float(f"{a}.indexer.wk.weight", (cfg.index_head_dim, dh), "BF16", cp + ("wik",), index, "linear")
        yield _float(f"{a}.indexer.k_norm.weight", (cfg.index_head_dim,), "BF16", cp + ("ik_norm",), index)
    if spec.role in ("full", "reindex"):
        ip = ap + ("indexer",)
        yield _quant(f"{a}.indexer.wq_b.weight", (cfg.index_n_heads * cfg.index_head_dim, q), FP8_BLOCK, ip + ("wq",),
                     index)
        yield _float(f"{a}.indexer.weights_proj.weight", (cfg.index_n_heads, d), "BF16", ip + ("ww",), index, "linear")
    f, mp = f"{pre}.ffn", path + ("moe",)
    yield _float(f"{f}.gate.weight", (n_experts, d), "BF16", mp + ("router",), index, "linear")
    yield _float(f"{f}.gate.bias", (n_experts,), "F32", mp + ("bias",), index)
    yield _float(f"{f}.gate.bias_vl", (n_experts,), "F32", mp + ("bias_vl",), index)
    for e in range(n_experts):
        for w, shape in (("w1", (i, d)), ("w2", (d, i)), ("w3", (i, d))):
            yield _quant(f"{f}.experts.{e}.{w}.weight", shape, FP4, mp + (w,), index + (e,))
    if cfg.n_shared_experts:
        for w, shape in (("w1", (i, d)), ("w2", (d, i)), ("w3", (i, d))):
            yield _quant(f"{f}.shared_experts.{w}.weight", shape, FP8_BLOCK, mp + ("shared", w), index)


def _engram(cfg: ModelConfig, layer: int, k: int) -> Iterator[Tensor]:
    """The tensors of Engram layer `layer`, the k-th of `engram_layer_ids`: its memory is `engram[k]`."""
    d, hc, hd = cfg.hidden_size, cfg.hc_mult, cfg.engram_head_dim
    pre, path = f"layers.{layer}.engram", ("engram", k)
    yield _quant(f"{pre}.embed.weight", (engram_table_rows(cfg, layer), hd), FP8_ROWS, path + ("table",), (), "as_is")
    yield _quant(f"{pre}.wkv.weight", ((hc + 1) * d, n_tables(cfg) * hd), FP8_BLOCK, path + ("wkv",), ())
    for w in ("q_weight", "k_weight"):
        yield _float(f"{pre}.{w}", (hc, d), "BF16", path + (w,), ())


def _drafter(cfg: ModelConfig) -> Iterator[Tensor]:
    d, v, rank, n = cfg.hidden_size, cfg.vocab_size, cfg.dspark_markov_rank, cfg.num_nextn_predict_layers
    draft_cfg = draft_moe_config(cfg)
    first, last = "mtp.0", f"mtp.{n - 1}"
    yield _quant(f"{first}.main_proj.weight", (d, len(cfg.dspark_target_layer_ids) * d), FP8_BLOCK,
                 (DRAFTER, "main_proj"), ())
    yield _float(f"{first}.main_norm.weight", (d,), "BF16", (DRAFTER, "main_norm"), ())
    for s in range(n):
        yield from _block(draft_cfg, stage_spec(cfg, s), cfg.dspark_n_routed_experts, f"mtp.{s}",
                          (DRAFTER, "stages", s), ())
    yield _float(f"{last}.norm.weight", (d,), "BF16", (DRAFTER, "norm"), ())
    yield _float(f"{last}.markov_head.embed.weight", (v, rank), "BF16", (DRAFTER, "markov_embed"), ())
    yield _float(f"{last}.markov_head.head.weight", (v, rank), "BF16", (DRAFTER, "markov_head"), (), "linear")
    yield _float(f"{last}.confidence_head.proj.weight", (1, d + rank), "BF16", (DRAFTER, "confidence"), (), "row")


def tensors(cfg: ModelConfig) -> tuple[Tensor, ...]:
    """Every released tensor of `cfg` (a quantized one once, by its `.weight` name), in layer order."""
    d, v = cfg.hidden_size, cfg.vocab_size
    out = [_float("embed.weight", (v, d), "BF16", ("embed",), ())]
    for spec in layer_plan(cfg):
        if spec.has_engram:
            out.extend(_engram(cfg, spec.index, cfg.engram_layer_ids.index(spec.index)))
        gi, it, ri, j = addresses(cfg)[spec.index]
        out.extend(_block(cfg, spec, cfg.n_routed_experts, f"layers.{spec.index}", ("groups", gi, ri), (it, j)))
    out.append(_float("norm.weight", (d,), "BF16", ("norm",), ()))
    out.append(_float("head.weight", (v, d), "BF16", ("head",), (), "linear"))
    if cfg.num_nextn_predict_layers:
        out.extend(_drafter(cfg))
    return tuple(out)
