"""The float vs SPEC §8 numerics measurements behind notebooks/fp4_qat.ipynb."""

import json

import numpy as np

from csa2.config import preset
from experiments import qat
from train.data import load_corpus
from train.longctx import LongCtxRecipe

MINI = preset("mini")


def test_ablation_scores_three_runs_under_both_numerics_and_reuses_them(tmp_path):
    corpus = load_corpus()
    spec = qat.Ablation(steps=2, batch_size=1, seq_len=16, switch=1)
    assert [spec.config(r).qat_from for r in qat.RUNS] == [None, 0, 1]
    valid = corpus.valid[:200]
    table = qat.ablation(MINI, corpus.train, valid, spec, tmp_path)
    assert list(table) == list(qat.RUNS) and all(set(row) == {"float", "fp4"} for row in table.values())
    assert all(np.isfinite(v) and v > 0 for row in table.values() for v in row.values())
    lines = {i: (tmp_path / str(i) / "metrics.jsonl").read_text() for i in range(3)}
    assert [json.loads(lines[2].splitlines()[-1])["step"]] == [2]
    assert qat.ablation(MINI, corpus.train, valid, spec, tmp_path) == table  # finished runs are reused
    assert all((tmp_path / str(i) / "metrics.jsonl").read_text() == lines[i] for i in range(3))


def test_retrieval_gap_scores_one_model_under_both_numerics(mini_params):
    recipe = LongCtxRecipe(eval_lengths=(96,), eval_depths=(0.5,), eval_samples=1)
    gap = qat.retrieval_gap(MINI, mini_params, load_corpus().valid[:300], recipe, seq_len=96)
    assert set(gap) == {"float", "fp4"}
    for row in gap.values():
        assert row["bpb"] > 0 and set(row["passkey"]) == {"96"} and set(row["passkey"]["96"]) == {"0.5"}
    assert gap["float"]["bpb"] != gap["fp4"]["bpb"]
