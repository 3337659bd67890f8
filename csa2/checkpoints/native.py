"""Checkpoints: params, optimizer state, data position, RNG and the model config, saved with orbax.

Training writes them and inference reads them, so they live here, below both. A checkpoint has a
`kind` (`KINDS`): a `BACKBONE` holds the whole model (`python -m train`), a `DRAFTER_KIND` the DSpark
drafter alone (`python -m train.dspark` adapts it on a frozen backbone, SPEC §12); one `save`, one
`restore` (resuming training) and one `restore_params` (inference) serve both, and a directory holds
one kind. One step directory holds three orbax items: `params` (the `nnx.State` of
`model.init_params`, or its `drafter` subtree) and `train` = {opt_state, rng} (array pytrees,
`StandardSave`; `train` is never empty, even for a stateless optimizer; a drafter may be saved without
`opt_state`) and `meta` (JSON: the `ModelConfig` as `dataclasses.asdict`, the parameter layout version,
step, data step and the caller's `extra`; a drafter's also `"kind": "drafter"` and `has_opt_state`,
while a backbone's names no kind, as before drafters existed). Restoring reads `meta` first, so a
checkpoint of another kind, whose config (RELEASED and VARIANT fields) differs from the requested one,
or whose parameters follow another layout, is refused by name before any array is read (DESIGN §7).
`with_drafter` puts a drafter into full params.

Parameter layout 3 (`LAYOUT`): `{"embed", "groups", "engram", "norm", "head"}`, where `groups[g][r]` is run r
of `layout.layer_groups(cfg)[g]`, every leaf stacked `[iterations, layers of the run, ...]`, `engram[k]` the
n-gram memory of the k-th Engram layer, and each variable stored under its attribute name
(`groups.2.0.attn.wq_a.value`). A backbone saved in layout 2 (Engram inside its layer, `csa2.relayout`) is read
for inference by `restore_params`, moved to layout 3 with its values unchanged; resuming its training is refused
(its optimizer state is laid out as its parameters were). A drafter's parameters are the same in both. Layout 1
(one stacked pytree per run of identical layers, `layers.i.…`) is refused with that message. Arrays come back
bit-identical in the structure of the caller's `*_like` pytrees (optax states are NamedTuples); a dtype or shape
that differs from the saved one is refused, never cast, padded or truncated. Saves are synchronous: when `save`
returns, the step is on disk.

Damage is refused, never restored. `meta` holds a SHA-256 of every array leaf (`digests`, written by saves whose
arrays are all addressable from this process, i.e. every single-process save); a restore checks each leaf it reads
against it, so a flipped byte names its tensor instead of loading silently. A file that is missing, truncated or
unreadable, or an item or metadata that cannot be parsed, is refused as one ValueError naming the checkpoint, the
step and the item, with the steps that remain. Orbax writes a step into a temporary directory and renames it
when complete, so a save killed halfway leaves the earlier steps as they were; restoring the latest step then
skips the unfinished one and warns that it did.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from csa2 import relayout
from csa2.config import ModelConfig, YarnScaling, model_differences
from csa2.layout import LAYOUT, LAYOUTS
from csa2.model import DRAFTER, abstract_params

_TRAIN_FIRST = "train first with python -m train --out DIR, or pass the directory a run wrote"


def _manager(directory, keep: int | None = None, create: bool = False) -> ocp.CheckpointManager:
    """A synchronous orbax manager over `directory`, keeping the newest `keep` steps (all when None)."""
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create, enable_async_checkpointing=False)
    handlers = {"params": ocp.StandardCheckpointHandler(), "train": ocp.StandardCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(os.path.abspath(directory), options=options, item_handlers=handlers)


def _config_to_json(cfg: ModelConfig) -> dict:
    """`dataclasses.asdict(cfg)` with tuples as lists."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def _config_from_json(d: dict, directory) -> ModelConfig:
    """Rebuild (and validate) a stored config; unknown fields are refused by name."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"checkpoint {directory}: stored config has fields {unknown} that this csa2 does not know; "
                         "restore with the csa2 version that wrote it")
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
    if isinstance(fields.get("rope_scaling"), dict):
        fields["rope_scaling"] = YarnScaling(**fields["rope_scaling"])
    return ModelConfig(**fields)


def _check_config(stored: ModelConfig, requested: ModelConfig, directory, step: int) -> None:
    """Raise ValueError naming every field where the checkpoint's config differs from the requested one."""
    diffs = [f"{name} {getattr(stored, name)!r} (checkpoint) vs {getattr(requested, name)!r} (requested)"
             for name in model_differences(stored, requested)]
    if diffs:
        raise ValueError(f"checkpoint {directory} step {step}: checkpoint config differs: " + ", ".join(diffs)
                         + "; restore with the checkpoint's config (csa2.checkpoints.native.load_config) or train a "
                         "new run")


