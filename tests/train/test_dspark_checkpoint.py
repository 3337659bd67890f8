"""The DSpark research checkpoint (train.dspark_checkpoint): built once (the FAST recipe, shared with the DSpark
notebook's CI run), restored bit for bit afterwards without training, and a directory of another recipe refused."""

import dataclasses

import jax
import numpy as np
import pytest

from csa2 import model
from train import dspark_checkpoint


def test_built_once_then_restored(monkeypatch):
    cfg, params, report = dspark_checkpoint.checkpoint(fast=True, log=lambda _: None)
    recipe = dspark_checkpoint.FAST
    assert cfg.num_nextn_predict_layers == recipe.stages and model.DRAFTER in params
    assert report["recipe"] == dataclasses.asdict(recipe)
    assert len(report["validation"]["accept"]) == cfg.dspark_block_size

    def rebuild(*args, **kwargs):
        raise AssertionError("a finished checkpoint was built again")

    monkeypatch.setattr(dspark_checkpoint, "run", rebuild)
    cfg2, params2, report2 = dspark_checkpoint.checkpoint(fast=True, log=lambda _: None)
    assert cfg2 == cfg and report2 == report
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(params2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    other = dataclasses.replace(recipe, backbone_steps=recipe.backbone_steps + 1)
    with pytest.raises(ValueError, match="another recipe"):
        dspark_checkpoint.checkpoint(fast=True, recipe=other, log=lambda _: None)
    with pytest.raises(ValueError, match="recipe: expected"):
        dspark_checkpoint.checkpoint(fast=True, recipe={"steps": 3}, log=lambda _: None)
