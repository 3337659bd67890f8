"""Load and save checkpoints in the released DeepSeek-V4.1 layout: `config.json` + safetensors shards.

- `load_hf(path, cfg=None, *, dtype)`: the config from `config.json` (`from_hf_config`; a `cfg` you pass
  must agree with it on every released field), then every tensor of `released.tensors(cfg)`, one at a
  time: read lazily (`Shards`), decoded from its stored format into float32 (`weights`: FP8 32×32
  blocks, packed FP4 experts, FP8 Engram rows; a float tensor of any float dtype is cast), laid out
  as its parameter (`released.to_param`) and written into a preallocated stacked leaf of `dtype`.
  Nothing but the leaves and the tensor in hand is held, so the memory beyond the parameters stays
  bounded by a few copies of the largest tensor (`read_hf` reports the peak). The storage format is
  read from the files (a `<base>.scale` beside a payload means quantized), not assumed. A model that
  hashes compressed Engram ids (`csa2.engram_vocab`) gets its table from the checkpoint's `tokenizer.json`
  (the release stores no tensor for it) or from `engram_table=`.
- `save_hf(params, cfg, path, *, dtype, formats)`: the inverse: `config.json` (`to_hf_config` plus
  `engram_num_embeddings`) and shards with every tensor under its released name, in float
  (`formats="float"`, `dtype` float32 or bfloat16) or in the release's own storage formats
  (`formats="released"`: FP8 blocks, FP4 experts, FP8 Engram rows, BF16/F32 elsewhere).
- `dry_run(cfg)`: every released tensor name with the parameter it becomes, from shapes alone.

A checkpoint's tensors must match the config exactly: a tensor the map does not know (other than the
vision tower, skipped with its reason), a missing one, a wrong shape, or a payload without its scale
raise `ValueError` naming the tensor. With a mesh (`load_hf(..., mesh=, rules=)`, `csa2.mesh`) each
tensor is written straight into the host buffers of the shards it falls in (`HostShards`: only this
process's addressable shards exist), and each parameter is assembled from them on its devices.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import tracemalloc
from pathlib import Path
from typing import Any, Iterator

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from csa2 import engram_vocab
from csa2.checkpoints import released, shards as shards_lib, weights
from csa2.checkpoints.config_json import from_hf_config, to_hf_config
from csa2.checkpoints.released import Tensor
from csa2.checks import tree_bytes
from csa2.config import RUNTIME, VARIANT, ModelConfig, fields_of, model_differences
from csa2.engram import engram_table_rows
from csa2.mesh import HostShards, Rules
from csa2.model import abstract_params
from csa2.sharding import param_shardings

CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
_FLOATS = ("F64", "F32", "F16", "BF16")


@dataclasses.dataclass(frozen=True)
class Summary:
    """What a load or save did: tensors, bytes read or written, skipped names, wall time and, for a load,
    the peak host memory above the parameters (bounded by a few copies of the largest tensor)."""

    tensors: int
    bytes: int
    skipped: tuple[str, ...]
    seconds: float
    transient_bytes: int  # peak host memory (traced allocations, numpy included) above the parameters, while reading
    param_bytes: int  # bytes of the parameters built or written
    largest_tensor_bytes: int  # float32 bytes of the largest released tensor

    def format(self, verb: str) -> str:
        mb = 1 << 20
        line = (f"{verb} {self.tensors} tensors, {self.bytes / mb:.1f} MiB in {self.seconds:.1f} s; "
                f"parameters {self.param_bytes / mb:.1f} MiB")
        if self.largest_tensor_bytes:
            line += (f"; peak host memory above them {self.transient_bytes / mb:.2f} MiB "
                     f"(largest tensor, float32: {self.largest_tensor_bytes / mb:.2f} MiB)")
        return line + (f"; skipped {len(self.skipped)} (vision)" if self.skipped else "")


def _dtype(dtype: Any) -> np.dtype:
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: parameters are float32 or bfloat16; pass one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def read_config(path: str | os.PathLike, cfg: ModelConfig | None = None) -> ModelConfig:
    """The model config of the checkpoint at `path`; `cfg`, if given, must agree on every released field."""
    file = Path(path) / CONFIG
    if not file.exists():
        raise ValueError(f"{path}: no {CONFIG}; a released checkpoint directory holds config.json beside its shards")
    d = json.loads(file.read_text())
    text = d.get("text_config", d)
    framework = {} if cfg is None else {k: getattr(cfg, k) for k in fields_of(VARIANT, RUNTIME)}
    stored = from_hf_config(text, **framework)
    if cfg is not None and model_differences(cfg, stored):
        diffs = ", ".join(f"{k}: config.json {getattr(stored, k)!r} vs cfg {getattr(cfg, k)!r}"
                          for k in model_differences(cfg, stored))
        raise ValueError(f"{file} does not describe cfg ({diffs}); load with cfg=None to take the checkpoint's config")
    rows = text.get("engram_num_embeddings")
    if rows is not None:
        want = [engram_table_rows(stored, layer) for layer in stored.engram_layer_ids]
        if list(rows) != want:
            raise ValueError(f"{file}: engram_num_embeddings={list(rows)}, but the prime layout of SPEC §10b gives "
                             f"{want} for this config (engram_vocab_size, engram_n_heads, engram_max_ngram_size, "
                             "engram_layer_ids)")
    return cfg if cfg is not None else stored


def hf_config(cfg: ModelConfig, quantized: bool) -> dict:
    """The `config.json` that `save_hf` writes (a composite with `text_config`, like the release)."""
    text = to_hf_config(cfg)
    text["engram_num_embeddings"] = [engram_table_rows(cfg, layer) for layer in cfg.engram_layer_ids]
    out: dict[str, Any] = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
                           "text_config": text}
    if quantized:
        out["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "weight_block_size": [weights.TILE, weights.TILE], "scale_fmt": "ue8m0",
                                      "expert_dtype": "fp4"}
    return out


def _check_names(store: shards_lib.Shards, table: tuple[Tensor, ...]) -> tuple[str, ...]:
    """Refuse unknown and missing tensors; return the skipped names."""
    expected = {t.name for t in table}
    scales = {released.scale_of(t.name): t.name for t in table if released.scale_of(t.name)}
    skipped, unknown = [], []
    for name in store.names():
        if name in expected:
            continue
        if name in scales:
            if scales[name] not in store:
                raise ValueError(f"tensor {name!r} is a scale without its payload {scales[name]!r}")
            continue
        (skipped if released.skip_reason(name) else unknown).append(name)
    if unknown:
        raise ValueError(f"the checkpoint has {len(unknown)} tensor(s) this config has no parameter for, e.g. "
                         f"{unknown[:4]}; a config/weights mismatch (check num_hidden_layers, the layer roles, "
                         "n_routed_experts, num_nextn_predict_layers)")
    missing = [t.name for t in table if t.name not in store]
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s) the config needs, e.g. {missing[:4]}")
    return tuple(skipped)


def _decoded(store: shards_lib.Shards, t: Tensor) -> np.ndarray:
    """float32 logical value of released tensor `t`, in whatever format the files hold it."""
    stored, scale_name = store.dtype(t.name), released.scale_of(t.name)
    if scale_name is not None and scale_name in store:
        payload, scale = store.read(t.name), store.read(scale_name)
        if stored == "I8" or stored == "U8":
            fmt = weights.FP4
        elif stored == "F8_E4M3":  # one scale per row (Engram tables) or per 32×32 tile (projections)
            fmt = weights.FP8_ROWS if scale.shape[:1] == payload.shape[:1] else weights.FP8_BLOCK
        else:
            raise ValueError(f"tensor {t.name!r}: payload dtype {stored} beside a scale; quantized weights are "
                             "F8_E4M3 (FP8) or I8 (packed FP4)")
        return weights.decode(fmt, payload, scale, t.name)
    if stored not in _FLOATS:
        raise ValueError(f"tensor {t.name!r}: dtype {stored} without a {scale_name!r}; a quantized weight needs its "
                         "scale")
    return np.asarray(store.read(t.name), np.float32)


def _progress(items, what: str, show: bool):
    if not show:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=what, unit="tensor")


def _leaves(cfg: ModelConfig, dtype: np.dtype, shardings: dict | None) -> dict:
    """Empty host leaves of every parameter with a released tensor, in the pure-dict structure of
    `init_params(cfg)` (the compressed Engram vocabulary, which the release does not store, left out):
    whole arrays, or with `shardings` the buffers of this process's shards (`csa2.mesh.HostShards`)."""
    tree = nnx.to_pure_dict(abstract_params(cfg))
    tree.pop(engram_vocab.PARAM, None)

    def leaf(path, a):
        kind = dtype if np.issubdtype(a.dtype, np.floating) else a.dtype
        if shardings is None:
            return np.empty(a.shape, kind)
        return HostShards(a.shape, kind, _leaf(shardings, tuple(k.key for k in path)))

    return jax.tree_util.tree_map_with_path(leaf, tree)


