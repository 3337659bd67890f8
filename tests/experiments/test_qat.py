"""The float vs SPEC §8 numerics measurements behind notebooks/fp4_qat.ipynb."""

import dataclasses
import json

import numpy as np
import pytest

from csa2.presets import preset
from experiments import qat
from train import longctx
from train.data import load_corpus

# The fp4_qat notebook's fast mode makes exactly these calls: it reloads what they compiled.
VALID = slice(0, 2048)


def test_ablation_scores_three_runs_under_both_numerics_and_reuses_them(tmp_path):
    corpus = load_corpus()
    spec, cfg = qat.FAST, preset(qat.FAST_PRESET)
    assert [spec.config(r).qat_from for r in qat.RUNS] == [None, 0, 1]
    valid = corpus.valid[VALID]
    table = qat.ablation(cfg, corpus.train, valid, spec, tmp_path)
    assert list(table) == list(qat.RUNS) and all(set(row) == {"float", "fp4"} for row in table.values())
    assert all(np.isfinite(v) and v > 0 for row in table.values() for v in row.values())
    lines = {i: (tmp_path / str(i) / "metrics.jsonl").read_text() for i in range(3)}
    assert [json.loads(lines[2].splitlines()[-1])["step"]] == [2]
    assert qat.ablation(cfg, corpus.train, valid, spec, tmp_path) == table  # finished runs are reused
    assert all((tmp_path / str(i) / "metrics.jsonl").read_text() == lines[i] for i in range(3))
    with pytest.raises(ValueError, match="fields seed differ"):  # another seed is another run, never a cache hit
        qat.ablation(cfg, corpus.train, valid, dataclasses.replace(spec, seed=1), tmp_path)
    with pytest.raises(ValueError, match="fields config differ"):
        qat.ablation(dataclasses.replace(cfg, sliding_window=32), corpus.train, valid, spec, tmp_path)
    (tmp_path / "0" / longctx.RECIPE).unlink()
    with pytest.raises(ValueError, match="no recipe.json"):
        qat.ablation(cfg, corpus.train, valid, spec, tmp_path)


def test_retrieval_gap_scores_one_model_under_both_numerics():
    cfg, params, _ = longctx.checkpoint(fast=True, log=lambda _: None)
    recipe = longctx.FAST
    gap = qat.retrieval_gap(cfg, params, load_corpus().valid[VALID], recipe, seq_len=256)
    assert set(gap) == {"float", "fp4"}
    lengths, depths = {str(n) for n in recipe.eval_lengths}, {str(d) for d in recipe.eval_depths}
    for row in gap.values():
        assert row["bpb"] > 0 and set(row["passkey"]) == lengths
        assert all(set(by_depth) == depths for by_depth in row["passkey"].values())
    assert gap["float"]["bpb"] != gap["fp4"]["bpb"]
