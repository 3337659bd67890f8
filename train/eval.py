"""`python -m train.eval --checkpoint DIR [...]`: validation bits per byte with float and FP4 caches.

The float column runs the float model; the FP4 column runs the SPEC §8 numerics that inference
stores (FP4 Main KV, MXFP4 Indexer Q/K, FP8 window KV), so the gap is what quantized serving
costs. Give a QAT checkpoint and a no-QAT baseline to compare them side by side.
"""

from __future__ import annotations

import argparse
import sys

from csa2.checkpoints import native as checkpoint
from train.data import load_corpus
from train.loop import evaluate


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.eval", description=__doc__)
    p.add_argument("--checkpoint", action="append", required=True, help="checkpoint directory (repeatable)")
    p.add_argument("--seq-len", type=int, default=128)
    args = p.parse_args(argv)
    valid = load_corpus().valid
    print(f"{'checkpoint':<32} {'float bpb':>10} {'fp4 bpb':>10} {'gap':>8}")
    for directory in args.checkpoint:
        try:
            cfg, params = checkpoint.restore_params(directory)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        f = evaluate(cfg, params, valid, qat=False, seq_len=args.seq_len)
        q = evaluate(cfg, params, valid, qat=True, seq_len=args.seq_len)
        print(f"{directory:<32} {f:>10.4f} {q:>10.4f} {q - f:>+8.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