def _to_json(x: Any) -> Any:
    """JSON fallback for `extra`: numpy/jax arrays and scalars become (nested) Python lists/scalars."""
    if hasattr(x, "tolist"):
        return x.tolist()
    raise TypeError(f"{type(x).__name__} is not JSON-serializable")


def _abstract(tree):
    """Restore target: each leaf's shape, dtype and sharding (one device when the leaf has none)."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def leaf(x):
        sharding = getattr(x, "sharding", None)
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding if sharding is not None else device)

    return jax.tree_util.tree_map(leaf, tree)


def _leaves(tree) -> dict:
    """{orbax param name: "dtype[shape]"} of a pytree of arrays or array metadata."""
    return {".".join(ocp.tree.str_keypath(path)): f"{np.dtype(x.dtype)}{list(x.shape)}"
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _digests(tree) -> dict | None:
    """{orbax param name: SHA-256 of the leaf's bytes} of an array pytree; None unless every leaf is addressable
    from this process (a multi-process save writes none)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    if not all(getattr(x, "is_fully_addressable", True) for _, x in leaves):
        return None
    return {".".join(ocp.tree.str_keypath(path)): hashlib.sha256(np.ascontiguousarray(np.asarray(x)).tobytes())
            .hexdigest() for path, x in leaves}


def _damaged(directory, step: int, what: str, err: Exception, mngr: ocp.CheckpointManager) -> ValueError:
    """The error for a step whose files cannot be read or do not match their digests."""
    others = [s for s in sorted(mngr.all_steps()) if s != step]
    while err.__cause__ is not None:  # TensorStore's own message (e.g. OUT_OF_RANGE) is the innermost cause
        err = err.__cause__
    reason = str(err).strip().splitlines()[0].split(". See full TensorStore details")[0][:300] or type(err).__name__
    fix = (f"restore another step (available: {others})" if others else "no other step remains") + \
        ", or save it again from the run that wrote it"
    return ValueError(f"checkpoint {directory} step {step}: {what} is damaged or incomplete ({reason}); {fix}")


def _restore_arrays(mngr: ocp.CheckpointManager, directory, step: int, likes: dict, digests: dict) -> dict:
    """Restore the array items `likes` ({item: like pytree}) of `step`; any leaf, dtype or shape change is refused,
    and so is a leaf whose bytes differ from its digest in `digests` ({item: {name: sha256}}, empty for a
    checkpoint written without them)."""
    try:
        metadata = mngr.item_metadata(step)
        trees = {item: metadata[item].tree for item in likes}
    except Exception as err:  # orbax and TensorStore raise many types for unreadable files
        raise _damaged(directory, step, f"the metadata of {sorted(likes)}", err, mngr) from err
    for item, like in likes.items():
        stored, wanted = _leaves(trees[item]), _leaves(like)
        diffs = [f"{item}.{name} {stored.get(name, 'absent')} (checkpoint) vs {wanted.get(name, 'absent')} (requested)"
                 for name in sorted(stored.keys() | wanted.keys()) if stored.get(name) != wanted.get(name)]
        if diffs:
            more = f" and {len(diffs) - 5} more" if len(diffs) > 5 else ""
            raise ValueError(f"checkpoint {directory} step {step}: the requested pytrees differ from the saved arrays: "
                             + ", ".join(diffs[:5]) + more + "; build them from the run's config and optimizer")
    try:
        restored = mngr.restore(step, args=ocp.args.Composite(
            **{item: ocp.args.StandardRestore(_abstract(like)) for item, like in likes.items()}))
    except Exception as err:
        raise _damaged(directory, step, f"an array file of {sorted(likes)}", err, mngr) from err
    for item in likes:
        want = (digests or {}).get(item) or {}
        got = _digests(restored[item]) or {}
        bad = [name for name, digest in got.items() if name in want and want[name] != digest]
        if bad:
            more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
            raise _damaged(directory, step, f"{item}", ValueError(
                f"the bytes of {', '.join(bad[:5])}{more} differ from the SHA-256 saved with them"), mngr)
    # Orbax returns arrays committed to a device; fresh uncommitted copies keep jit cache keys equal
    # to a run that never stopped, so a resumed loop does not recompile its step.
    return {item: jax.tree_util.tree_map(lambda x: jnp.asarray(np.asarray(x)), restored[item]) for item in likes}


def _resolve_step(mngr: ocp.CheckpointManager, directory, step: int | None) -> int:
    """`step`, or the latest one; ValueError naming the directory when there is none."""
    steps = sorted(mngr.all_steps())
    unfinished = sorted(n for n in os.listdir(directory) if ".orbax-checkpoint-tmp" in n)
    if not steps:
        left = f" (only the unfinished save {unfinished})" if unfinished else ""
        raise ValueError(f"checkpoint directory {directory} holds no checkpoints{left}; {_TRAIN_FIRST}")
    if step is None:
        if unfinished:
            warnings.warn(f"checkpoint {directory}: ignoring the unfinished save {unfinished} (a save that was "
                          f"killed); restoring step {steps[-1]}, the latest complete one", stacklevel=3)
        return steps[-1]
    if step not in steps:
        raise ValueError(f"checkpoint {directory} has no step {step}; available steps: {steps}")
    return step


def _require_dir(directory) -> None:
    """ValueError naming `directory` and the fix when it does not exist."""
    if not os.path.isdir(directory):
        raise ValueError(f"checkpoint directory {directory} does not exist; {_TRAIN_FIRST}")


def _meta(mngr: ocp.CheckpointManager, step: int) -> dict:
    """The JSON metadata item of `step`; a checkpoint of another parameter layout is refused."""
    try:
        meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
            raise ValueError("it is not a JSON object with a config")
    except Exception as err:
        raise _damaged(mngr.directory, step, "the metadata item (meta)", err, mngr) from err
    layout = meta.get("layout", 1)
    if layout not in LAYOUTS:
        raise ValueError(f"checkpoint {mngr.directory} step {step}: parameters in layout {layout}, this csa2 reads "
                         f"layouts {LAYOUTS} (nnx modules stacked by layer group, see csa2.checkpoints.native); "
                         "restore it with the csa2 version that wrote it, or train again")
    return meta


def latest_step(directory) -> int | None:
    """The newest saved step in `directory`, or None when there is none (or no directory)."""
    if not os.path.isdir(directory):
        return None
    with _manager(directory) as mngr:
        return mngr.latest_step()


def saved_steps(directory) -> list[int]:
    """Every saved step in `directory`, oldest first (empty when there is none, or no directory)."""
    if not os.path.isdir(directory):
        return []
    with _manager(directory) as mngr:
        return sorted(mngr.all_steps())


BACKBONE = "backbone"  # the whole model's params (python -m train)
DRAFTER_KIND = "drafter"  # the DSpark drafter's subtree alone (python -m train.dspark)
KINDS = (BACKBONE, DRAFTER_KIND)
_HOLDS = {BACKBONE: "full-model parameters", DRAFTER_KIND: "a DSpark drafter"}
_FIX = {BACKBONE: "keep backbones in a directory of their own (python -m train --out DIR) and load drafters with "
                  f"restore_params(..., kind={DRAFTER_KIND!r})",
        DRAFTER_KIND: "keep drafters in a directory of their own (python -m train.dspark --out DIR) and load full "
                      "models with restore_params"}


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: a checkpoint holds one of {KINDS}; pass one of them")


def _open(mngr: ocp.CheckpointManager, directory, step: int | None, kind: str,
          cfg: ModelConfig | None) -> tuple[int, dict, ModelConfig]:
    """(step, meta, stored config) of `step` (latest when None); refused unless it holds `kind` and, given `cfg`,
    its config matches `cfg`."""
    step = _resolve_step(mngr, directory, step)
    meta = _meta(mngr, step)
    held = meta.get("kind", BACKBONE)  # a backbone's meta names no kind
    if held != kind:
        raise ValueError(f"checkpoint {directory} step {step} holds {_HOLDS.get(held, repr(held))}, not "
                         f"{_HOLDS[kind]}; {_FIX[kind]}")
    stored = _config_from_json(meta["config"], directory)
    if cfg is not None:
        _check_config(stored, cfg, directory, step)
    return step, meta, stored


def _params_like(cfg: ModelConfig, kind: str):
    """The `params` of a `kind` checkpoint of `cfg` (shapes only); ValueError for a drafter of a config without one."""
    if kind == BACKBONE:
        return abstract_params(cfg)
    if not cfg.num_nextn_predict_layers:
        raise ValueError("ModelConfig.num_nextn_predict_layers=0: this config has no DSpark drafter to save or "
                         "restore; use a config with num_nextn_predict_layers ≥ 1 (every preset has one)")
    return _abstract_drafter(cfg)


@functools.lru_cache(maxsize=8)
def _abstract_drafter(cfg: ModelConfig):
    return abstract_params(cfg)[DRAFTER]


def _check_leaves(got, want, what: str, fix: str) -> None:
    """ValueError naming the (first five) leaves whose presence, dtype or shape differ."""
    got, want = _leaves(got), _leaves(want)
    diffs = [f"{name} {got.get(name, 'absent')} (given) vs {want.get(name, 'absent')} (expected)"
             for name in sorted(got.keys() | want.keys()) if got.get(name) != want.get(name)]
    if diffs:
        more = f" and {len(diffs) - 5} more" if len(diffs) > 5 else ""
        raise ValueError(f"{what}: " + ", ".join(diffs[:5]) + more + f"; {fix}")


def save(directory, step: int, *, params, cfg: ModelConfig, kind: str = BACKBONE, opt_state=None, rng=None,
         data_step: int | None = None, extra: dict | None = None, keep: int = 3) -> None:
    """Save one step of a `kind` checkpoint synchronously, keeping the newest `keep` steps; an existing `step` is
    replaced. `params`: the model's (a backbone) or `params["drafter"]` of the model built from `cfg` (a drafter,
    checked). `opt_state` and `rng` resume training: a backbone always holds an `opt_state`, a drafter may not;
    `rng` defaults to zeros and `data_step` to `step`. `extra` is JSON (arrays become lists). A directory holding
    checkpoints of another kind or another config is refused."""
    _check_kind(kind)
    step = int(step)
    if keep < 1:
        raise ValueError(f"save: keep={keep!r}; keep at least the newest checkpoint (keep ≥ 1)")
    if kind == BACKBONE and opt_state is None:
        raise ValueError("save: opt_state=None; a backbone checkpoint holds its optimizer state (pass "
                         "optax.EmptyState() when there is none)")
    if kind == DRAFTER_KIND:
        _check_leaves(params, _params_like(cfg, kind), "save: params is not this config's drafter",
                      "pass params['drafter'] of the model built from cfg")
    try:
        extra_json = json.loads(json.dumps(extra or {}, default=_to_json))
    except (TypeError, ValueError) as e:
        raise ValueError(f"save: extra must be JSON-serializable ({e}); pass numbers, strings, lists and dicts") from e
    train = {"rng": jnp.zeros((2,), jnp.uint32) if rng is None else rng}
    if opt_state is not None:
        train["opt_state"] = opt_state
    with _manager(directory, keep=keep, create=True) as mngr:
        if mngr.latest_step() is not None:
            _open(mngr, directory, None, kind, cfg)
        if step in mngr.all_steps():
            mngr.delete(step)
        drafter = kind == DRAFTER_KIND  # only a drafter's meta names its kind and whether it has optimizer state
        digests = {"params": _digests(params), "train": _digests(train)}
        meta = {"config": _config_to_json(cfg), "layout": LAYOUT, **({"kind": kind} if drafter else {}), "step": step,
                "data_step": step if data_step is None else int(data_step),
                **({"has_opt_state": opt_state is not None} if drafter else {}), "extra": extra_json,
                **({"digests": digests} if None not in digests.values() else {})}
        mngr.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                                train=ocp.args.StandardSave(train), meta=ocp.args.JsonSave(meta)))
        mngr.wait_until_finished()


