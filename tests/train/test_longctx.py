"""The training CLI's numerics (SPEC §8 QAT by default, `--float` the ablation) and the long-context recipe
(`train.longctx`): its mixed batches, its CLI, its cached checkpoint, and the retrieval curve over a run's saved
steps (`train.retrieval_curve`). Every run here is the fast variant."""

import dataclasses
import json
import pathlib
import re
import shutil
import threading

import jax
import numpy as np
import pytest

from csa2.checkpoints import native
from csa2.presets import BOS_ID, preset
from train import __main__ as cli, longctx, retrieval_curve
from train.data import load_corpus
from train.loop import train
from train.step import TrainConfig

FAST = longctx.FAST


def test_qat_is_the_default_numerics():
    assert TrainConfig().qat_from == 0
    assert [TrainConfig(steps=10, qat_from=4).qat(s) for s in (3, 4, 9)] == [False, True, True]
    assert not TrainConfig(qat_from=None).qat(0)
    # the step compiles against `for_step()`: float, QAT and float → QAT runs share their compiled steps
    assert len({TrainConfig(qat_from=q).for_step() for q in (None, 0, 450)}) == 1
    flags = lambda *argv: cli.train_config(cli.parse(["--out", "x", *argv]))  # noqa: E731
    assert flags().qat_from == 0
    assert flags("--float").qat_from is None
    assert flags("--qat-from", "5").qat_from == 5
    assert dataclasses.replace(flags("--steps", "7"), steps=TrainConfig().steps) == TrainConfig()


