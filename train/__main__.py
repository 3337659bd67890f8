"""`python -m train --out DIR [--preset P] [--steps N] [--float | --qat-from K] [--resume]`: train on the embedded
corpus with the SPEC §8 numerics (fake-quant from step 0; `--float` is the float ablation, `--qat-from K` trains in
float then fine-tunes with QAT from step K). `python -m train --recipe longctx [--out DIR]`: the long-context
research checkpoint (`train.longctx`; CSA2_FAST=1 for its fast CI variant; `--float` trains it without QAT)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from csa2 import compile_cache, remat
from csa2.presets import PRESETS, preset
from train import longctx
from train.data import load_corpus
from train.loop import evaluate, train
from train.step import DTYPE_POLICIES, TrainConfig

RECIPES = ("longctx",)
_TRAIN_FIELDS = {"steps": "steps", "batch_size": "batch_size", "seq_len": "seq_len", "lr": "lr", "warmup": "warmup",
                 "index_loss_weight": "index_loss_weight", "dense_warmup": "dense_warmup_steps",
                 "replay_window": "replay_window", "seed": "seed", "qat_from": "qat_from", "remat": "remat",
                 "dtype_policy": "dtype_policy"}  # flag → TrainConfig field
# The only flags a --recipe run takes: the recipe fixes everything else.
_RECIPE_FLAGS = ("out", "quiet", "float", "compile_cache")


def parse(argv: list[str] | None) -> argparse.Namespace:
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="python -m train", description=__doc__)
    p.add_argument("--recipe", choices=RECIPES, default=None,
                   help="a named recipe with its own defaults (longctx: train.longctx.LongCtxRecipe)")
    p.add_argument("--preset", default=None, help=f"one of {PRESETS} (default tiny)")
    p.add_argument("--steps", type=int, default=None, help=f"(default {d.steps})")
    p.add_argument("--out", default=None, help="checkpoint directory (a --recipe run has its own default)")
    p.add_argument("--resume", action="store_true", default=None, help="continue from the latest checkpoint in --out")
    p.add_argument("--float", action="store_true", default=None,
                   help="ablation: train and evaluate without the SPEC §8 fake-quant (default: QAT from step 0)")
    p.add_argument("--qat-from", type=int, default=None, help="train in float, then with QAT from this step on")
    p.add_argument("--batch-size", type=int, default=None, help=f"(default {d.batch_size})")
    p.add_argument("--seq-len", type=int, default=None, help=f"(default {d.seq_len})")
    p.add_argument("--lr", type=float, default=None, help=f"(default {d.lr})")
    p.add_argument("--warmup", type=int, default=None, help=f"(default {d.warmup})")
    p.add_argument("--index-loss-weight", type=float, default=None, help=f"(default {d.index_loss_weight})")
    p.add_argument("--dense-warmup", type=int, default=None, help="steps of dense indexer KL before sparse (SPEC §13)")
    p.add_argument("--replay-window", type=int, default=None, help="train on the SPEC §11 decoder tail of R tokens")
    p.add_argument("--seed", type=int, default=None, help=f"(default {d.seed})")
    p.add_argument("--remat", default=None, choices=remat.POLICIES,
                   help=f"what the backward pass keeps of each layer (csa2.remat; default {d.remat})")
    p.add_argument("--dtype-policy", default=None, choices=DTYPE_POLICIES,
                   help=f"bfloat16: bf16 weights and compute on float32 master weights (default {d.dtype_policy})")
    p.add_argument("--save-every", type=int, default=None,
                   help="also checkpoint every N steps (default: only at the end), the steps a killed run resumes from")
    p.add_argument("--quiet", action="store_true", default=None, help="no JSON line per step on stdout")
    compile_cache.add_argument(p)
    return p.parse_args(argv)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig of the given flags (TrainConfig's defaults for the others); contradictions raise."""
    if args.float and args.qat_from is not None:
        raise ValueError(f"--float and --qat-from {args.qat_from}: pick one (--float trains without QAT; "
                         "--qat-from K trains in float, then with QAT from step K)")
    given = {field: getattr(args, dest) for dest, field in _TRAIN_FIELDS.items() if getattr(args, dest) is not None}
    if args.float:
        given["qat_from"] = None
    return TrainConfig(**given)


def run_recipe(args: argparse.Namespace) -> int:
    """`--recipe longctx`: build (or find) the checkpoint, print its pass-key accuracy table."""
    extra = [_flag(k) for k, v in vars(args).items() if v is not None and k not in ("recipe", *_RECIPE_FLAGS)]
    if extra:
        raise ValueError(f"--recipe {args.recipe} with {' '.join(extra)}: the recipe sets these itself "
                         "(train.longctx.LongCtxRecipe); drop them, or train without --recipe")
    recipe = dataclasses.replace(longctx.default_recipe(), qat=not args.float)
    _, _, report = longctx.checkpoint(args.out, recipe=recipe, log=(lambda _: None) if args.quiet else print)
    print(f"# {report['metric']}\n# pass keys retrieved, by context length (rows) and depth (columns):")
    print(longctx.format_table(report["passkey"]))
    print("# digits right:")
    print(longctx.format_table(report["digits"]))
    print(f"passkey_accuracy: {report['mean']:.4f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        compile_cache.enable(args.compile_cache)
        if args.recipe is not None:
            return run_recipe(args)
        if args.out is None:
            raise ValueError("--out is required: the checkpoint directory (or use --recipe longctx)")
        cfg = preset(args.preset or "tiny")
        tc = train_config(args)
        if args.save_every is not None and args.save_every < 1:
            raise ValueError(f"--save-every {args.save_every}: checkpoint every N ≥ 1 steps, or leave it out")
        corpus = load_corpus()
        state = train(cfg, tc, corpus.train, args.out, resume=bool(args.resume),
                      log=(lambda _: None) if args.quiet else print, save_every=args.save_every or 0)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    quantized = tc.qat_from is not None
    bpb = evaluate(cfg, state.params, corpus.valid, qat=quantized, seq_len=tc.seq_len)
    print(f"val_bpb: {bpb:.4f}  ({'FP4/FP8' if quantized else 'float'} numerics, {len(corpus.valid):,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
