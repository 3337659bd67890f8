"""The shipped research model is what its card says (`csa2.checkpoints.bundled("tiny-v41")`).

It loads through the released-checkpoint path (`load_hf`, as a user would), reproduces the card's check slice (pass
keys at 512 tokens: every digit's log-probability; the drafter's acceptance length on a few prompts) and its files
are the released layout. A model-code change that moves its outputs fails the log-probabilities; the planted mutant
(one Reuse layer's attention output zeroed) shows the tolerance is tight enough to see one layer.
"""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

from csa2.checkpoints import bundled, load_hf, read_config
from csa2.layout import layer_groups
from infer import __main__ as infer_cli
from infer.bench_spec import acceptance
from train import longctx, research_model

PATH = bundled("tiny-v41")
REPORT = json.loads((PATH / research_model.ACCURACY).read_text())
CHECK = REPORT["check"]
# The card was measured at XLA's default optimization level, the suite runs at -O0 (tests/conftest.py): through 40
# layers of SPEC §8 rounding that moved one of the 45 log-probabilities by 2.9e-3 (the others by far less).
LOGPROB_ATOL = 1e-2


@pytest.fixture(scope="module")
def shipped():
    return load_hf(PATH, read_config(PATH).replace(dtype=research_model.COMPUTE_DTYPE))


def test_the_card_describes_this_recipe_and_these_files():
    assert REPORT["recipe"] == json.loads(json.dumps(dataclasses.asdict(research_model.RECIPE)))
    assert research_model.tensor_summary(PATH, read_config(PATH)) == REPORT["tensors"]
    assert REPORT["tensors"]["bytes"] <= 16e6
    config = json.loads((PATH / "config.json").read_text())
    assert config["model_type"] == "deepseek_v41" and config["quantization_config"]["expert_dtype"] == "fp4"
    assert config["text_config"]["dspark_target_layer_ids"] == [37, 38, 39]
    assert research_model.passkey_table(REPORT) in (PATH / research_model.CARD).read_text()


def test_pass_keys_at_512_tokens_reproduce_the_card(shipped):
    cfg, params = shipped
    hit, logp = longctx.passkey_reads(cfg, params, research_model.RECIPE.backbone, CHECK["length"], samples=1)
    np.testing.assert_allclose(logp[0], CHECK["logprob"], atol=LOGPROB_ATOL)
    assert (hit[0] != np.asarray(CHECK["hits"], bool)).sum() <= 1  # a digit at a near tie may flip across ISAs


def test_a_model_with_one_layer_broken_fails_the_check(shipped):
    cfg, params = shipped
    g, r = next((g, r) for g, group in enumerate(layer_groups(cfg)) for r, run in enumerate(group.runs)
                if run.spec.role == "reuse")
    broken = jax.tree.map(lambda x: x, params)
    pure = nnx.to_pure_dict(broken)
    attn = pure["groups"][g][r]["attn"]
    attn["wo_b"] = attn["wo_b"].at[0, 0].set(0.0)  # the first Reuse layer's attention output
    nnx.replace_by_pure_dict(broken, pure)
    _, logp = longctx.passkey_reads(cfg, broken, research_model.RECIPE.backbone, CHECK["length"], samples=1)
    moved = np.abs(logp[0] - np.asarray(CHECK["logprob"])).max()
    print(f"one layer zeroed moves the log-probabilities by up to {moved:.3g}")
    assert moved > 3 * LOGPROB_ATOL


def test_the_drafter_accepts_as_the_card_says(shipped):
    cfg, params = shipped
    acc = acceptance(cfg, params, CHECK["prompts"], CHECK["prompt_len"], CHECK["new_tokens"], CHECK["batch"])
    assert acc["acceptance_length"]["value"] == pytest.approx(CHECK["acceptance_length"], abs=0.25)


def test_python_m_infer_reads_the_shipped_directory(capsys):
    code = infer_cli.main(["--checkpoint", str(PATH), "--dtype", "float32", "--prompt", "class ",
                           "--max-new-tokens", "4"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("[0] ") and "4 new tokens" in out