def _vocab_table(path: Path, cfg: ModelConfig, table: np.ndarray | None) -> np.ndarray:
    """The compressed Engram vocabulary: `table` as given, else built from the checkpoint's tokenizer.json."""
    if table is not None:
        return engram_vocab.check_table(cfg, table)
    file = path / TOKENIZER
    if not file.exists():
        raise ValueError(f"{path}: the Engram hash needs the compressed vocabulary (engram_compressed_vocab_size="
                         f"{cfg.engram_compressed_vocab_size} < vocab_size={cfg.vocab_size}), which the release "
                         f"derives from its tokenizer; put the checkpoint's {TOKENIZER} beside config.json or pass "
                         "engram_table=csa2.engram_vocab.from_tokenizer(...)")
    return engram_vocab.from_tokenizer(file, cfg)


def _leaf(tree: dict, path: tuple) -> np.ndarray:
    for key in path:
        tree = tree[key]
    return tree


def _packed_table(cfg: ModelConfig, t: Tensor) -> bool:
    """Whether `t` is an Engram table the model keeps packed (`engram_table_format="fp8"`)."""
    return cfg.engram_table_format == "fp8" and t.path[0] == "engram" and t.path[-1] == "table"


def _table_bits(store: shards_lib.Shards, t: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 payload bits, UE8M0 scale bits) of an Engram table: the stored bytes as they are when the file
    holds FP8 rows, else its decoded values encoded so."""
    scale_name = t.scale_name
    if (store.dtype(t.name) == "F8_E4M3" and scale_name in store
            and store.shape(scale_name) == weights.FP8_ROWS.scale_shape(t.shape)):
        return np.asarray(store.read(t.name)).view(np.uint8), np.asarray(store.read(scale_name)).view(np.uint8)
    payload, scale = weights.encode(weights.FP8_ROWS, _decoded(store, t))
    return payload.view(np.uint8), scale.view(np.uint8)


def read_hf(path: str | os.PathLike, cfg: ModelConfig | None = None, *, dtype: Any = "float32",
            engram_table: np.ndarray | None = None, mesh: Mesh | None = None, rules: Rules | None = None,
            progress: bool = False) -> tuple[ModelConfig, dict, Summary]:
    """`(cfg, parameters as a pure dict, Summary)` of the released checkpoint at `path`: numpy leaves, or with
    a `mesh` (and its `rules`, `csa2.mesh`) `HostShards` holding only this process's shards of each.

    A model whose Engram hashes compressed ids (`csa2.engram_vocab.has_table`) gets its table from
    `engram_table` or, by default, from the checkpoint's `tokenizer.json`."""
    target = _dtype(dtype)
    start = time.perf_counter()
    cfg = read_config(path, cfg)
    if (mesh is None) != (rules is None):
        raise ValueError("mesh and rules go together: pass both (rules=csa2.mesh.rules_for(preset)) or neither")
    shardings = None if mesh is None else param_shardings(cfg, mesh, rules)
    vocab = _vocab_table(Path(path), cfg, engram_table) if engram_vocab.has_table(cfg) else None
    store = shards_lib.Shards(path)
    table = released.tensors(cfg)
    skipped = _check_names(store, table)
    tree = _leaves(cfg, target, shardings)
    filled = {id(leaf): 0 for leaf in jax.tree.leaves(tree)}
    largest = 0
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        for t in _progress(table, f"load {Path(path).name}", progress):
            packed = store.dtype(t.name) in ("I8", "U8")
            want = weights.FP4.stored_shape(t.shape) if packed and len(t.shape) == 2 else t.shape
            if store.shape(t.name) != want:
                raise ValueError(f"tensor {t.name!r}: stored shape {store.shape(t.name)} ({store.dtype(t.name)}); "
                                 f"the config expects {want} (logical {t.shape})")
            leaf = _leaf(tree, t.path)
            if _packed_table(cfg, t):
                scale_leaf = _leaf(tree, t.path[:-1] + ("table_scale",))
                leaf[t.index], scale_leaf[t.index] = _table_bits(store, t)
                filled[id(leaf)] += int(np.prod(t.shape))
                filled[id(scale_leaf)] += int(np.prod(scale_leaf.shape[len(t.index):]))  # one slot of it
                continue
            value = _decoded(store, t)
            largest = max(largest, value.nbytes)
            leaf[t.index] = released.to_param(t, value)
            filled[id(leaf)] += value.size
            del value
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        if not tracing:
            tracemalloc.stop()
    for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if filled[id(leaf)] != leaf.size:
            raise ValueError(f"parameter {jax.tree_util.keystr(p)} got {filled[id(leaf)]} of its {leaf.size} values "
                             "from the checkpoint; the name map does not cover it")
    if vocab is not None:
        if shardings is not None:
            placed, vocab = vocab, HostShards(vocab.shape, vocab.dtype, shardings[engram_vocab.PARAM])
            vocab[()] = placed
        tree[engram_vocab.PARAM] = vocab
    param_bytes = tree_bytes(tree)
    return cfg, tree, Summary(len(table), store.bytes_read, skipped, time.perf_counter() - start, peak, param_bytes,
                              largest)


