"""Float vs the SPEC §8 numerics (FP4 Global KV and indexer, FP8 windows): how large the gap is and what
quantization-aware training recovers.

`ablation` trains one model three ways from the same initialization and data — float throughout, QAT (the
training default) throughout, float then QAT for the last steps — and scores each under both numerics.
`retrieval_gap` scores one model's long-context behaviour under both numerics: bits per byte at a long
sequence length and pass-key accuracy by depth.
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

from csa2.checkpoints import native as checkpoint
from csa2.config import ModelConfig
from infer.schedule import config_fingerprint
from train.longctx import LongCtxRecipe, claim, passkey_accuracy
from train.loop import evaluate, train
from train.step import TrainConfig

RUNS = ("float", "qat", "float → qat")


@dataclasses.dataclass(frozen=True)
class Ablation:
    """The three training runs of `ablation`: `steps` of `batch_size × seq_len` windows of the corpus; the third
    switches to QAT at `switch`."""

    steps: int = 160
    batch_size: int = 8
    seq_len: int = 128
    switch: int = 120
    seed: int = 0

    def config(self, run: str) -> TrainConfig:
        qat_from = {"float": None, "qat": 0, "float → qat": self.switch}[run]
        return TrainConfig(steps=self.steps, batch_size=self.batch_size, seq_len=self.seq_len, qat_from=qat_from,
                           seed=self.seed)


# CI sizes: the fp4_qat notebook's fast mode (on `mini`) and its test run exactly this, so within one test run
# the notebook's kernel loads the programs the test compiled (tests/conftest.py's compilation cache).
FAST = Ablation(steps=2, batch_size=1, seq_len=16, switch=1)
FAST_PRESET = "mini"


def ablation(cfg: ModelConfig, train_tokens: np.ndarray, valid_tokens: np.ndarray, spec: Ablation,
             out: str | pathlib.Path) -> dict[str, dict[str, float]]:
    """{run: {"float": val bpb, "fp4": val bpb}} for the runs of `spec`, each trained into `out/<n>` (a finished run
    there is reused, a partial one resumed). Each run directory is keyed on its whole recipe (the run, the model
    config's fingerprint and every training field, in `recipe.json`): a directory of another recipe, or one with a
    checkpoint but no recipe, is refused rather than reused."""
    table = {}
    for i, run in enumerate(RUNS):
        path = pathlib.Path(out) / str(i)
        recipe = {"run": run, "config": config_fingerprint(cfg), **dataclasses.asdict(spec.config(run))}
        claim(path, recipe)
        state = train(cfg, spec.config(run), train_tokens, path, resume=checkpoint.latest_step(path) is not None,
                      log=lambda _: None, bar=False)
        table[run] = {numerics: evaluate(cfg, state.params, valid_tokens, qat=numerics == "fp4",
                                         seq_len=spec.seq_len)
                      for numerics in ("float", "fp4")}
    return table


def retrieval_gap(cfg: ModelConfig, params, valid_tokens: np.ndarray, recipe: LongCtxRecipe, *,
                  seq_len: int) -> dict[str, dict]:
    """{numerics: {"bpb": val bits per byte in windows of `seq_len`, "passkey": {length: {depth: accuracy}}}} for
    "float" and "fp4" numerics (pass keys teacher-forced, as `train.longctx` scores them)."""
    return {numerics: {"bpb": evaluate(cfg, params, valid_tokens, qat=numerics == "fp4", batch_size=1,
                                       seq_len=seq_len),
                       "passkey": passkey_accuracy(cfg, params, recipe, qat=numerics == "fp4")}
            for numerics in ("float", "fp4")}