def restore(directory, cfg: ModelConfig, *, params_like, opt_state_like, kind: str = BACKBONE,
            step: int | None = None) -> dict:
    """Resume training from the `kind` checkpoint at `step` (latest when None): {"step", "params", "opt_state",
    "data_step", "rng", "extra"}; the checkpoint must hold an optimizer state."""
    _check_kind(kind)
    _require_dir(directory)
    with _manager(directory) as mngr:
        step, meta, _ = _open(mngr, directory, step, kind, cfg)
        if kind == BACKBONE and meta.get("layout") != LAYOUT:
            raise ValueError(f"checkpoint {directory} step {step}: a backbone in parameter layout "
                             f"{meta.get('layout')}, whose optimizer state follows that layout; this csa2 trains in "
                             f"layout {LAYOUT}. Read its parameters with restore_params and start a new run from them")
        if not meta.get("has_opt_state", True):
            raise ValueError(f"checkpoint {directory} step {step}: the {kind} was saved without optimizer state, so "
                             "its training cannot resume; start a new run or use restore_params")
        try:
            rng = mngr.item_metadata(step)["train"].tree["rng"]
        except Exception as err:
            raise _damaged(directory, step, "the metadata of ['train']", err, mngr) from err
        out = _restore_arrays(mngr, directory, step, {
            "params": params_like,
            "train": {"opt_state": opt_state_like, "rng": jax.ShapeDtypeStruct(rng.shape, rng.dtype)}},
            meta.get("digests"))
    return {"step": step, "params": out["params"], "opt_state": out["train"]["opt_state"],
            "data_step": meta["data_step"], "rng": out["train"]["rng"], "extra": meta["extra"]}