def load_hf(path: str | os.PathLike, cfg: ModelConfig | None = None, *, dtype: Any = "float32",
            engram_table: np.ndarray | None = None, mesh: Mesh | None = None, rules: Rules | None = None,
            progress: bool = False) -> tuple[ModelConfig, nnx.State]:
    """`(cfg, params)`: the released checkpoint at `path` as the `nnx.State` of `model.init_params(cfg)`,
    every weight in `dtype` (float32, the framework's parameter dtype, or bfloat16); with a `mesh`, each
    tensor goes straight into the host buffers of its shards and each parameter is assembled sharded by
    `rules` (`csa2.sharding`). See `read_hf`."""
    cfg, tree, _ = read_hf(path, cfg, dtype=dtype, engram_table=engram_table, mesh=mesh, rules=rules, progress=progress)
    return cfg, as_params(cfg, tree)


def as_params(cfg: ModelConfig, tree: dict) -> nnx.State:
    """The `nnx.State` of `init_params(cfg)` holding the host leaves of `tree` (consumed: each leaf is
    replaced by its device array as it goes, so the host copy can be freed leaf by leaf)."""
    def put(node: dict) -> dict:
        for key, value in node.items():
            if isinstance(value, dict):
                node[key] = put(value)
            else:
                node[key] = value.array() if isinstance(value, HostShards) else jax.device_put(value)
        return node

    params = abstract_params(cfg)
    nnx.replace_by_pure_dict(params, put(tree))
    return params


