"""`python -m train --preset tiny --steps N --out DIR [--qat] [--resume]`: train on the embedded corpus."""

from __future__ import annotations

import argparse
import sys

from csa2.config import PRESETS, preset
from train.data import load_corpus
from train.loop import evaluate, train
from train.step import TrainConfig


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train", description=__doc__)
    p.add_argument("--preset", default="tiny", help=f"one of {PRESETS}")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--out", required=True, help="checkpoint directory")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--qat", action="store_true", help="fake-quant FP4/FP8 forward from step 0 (SPEC §8)")
    p.add_argument("--qat-from", type=int, default=None,
                   help="train in float, then fine-tune with QAT from this step on (one command)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--index-loss-weight", type=float, default=1.0)
    p.add_argument("--dense-warmup", type=int, default=0, help="steps of dense indexer KL before sparse (SPEC §13)")
    p.add_argument("--replay-window", type=int, default=None, help="train on the SPEC §11 decoder tail of R tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no JSON line per step on stdout")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        cfg = preset(args.preset)
        if args.qat and args.qat_from is not None:
            raise ValueError("--qat and --qat-from: pick one (--qat is --qat-from 0)")
        tc = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                         warmup=args.warmup, index_loss_weight=args.index_loss_weight,
                         dense_warmup_steps=args.dense_warmup, replay_window=args.replay_window, seed=args.seed,
                         qat_from=0 if args.qat else args.qat_from)
        corpus = load_corpus()
        state = train(cfg, tc, corpus.train, args.out, resume=args.resume,
                      log=(lambda _: None) if args.quiet else print)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    quantized = tc.qat_from is not None
    bpb = evaluate(cfg, state.params, corpus.valid, qat=quantized, seq_len=args.seq_len)
    print(f"val_bpb: {bpb:.4f}  ({'FP4/FP8' if quantized else 'float'} numerics, {len(corpus.valid):,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
