"""`python -m train.research_model` end to end on a miniature recipe: train, adapt, ship, measure, card."""

import json

import jax
import numpy as np
from flax import nnx

from csa2 import model
from csa2.checkpoints import layouts, released
from train import research_model
from train.dspark import DSparkTrainConfig
from train.longctx import LongCtxRecipe

RECIPE = research_model.Recipe(
    backbone=LongCtxRecipe(preset="mini", index_topk=16, candidate_topk_blocks=8, stages=((2, 2, 128),), warmup=1,
                           dense_warmup_steps=1, eval_lengths=(128, 160), eval_depths=(0.2, 0.8), eval_samples=2),
    drafter=DSparkTrainConfig(steps=2, batch_size=2, seq_len=32, anchors=2, data="greedy", distill_rows=4,
                              distill_prompt=8),
    replay_window=16, accept_prompts=2, accept_prompt_len=16, accept_new_tokens=8, accept_batch=2, check_length=128,
    check_prompts=2)


def _load(out):
    return layouts.load(out, layouts.load_config(out).replace(dtype="float32"))


def _leaves(params, drafter: bool) -> list:
    tree = nnx.to_pure_dict(params)
    return jax.tree.leaves({k: v for k, v in tree.items() if (k == model.DRAFTER) == drafter})


def test_build_ships_released_files_measured_as_loaded(tmp_path):
    out = tmp_path / "shipped"
    backbone = research_model.shipped_backbone(RECIPE, tmp_path / "runs", out, log=lambda _: None)
    assert backbone["recipe"]["stages"] == [[2, 2, 128]] and backbone["train_seconds"] > 0
    _, before = _load(out)
    report = research_model.build(RECIPE, tmp_path / "runs", out, log=lambda _: None)
    cfg, params = _load(out)
    # The drafter was adapted on the backbone the files held, and writing it in left that backbone as it was.
    for a, b in zip(_leaves(params, False), _leaves(before, False), strict=True):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(_leaves(params, True), _leaves(before, True)))
    # Every released tensor of the config is stored, quantized ones with their scales.
    table = released.tensors(cfg)
    assert report["tensors"]["released_tensors"] == len(table)
    assert report["tensors"]["stored_names"] == len(table) + sum(t.fmt is not None for t in table)
    assert report["tensors"]["bytes"] == sum(p.stat().st_size for p in out.glob("*.safetensors"))
    stored = json.loads((out / research_model.ACCURACY).read_text())
    assert stored == json.loads(json.dumps(report))
    # Each figure carries n and an interval around its value.
    for mode in ("passkey_exact", "passkey_replay"):
        for length in ("128", "160"):
            keys = stored[mode][length]["keys"]
            assert keys["n"] == 4 and keys["lo"] <= keys["value"] <= keys["hi"]
            assert stored[mode][length]["digits"]["n"] == 4 * RECIPE.backbone.digits
    for numerics in ("float", "spec"):
        bpb = stored["bpb"][numerics]
        assert bpb["lo"] <= bpb["value"] <= bpb["hi"] and bpb["n"] > 2
    assert stored["acceptance"]["prompts"] == 2 and stored["acceptance"]["acceptance_length"]["value"] >= 1.0
    check = stored["check"]
    assert np.asarray(check["hits"]).shape == np.asarray(check["logprob"]).shape == (2, RECIPE.backbone.digits)
    card = (out / research_model.CARD).read_text()
    assert research_model.passkey_table(report) in card
    assert "| 160 |" in card and "acceptance length" in card and "not tested" in card