@pytest.mark.parametrize("argv, message", [
    (["--out", "x", "--float", "--qat-from", "3"], "--float and --qat-from 3: pick one"),
    (["--out", "x", "--steps", "5", "--qat-from", "5"], "TrainConfig.qat_from=5"),
    (["--steps", "5"], "--out is required"),
    (["--recipe", "longctx", "--steps", "5", "--float"], "--recipe longctx with --steps:"),
    (["--recipe", "longctx", "--resume"], "--recipe longctx with --resume"),
])
def test_contradictory_flags_are_refused(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_the_float_recipe_trains_without_qat_into_its_own_directory(monkeypatch, tmp_path, capsys):
    """`--recipe longctx --float`: the recipe with `qat=False` (no fake-quant at any step), cached in
    `runs/longctx-float` beside the QAT checkpoint."""
    assert FAST.train_config().qat_from == 0
    assert dataclasses.replace(FAST, qat=False).train_config().qat_from is None
    seen = {}
    report = {"metric": "m", "passkey": {"256": {"0.5": 1.0}}, "digits": {"256": {"0.5": 1.0}}, "mean": 1.0}

    def run(recipe, out, log):
        seen.update(recipe=recipe, out=out)
        return None, None, report

    monkeypatch.setattr(longctx, "run", run)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(longctx.FAST_ENV, raising=False)
    assert cli.main(["--recipe", "longctx", "--float", "--quiet"]) == 0
    assert seen == {"recipe": dataclasses.replace(longctx.RECIPE_DEFAULT, qat=False),
                    "out": pathlib.Path("runs/longctx-float")}
    assert "passkey_accuracy: 1.0000" in capsys.readouterr().out


@pytest.mark.parametrize("field, value", [("stages", ()), ("stages", ((10, 2, 0),)), ("corpus_share", 1.5),
                                          ("repeat_share", 0.9), ("initializer_range", 0.0),
                                          ("eval_depths", (0.5, 2.0)), ("digits", 0), ("lr", 0.0),
                                          ("index_topk", 0)])
def test_recipe_fields_are_checked(field, value):
    with pytest.raises(ValueError, match=re.escape(f"{field}={value}")):
        dataclasses.replace(longctx.RECIPE_DEFAULT, **{field: value})


def test_mixed_batches_follow_the_stages_and_weight_the_answer():
    recipe = dataclasses.replace(FAST, stages=((2, 8, 128), (3, 2, 256)), repeat_share=0.3, corpus_share=0.3,
                                 multi_needle=0.5)
    assert recipe.steps == 5 and recipe.train_config().steps == 5
    batches = longctx.mixed_batches(recipe, load_corpus().train)
    stream = batches(0)
    kinds = set()
    for step in range(recipe.steps):
        inputs, targets, weights = next(stream)
        rows, length = recipe.stage(step)
        assert inputs.shape == targets.shape == weights.shape == (rows, length) and inputs.dtype == np.int32
        np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
        for x, y, w in zip(inputs, targets, weights):
            if np.all(w == 1):  # a corpus window
                kinds.add("corpus")
                continue
            if w[0] == 0:  # an induction row: the first period weighs 0, every later target copies P back
                kinds.add("repeat")
                period = int(np.argmax(w > 0))
                assert 8 <= period <= length // 2 and x[0] == BOS_ID
                np.testing.assert_array_equal(w[period:], 1)
                np.testing.assert_array_equal(y[period:], x[1:length - period + 1])
                continue
            np.testing.assert_array_equal(w[:-recipe.digits], 1)
            np.testing.assert_array_equal(w[-recipe.digits:], recipe.answer_weight)
            assert x[0] == BOS_ID and all(ord("0") <= t <= ord("9") for t in y[-recipe.digits:])
            prompt = bytes(x[1:-recipe.digits + 1].tolist())
            kinds.add("passkey" if prompt.endswith(b"The pass key is ") else "multi-needle")
            assert bytes(y[-recipe.digits:].tolist()) in prompt  # the key is in the haystack
    assert kinds == {"repeat", "corpus", "passkey", "multi-needle"}
    for a, b in zip(next(batches(4)), (inputs, targets, weights)):  # batch k depends on (seed, k) alone
        np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The fast recipe trained once through `checkpoint` (the cache's first call)."""
    out = tmp_path_factory.mktemp("longctx") / "run"
    return out, longctx.checkpoint(out, fast=True, log=lambda _: None)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def test_checkpoint_is_built_once_then_restored(built, monkeypatch):
    out, (cfg, params, report) = built
    assert cfg == FAST.config() == dataclasses.replace(preset(FAST.preset), initializer_range=FAST.initializer_range,
                                                       index_topk=128, candidate_topk_blocks=32, kernel_impl="auto")
    assert json.loads((out / longctx.RECIPE).read_text()) == json.loads(json.dumps(dataclasses.asdict(FAST)))
    assert report == json.loads((out / longctx.ACCURACY).read_text())
    assert set(report["passkey"]) == {str(n) for n in FAST.eval_lengths}
    for row in report["passkey"].values():
        assert list(row) == [f"{d:g}" for d in FAST.eval_depths] and all(0 <= v <= 1 for v in row.values())

    def no_training(*args, **kwargs):
        raise AssertionError("the cached checkpoint was trained again")

    monkeypatch.setattr(longctx, "train", no_training)
    files = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    cfg2, params2, report2 = longctx.checkpoint(out, fast=True)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == files
    assert cfg2 == cfg and report2 == report
    for a, b in zip(_leaves(params), _leaves(params2), strict=True):
        np.testing.assert_array_equal(a, b)


def test_checkpoint_waits_for_the_process_that_holds_its_lock(built, monkeypatch):
    """A caller arriving while another process builds the run (holding the lock beside it) does not even start
    to restore until the lock is released, then restores what that process wrote."""
    out, (_, params, report) = built
    restore, started, got = longctx.ckpt.restore_params, threading.Event(), {}

    def spied(*args, **kwargs):
        started.set()
        return restore(*args, **kwargs)

    monkeypatch.setattr(longctx.ckpt, "restore_params", spied)
    with longctx.lock(out):
        caller = threading.Thread(target=lambda: got.update(result=longctx.checkpoint(out, fast=True)))
        caller.start()
        assert not started.wait(timeout=1.0)  # without the lock, restoring starts within microseconds
    caller.join()
    assert started.is_set()
    _, params2, report2 = got["result"]
    assert report2 == report
    for a, b in zip(_leaves(params), _leaves(params2), strict=True):
        np.testing.assert_array_equal(a, b)


def test_checkpoint_refuses_a_directory_of_another_recipe(built):
    out, _ = built
    longer = tuple((steps + 1, rows, length) for steps, rows, length in FAST.stages)
    with pytest.raises(ValueError, match="fields stages differ"):
        longctx.checkpoint(out, recipe=dataclasses.replace(FAST, stages=longer))


def test_checkpoint_resumes_a_partial_run_bit_identically(built, tmp_path):
    """An interrupted run (2 of 3 steps here) is finished by the next `checkpoint` call, as if never stopped."""
    _, (cfg, params, report) = built
    train(cfg, FAST.train_config(), longctx.mixed_batches(FAST, load_corpus().train), tmp_path, log=lambda _: None,
          until=2)
    _, resumed, report2 = longctx.checkpoint(tmp_path, fast=True, log=lambda _: None)
    for a, b in zip(_leaves(params), _leaves(resumed), strict=True):
        np.testing.assert_array_equal(a, b)
    assert report2["passkey"] == report["passkey"]


def test_recipe_cli_writes_the_accuracy_json(built, tmp_path, monkeypatch, capsys):
    """`CSA2_FAST=1 python -m train --recipe longctx --out DIR` (in process: the compiled programs are shared)."""
    _, (_, _, report) = built
    monkeypatch.setenv(longctx.FAST_ENV, "1")
    assert cli.main(["--recipe", "longctx", "--out", str(tmp_path), "--quiet"]) == 0
    written = json.loads((tmp_path / longctx.ACCURACY).read_text())
    assert written["passkey"] == report["passkey"] and written["steps"] == FAST.steps
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == f"passkey_accuracy: {written['mean']:.4f}"
    assert "teacher-forced" in out


def test_read_recipe_gives_back_the_stored_recipe(built, tmp_path):
    out, _ = built
    assert longctx.read_recipe(out) == FAST
    with pytest.raises(ValueError, match="recipe.json"):
        longctx.read_recipe(tmp_path)


def test_retrieval_curve_scores_each_saved_step_once(built, tmp_path):
    """`train.retrieval_curve`: one line per saved step with its pass-key shares and intervals; a second look
    scores nothing again; following a finished run returns without waiting."""
    run = tmp_path / "run"
    shutil.copytree(built[0], run)
    (row,) = retrieval_curve.update(run, (128,), 1, log=lambda _: None)
    assert row["step"] == FAST.steps == native.latest_step(run)
    keys = row["passkey"]["128"]["keys"]
    assert keys["n"] == len(FAST.eval_depths) and keys["lo"] <= keys["value"] <= keys["hi"]
    assert retrieval_curve.update(run, (128,), 1, log=lambda _: None) == []
    retrieval_curve.follow(run, (128,), 1, poll_s=1.0, log=lambda _: None, sleep=lambda _: pytest.fail("waited"))
    assert [json.loads(line) for line in (run / retrieval_curve.CURVE).read_text().splitlines()] == [row]



def test_pass_keys_can_be_read_in_held_out_wording(built):
    """`template="held_out"` reads the pass keys in words no training row holds (the same draws, so the same keys
    and depths: tests/train/test_data.py); an unknown template is refused by name."""
    _, (cfg, params, _) = built
    recipe = longctx.FAST
    hit, logp = longctx.passkey_reads(cfg, params, recipe, recipe.eval_lengths[0], samples=1, template="held_out")
    again, _ = longctx.passkey_reads(cfg, params, recipe, recipe.eval_lengths[0], samples=1)
    assert hit.shape == again.shape == (1, len(recipe.eval_depths), recipe.digits) and np.isfinite(logp).all()
    with pytest.raises(ValueError, match="template='other'"):
        longctx.passkey_reads(cfg, params, recipe, recipe.eval_lengths[0], samples=1, template="other")