def _released_tensors(cfg: ModelConfig, tree: dict, dtype: np.dtype, quantize: bool,
                      progress: bool) -> Iterator[tuple[str, np.ndarray]]:
    table = released.tensors(cfg)
    for t in _progress(table, "save", progress):
        stored = _leaf(tree, t.path)[t.index]
        if _packed_table(cfg, t):
            scale = _leaf(tree, t.path[:-1] + ("table_scale",))[t.index]
            if quantize:  # the bits as they are
                yield t.name, stored.view(ml_dtypes.float8_e4m3fn)
                yield t.scale_name, scale.view(ml_dtypes.float8_e8m0fnu)
                continue
            stored = weights.decode(weights.FP8_ROWS, stored.view(ml_dtypes.float8_e4m3fn), scale)
        x = released.from_param(t, np.asarray(stored, np.float32))
        if quantize and t.fmt is not None:
            payload, scale = weights.encode(t.fmt, x)
            yield t.name, payload
            yield t.scale_name, scale
        elif quantize:
            yield t.name, x.astype(shards_lib.DTYPES[t.dtype])
        else:
            yield t.name, x.astype(dtype)


def save_hf(params: nnx.State, cfg: ModelConfig, path: str | os.PathLike, *, dtype: Any = "float32",
            formats: str = "float", max_shard_bytes: int = 4 << 30, progress: bool = False) -> Summary:
    """Write `params` in the released layout under `path` (created; existing shards of the same names replaced).

    `formats="float"`: every tensor in `dtype` (float32 round-trips bit for bit); `formats="released"`:
    the release's storage (FP8 blocks, FP4 experts, FP8 Engram rows with UE8M0 scales; BF16/F32 floats).
    The compressed Engram vocabulary is not written (the release derives it from its tokenizer: keep the
    tokenizer files beside the shards, or pass the table to `load_hf`).
    """
    if formats not in ("float", "released"):
        raise ValueError(f"formats={formats!r}: use 'float' (plain float tensors) or 'released' (FP8/FP4 as released)")
    target = _dtype(dtype)
    start = time.perf_counter()
    tree = jax.tree.map(np.asarray, nnx.to_pure_dict(params))  # host views: slicing them costs no dispatch
    want = jax.tree.map(lambda a: a.shape, nnx.to_pure_dict(abstract_params(cfg)))
    got = jax.tree.map(lambda a: a.shape, tree)
    if want != got:
        raise ValueError("params do not have the parameter structure of cfg (model.init_params(cfg)); "
                         "pass the config the parameters were built with")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG).write_text(json.dumps(hf_config(cfg, formats == "released"), indent=1))
    weight_map = shards_lib.write_shards(path, _released_tensors(cfg, tree, target, formats == "released", progress),
                                         max_shard_bytes=max_shard_bytes)
    written = sum(os.path.getsize(path / f) for f in set(weight_map.values()))
    return Summary(len(weight_map), written, (), time.perf_counter() - start, 0,
                   tree_bytes(tree), 0)


def dry_run(cfg: ModelConfig) -> list[str]:
    """One line per released tensor of `cfg`: name, stored dtype and shape, and the parameter it becomes."""
    lines = []
    for t in released.tensors(cfg):
        where = "/".join(map(str, t.path)) + (str(list(t.index)) if t.index else "")
        stored = f"{t.dtype} {list(t.fmt.stored_shape(t.shape)) if t.fmt else list(t.shape)}"
        scale = f" + {t.scale_name} F8_E8M0 {list(t.fmt.scale_shape(t.shape))}" if t.fmt else ""
        lines.append(f"{t.name}  {stored}{scale}  → {where} ({t.layout})")
    return lines
