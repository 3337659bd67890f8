"""`python -m csa2 convert`: released checkpoints to and from the framework's own, and a shapes-only dry run.

    python -m csa2 convert from-hf SRC OUT [--dtype float32|bfloat16]
        a released checkpoint (config.json + safetensors) → an orbax checkpoint at step 0 (`csa2.checkpoints.native`)
    python -m csa2 convert to-hf CHECKPOINT OUT [--step N] [--formats float|released] [--dtype float32|bfloat16]
        an orbax checkpoint → the released layout (float tensors, or the release's FP8/FP4 storage)
    python -m csa2 convert dry-run [--preset v41_flash | --config config.json] [--index model.safetensors.index.json]
        every released tensor name and the parameter it becomes; with an index, every name it lists is
        checked against the map (mapped, a scale of a mapped tensor, or skipped with a reason)

`from-hf` and `to-hf` show a progress bar and print a summary (tensors, bytes, peak host memory).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import optax

from csa2.checkpoints import hf, native, released
from csa2.checkpoints.config_json import from_hf_config
from csa2.presets import PRESETS, preset


def index_report(cfg, names: list[str]) -> tuple[list[str], list[str], list[str]]:
    """`(mapped, skipped with reason, unmapped)` lines for the tensor names of a released index."""
    table = {t.name: t for t in released.tensors(cfg)}
    scales = {t.scale_name: t for t in table.values() if t.fmt is not None}
    mapped, skipped, unmapped = [], [], []
    for name in names:
        t = table.get(name) or scales.get(name)
        why = released.skip_reason(name)
        if t is not None:
            mapped.append(f"{name} → {'/'.join(map(str, t.path))}{list(t.index) if t.index else ''}"
                          + (" (scale)" if name in scales else ""))
        elif why is not None:
            skipped.append(f"{name}: skipped, {why}")
        else:
            unmapped.append(name)
    missing = sorted(set(table) - set(names))
    unmapped.extend(f"{name} (expected by the config, absent from the index)" for name in missing)
    return mapped, skipped, unmapped


def _from_hf(args) -> None:
    cfg, tree, summary = hf.read_hf(args.src, dtype=args.dtype, progress=True)
    native.save(args.out, 0, params=hf.as_params(cfg, tree), opt_state=optax.EmptyState(), data_step=0,
                rng=jax.random.key_data(jax.random.key(0)), cfg=cfg, extra={"converted_from": str(args.src)})
    print(summary.format("read"))
    print(f"wrote an orbax checkpoint (step 0) to {args.out}")


def _to_hf(args) -> None:
    cfg, params = native.restore_params(args.checkpoint, step=args.step)
    summary = hf.save_hf(params, cfg, args.out, dtype=args.dtype, formats=args.formats, progress=True)
    print(summary.format("wrote"))


def _dry_run(args) -> None:
    cfg = from_hf_config(json.loads(Path(args.config).read_text())) if args.config else preset(args.preset)
    if args.index is None:
        print("\n".join(hf.dry_run(cfg)))
        print(f"{len(released.tensors(cfg))} released weights for this config; skipped name patterns: "
              + "; ".join(f"{p.pattern} ({why})" for p, why in released.SKIPPED))
        return
    names = sorted(json.loads(Path(args.index).read_text())["weight_map"])
    mapped, skipped, unmapped = index_report(cfg, names)
    print("\n".join(mapped + skipped))
    print(f"{len(names)} names in the index: {len(mapped)} mapped, {len(skipped)} skipped, {len(unmapped)} unmapped")
    if unmapped:
        raise ValueError(f"{len(unmapped)} released tensor name(s) have no parameter: {unmapped[:5]}")


def add_command(sub: argparse._SubParsersAction) -> None:
    """Register `convert` on the `python -m csa2` command line (`csa2.cli`)."""
    p = sub.add_parser("convert", help="convert released DeepSeek-V4.1 checkpoints to and from csa2's own")
    ways = p.add_subparsers(dest="way", required=True)
    a = ways.add_parser("from-hf", help="released config.json + safetensors → orbax checkpoint")
    a.add_argument("src")
    a.add_argument("out")
    a.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    a.set_defaults(run=_from_hf)
    b = ways.add_parser("to-hf", help="orbax checkpoint → released layout")
    b.add_argument("checkpoint", help="an orbax checkpoint directory (python -m train --out DIR)")
    b.add_argument("out")
    b.add_argument("--step", type=int, default=None)
    b.add_argument("--formats", default="float", choices=("float", "released"))
    b.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    b.set_defaults(run=_to_hf)
    c = ways.add_parser("dry-run", help="list the released tensor names and the parameter each becomes")
    c.add_argument("--preset", default="v41_flash", choices=PRESETS)
    c.add_argument("--config", default=None, help="a released config.json instead of a preset")
    c.add_argument("--index", default=None, help="a model.safetensors.index.json whose names to check")
    c.set_defaults(run=_dry_run)
