"""Self-distillation data for the DSpark drafter (SPEC §12): the target's own continuations.

A drafter is scored on what the target generates, not on the corpus: at inference every block is
drafted after the target's own tokens and checked against its next ones. So next to corpus windows,
`train.dspark` can adapt on rows the frozen target wrote itself:

- `continuations`: `rows` windows of `seq_len` tokens, each a `prompt_len`-token corpus window (random
  start, seeded) followed by `seq_len − prompt_len` tokens the target generated from it through
  `infer.generate` (the inference path and numerics: FP4/FP8 cache) — greedily (`temperature = 0`, the
  data greedy speculative decoding sees) or sampled at `temperature` (the data of stochastic decoding).
  EOS does not stop a row; a BOS the target emits starts a new document, which `train.dspark.block_mask`
  respects as it does in the corpus.
- `pool_batches`: training batches drawn from such a pool, batch k a pure function of (seed, k), so a
  resumed adaptation sees the batches of the run that never stopped (`train.data.batches`' contract).

The pool is computed once per adaptation run and saved with it (`train.dspark` keeps it as `pool.npy`
in the run directory), so resuming does not regenerate it.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from csa2.checks import is_int
from csa2.config import ModelConfig
from infer.generate import Sampling, generate


def _check(name: str, value, low: int, fix: str) -> None:
    if not is_int(value) or value < low:
        raise ValueError(f"{name}={value!r}: must be an integer ≥ {low}; {fix}")


def continuations(cfg: ModelConfig, params, corpus, *, rows: int, prompt_len: int, seq_len: int,
                  temperature: float, seed: int, batch: int = 64) -> np.ndarray:
    """[rows, seq_len] int32: `prompt_len` corpus tokens (a window of the 1-D stream `corpus` at a seeded random
    start), then the target's continuation of it (`temperature = 0`: greedy), generated `batch` rows at a time."""
    _check("rows", rows, 1, "generate at least one row")
    _check("batch", batch, 1, "generate at least one row per call")
    _check("prompt_len", prompt_len, 1, "give the target at least one token to continue")
    _check("seq_len", seq_len, prompt_len + 1, f"a row is the {prompt_len}-token prompt and at least one generated "
           "token")
    if not temperature >= 0:
        raise ValueError(f"temperature={temperature!r}: must be ≥ 0 (0 = greedy continuations)")
    stream = np.asarray(corpus, np.int32).reshape(-1)
    if stream.size <= prompt_len:
        raise ValueError(f"corpus: {stream.size} tokens, fewer than a prompt of prompt_len={prompt_len}; pass the "
                         "training stream (train.data.load_corpus().train) or a shorter prompt")
    rng = np.random.default_rng([seed, 7])  # its own stream: the training batches use [seed, step]
    starts = rng.integers(0, stream.size - prompt_len, size=rows)
    prompts = stream[starts[:, None] + np.arange(prompt_len)]
    out = []
    for i in range(0, rows, batch):
        chunk = prompts[i:i + batch]
        pad = np.repeat(chunk[-1:], batch - len(chunk), axis=0)  # one compiled shape; the padding rows are dropped
        res = generate(cfg, params, np.concatenate([chunk, pad]), max_new_tokens=seq_len - prompt_len,
                       sampling=Sampling(temperature=float(temperature)), eos_id=None, seed=seed * 100_003 + i)
        out.append(np.concatenate([chunk, np.asarray(res.tokens[:len(chunk)])], axis=1))
    return np.concatenate(out).astype(np.int32)


def pool_batches(pool: np.ndarray, batch_size: int, *, seed: int, start_step: int = 0) -> Iterator[np.ndarray]:
    """Infinite batches [batch_size, seq_len] of rows of `pool [rows, seq_len]`, drawn with replacement; batch k
    depends only on (seed, k)."""
    _check("batch_size", batch_size, 1, "use at least one row")
    _check("start_step", start_step, 0, "pass the saved data position")
    pool = np.asarray(pool, np.int32)
    if pool.ndim != 2 or pool.shape[0] < 1:
        raise ValueError(f"pool: shape {pool.shape}; expected [rows ≥ 1, seq_len] (continuations' output)")
    step = int(start_step)
    while True:
        yield pool[np.random.default_rng([int(seed), step]).integers(0, pool.shape[0], size=batch_size)]
        step += 1