def load_config(directory, step: int | None = None) -> ModelConfig:
    """The config stored with `step` (latest when None), rebuilt and validated."""
    _require_dir(directory)
    with _manager(directory) as mngr:
        return _config_from_json(_meta(mngr, _resolve_step(mngr, directory, step))["config"], directory)


def restore_params(directory, cfg: ModelConfig | None = None, step: int | None = None, *,
                   kind: str = BACKBONE) -> tuple[ModelConfig, Any]:
    """(config, params) of the `kind` checkpoint at `step` (latest when None) for inference, bit-identical: the
    model's params, or the drafter's `nnx.State` (put it into full params with `with_drafter`). `cfg` defaults to
    the stored config; a given one must match it (ValueError naming every differing field)."""
    _check_kind(kind)
    _require_dir(directory)
    like = None if cfg is None else _params_like(cfg, kind)  # a config without a drafter is refused before any read
    with _manager(directory) as mngr:
        step, meta, stored = _open(mngr, directory, step, kind, cfg)
        cfg = stored if cfg is None else cfg
        like = _params_like(cfg, kind) if like is None else like
        older = kind == BACKBONE and meta["layout"] != LAYOUT
        saved = abstract_params(cfg, layout=meta["layout"]) if older else like
        params = _restore_arrays(mngr, directory, step, {"params": saved}, meta.get("digests"))["params"]
    return cfg, relayout.from_layout2(cfg, params, like) if older else params


