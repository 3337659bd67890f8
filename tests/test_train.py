"""Training: bit-identical resume, the indexer learns from its KL loss, QAT evaluation, CLI errors."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from csa2.config import preset
from train import checkpoint
from train.data import load_corpus
from train.loop import evaluate, train
from train.step import TrainConfig, init_train_state, train_step

CFG = preset("mini")
TC = TrainConfig(steps=6, batch_size=2, seq_len=32, lr=3e-3, warmup=2)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


@pytest.fixture(scope="module")
def straight(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("straight")
    return out, train(CFG, TC, corpus.train, out, log=lambda _: None)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def test_resume_is_bit_identical(straight, corpus, tmp_path):
    """train 6 steps == train 3, stop, resume 3 (params, optimizer state, rng)."""
    _, full = straight
    train(CFG, TC, corpus.train, tmp_path, log=lambda _: None, until=3)
    assert checkpoint.latest_step(tmp_path) == 3
    resumed = train(CFG, TC, corpus.train, tmp_path, resume=True, log=lambda _: None)
    assert int(resumed.step) == int(full.step) == 6
    for a, b in zip(_leaves((full.params, full.opt_state, full.rng)),
                    _leaves((resumed.params, resumed.opt_state, resumed.rng))):
        np.testing.assert_array_equal(a, b)
    assert (tmp_path / "loss.png").exists() and len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 6


def test_resume_into_a_different_config_names_the_fields(straight, corpus):
    out, _ = straight
    with pytest.raises(ValueError, match="sliding_window"):
        train(CFG.replace(sliding_window=8), TC, corpus.train, out, resume=True, log=lambda _: None)


def test_indexer_kl_falls_during_training(straight, corpus):
    """With a peaked main attention (sharpened queries) the KL target carries signal; a few steps on
    one batch pull the indexer toward it (its gradient reaches only the indexer, SPEC §13)."""
    state = init_train_state(CFG, TC)
    layers = tuple({**p, "attn": {**p["attn"], "wq_b": p["attn"]["wq_b"] * 20.0}} for p in state.params["layers"])
    state = state.replace(params={**state.params, "layers": layers})
    tokens = jnp.asarray(corpus.valid[:2 * 33].reshape(2, 33))
    kls = []
    for _ in range(TC.steps):
        state, metrics = train_step(CFG, TC, state, tokens[:, :-1], tokens[:, 1:])
        kls.append(float(metrics["index_kl"]))
    assert kls[-1] < 0.95 * kls[0], kls


def test_qat_evaluation_reports_float_and_fp4(straight, corpus):
    _, trained = straight
    valid = corpus.valid[:2 * 8 * 32 + 1]
    f = evaluate(CFG, trained.params, valid, qat=False, batch_size=8, seq_len=32)
    q = evaluate(CFG, trained.params, valid, qat=True, batch_size=8, seq_len=32)
    assert np.isfinite([f, q]).all() and f != q and abs(f - q) < 0.5


@pytest.mark.parametrize("argv, message", [
    (["-m", "train", "--preset", "huge", "--out", "/tmp/never"], "unknown name 'huge'"),
    (["-m", "train.eval", "--checkpoint", "/nonexistent/ckpt"], "/nonexistent/ckpt"),
])
def test_cli_errors_are_one_line(argv, message):
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env={"JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