def check_dir(directory, cfg: ModelConfig, kind: str) -> None:
    """Before a run writes `kind` checkpoints of `cfg` to `directory`: ValueError if its newest checkpoint is of
    another kind or another config (nothing is read when the directory holds none)."""
    _check_kind(kind)
    if latest_step(directory) is None:
        return
    with _manager(directory) as mngr:
        _open(mngr, directory, None, kind, cfg)


# ---------------------------------------------------------------------------------------------
# DSpark drafters in full params (SPEC §12)

def _key_name(k) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _variables(tree) -> tuple[list, Any]:
    """([(path of names, variable)], treedef) with every `nnx.Variable` a leaf."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return [(tuple(_key_name(k) for k in path), v) for path, v in flat], treedef


DRAFTER_FIELDS = ("num_nextn_predict_layers",)  # the drafter's own shape: one backbone serves drafters of any


def with_drafter(params, drafter, cfg: ModelConfig | None = None):
    """Full model `params` (`nnx.State`) with the `drafter` subtree replaced by `drafter` (e.g. a drafter
    checkpoint's), in the pytree structure of `params`, so jitted inference sees the same arguments and does not
    retrace.

    With `cfg`, the result has `cfg`'s structure instead: `cfg` may differ from the config of `params` in
    `DRAFTER_FIELDS` (a drafter of three stages on a backbone trained with one). Every variable must match its
    place in path, variable type, dtype and shape (ValueError naming them)."""
    full, _ = _variables(params)
    like, treedef = _variables(params if cfg is None else abstract_params(cfg))
    new = dict(_variables(drafter)[0])
    if not any(path[0] == DRAFTER for path, _ in full):
        raise ValueError(f"with_drafter: params has no {DRAFTER!r} subtree; build params from a config with "
                         "num_nextn_predict_layers ≥ 1 (model.init_params or restore_params)")
    if not any(path[0] == DRAFTER for path, _ in like):
        raise ValueError("with_drafter: cfg has no drafter (num_nextn_predict_layers=0); pass the drafter's config")

    def sig(v) -> str:
        if v is None:
            return "absent"
        x = v.get_value()
        return f"{type(v).__name__} {np.dtype(x.dtype)}{list(np.shape(x))}"

    def differences(given: dict, wanted: dict, what: str) -> list[str]:
        return [f"{'.'.join(p)} {sig(given.get(p))} ({what}) vs {sig(wanted.get(p))} (expected)"
                for p in sorted(given.keys() | wanted.keys()) if sig(given.get(p)) != sig(wanted.get(p))]

    backbone = {path: v for path, v in full if path[0] != DRAFTER}
    diffs = (differences(new, {path[1:]: v for path, v in like if path[0] == DRAFTER}, "drafter")
             + differences(backbone, {path: v for path, v in like if path[0] != DRAFTER}, "params"))
    if diffs:
        more = f" and {len(diffs) - 5} more" if len(diffs) > 5 else ""
        raise ValueError("with_drafter: the drafter does not fit params: " + ", ".join(diffs[:5]) + more
                         + "; restore the drafter with the config of these params, or pass the drafter's config as cfg")
    leaves = [new[path[1:]] if path[0] == DRAFTER else backbone[path] for path, _ in like]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def restore_with_drafter(backbone_dir, drafter_dir, cfg: ModelConfig | None = None, *,
                         step: int | None = None, drafter_step: int | None = None) -> tuple[ModelConfig, Any]:
    """(config, params) for speculative inference: the backbone of `backbone_dir` (`python -m train`) with the
    adapted drafter of `drafter_dir` (`python -m train.dspark`). The config is the drafter's (default: the one
    stored with it); the backbone's may differ from it in `DRAFTER_FIELDS` only (its drafter stages are replaced)."""
    cfg = load_config(drafter_dir, drafter_step) if cfg is None else cfg
    stored = load_config(backbone_dir, step)
    others = [name for name in model_differences(stored, cfg) if name not in DRAFTER_FIELDS]
    if others:
        raise ValueError(f"restore_with_drafter: the backbone in {backbone_dir} and the drafter config differ in "
                         + ", ".join(f"{n} {getattr(stored, n)!r} vs {getattr(cfg, n)!r}" for n in others)
                         + f"; a drafter may change only {DRAFTER_FIELDS}: adapt it on this backbone "
                         "(python -m train.dspark --backbone ...)")
    _, params = restore_params(backbone_dir, cfg.replace(**{f: getattr(stored, f) for f in DRAFTER_FIELDS}), step)
    _, drafter = restore_params(drafter_dir, cfg, drafter_step, kind=DRAFTER_KIND)
    return cfg, with_drafter(params, drafter, cfg)
