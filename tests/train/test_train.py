"""Training: bit-identical resume, the indexer learns from its KL loss, the optimizer and the router-bias rule,
QAT evaluation, CLI errors."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from csa2 import engram_vocab, model, stack
from csa2.checkpoints import native as checkpoint
from csa2.layout import layer_groups
from csa2.moe import RouterBias, bias_update
from csa2.presets import preset
from train.data import load_corpus
from train.loop import evaluate, plot_losses, train
from train.step import TrainConfig, _labels, init_train_state, train_step

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


def test_resume_is_bit_identical(straight, corpus, tmp_path, capsys):
    """train 6 steps == train 3, stop, resume 3 (params, optimizer state, rng); the progress bar only with `bar`."""
    _, full = straight
    capsys.readouterr()
    train(CFG, TC, corpus.train, tmp_path, log=lambda _: None, until=3)
    assert checkpoint.latest_step(tmp_path) == 3 and "] 3/3 loss" in capsys.readouterr().err
    resumed = train(CFG, TC, corpus.train, tmp_path, resume=True, log=lambda _: None, bar=False)
    assert capsys.readouterr().err == ""
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
    flat = list(nnx.to_flat_state(state.params))
    queries = lambda path: path[0] == "groups" and path[-2:] == ("attn", "wq_b")  # noqa: E731 (not the drafter's)
    scaled = [(path, v.replace(v.get_value() * 20.0) if queries(path) else v) for path, v in flat]
    runs = sum(len(group.runs) for group in layer_groups(CFG))  # each run stacks its layers' wq_b
    assert sum(queries(path) for path, _ in flat) == runs  # every layer's queries
    state = state.replace(params=nnx.from_flat_state(scaled))
    tokens = jnp.asarray(corpus.valid[:2 * 33].reshape(2, 33))
    kls = []
    for _ in range(TC.steps):
        state, metrics = train_step(CFG, TC, state, tokens[:, :-1], tokens[:, 1:], dense=False)
        kls.append(float(metrics["index_kl"]))
    assert kls[-1] < 0.95 * kls[0], kls


def _flat_values(params):
    return {path: np.array(v.get_value()) for path, v in nnx.to_flat_state(params)}


def _kinds(params):
    return {path: type(v) for path, v in nnx.to_flat_state(params)}


def test_optimizer_labels_exactly_the_router_biases_and_the_drafter_frozen():
    """AdamW trains the backbone's `nnx.Param`s; the router biases (by type) and the DSpark drafter's subtree
    (adapted by `train.dspark` on the trained backbone) are frozen."""
    params = model.abstract_params(CFG)
    flat_labels = jax.tree_util.tree_flatten_with_path(_labels(params))[0]
    labels = {tuple(k.key for k in path): label for path, label in flat_labels}
    kinds = _kinds(params)
    assert labels.keys() == kinds.keys()
    drafter = {path for path in kinds if path[0] == model.DRAFTER}
    assert drafter
    frozen = {path for path, label in labels.items() if label == "frozen"}
    assert frozen == {path for path, kind in kinds.items() if kind is RouterBias} | drafter
    assert {path for path, label in labels.items() if label == "adamw"} == {
        path for path, kind in kinds.items() if kind is nnx.Param} - drafter
    assert set(labels.values()) == {"adamw", "frozen"} and set(kinds.values()) == {nnx.Param, RouterBias}
    assert {path[-2:] for path in frozen - drafter} == {("moe", "bias"), ("moe", "bias_vl")}


def test_train_step_moves_params_and_router_biases_only_by_the_bias_rule(corpus):
    """With lr > 0 every backbone `nnx.Param` moves and the drafter's stay put; every `RouterBias` moves by −rate,
    0 or +rate per element (the aux-loss-free rule alone: no AdamW update, no weight decay)."""
    state = init_train_state(CFG, TC)
    tokens = jnp.asarray(corpus.train[:2 * 33].reshape(2, 33))
    # step 0: the warm-up lr is 0, so only the router biases move
    state, _ = train_step(CFG, TC, state, tokens[:, :-1], tokens[:, 1:], dense=False)
    kinds = _kinds(state.params)
    before = _flat_values(state.params)
    lr = TC.lr / TC.warmup  # step 1 of the linear warm-up from 0
    assert lr > 0
    state, _ = train_step(CFG, TC, state, tokens[:, :-1], tokens[:, 1:], dense=False)
    after = _flat_values(state.params)
    assert _kinds(state.params) == kinds
    rate, moved_biases = TC.bias_rate, 0
    for path, kind in kinds.items():
        delta = after[path].astype(np.float64) - before[path]
        if path[0] == model.DRAFTER:
            assert np.all(delta == 0), f"{path}: the backbone trainer moved the drafter"
        elif kind is RouterBias:
            on_rule = [np.isclose(delta, v, rtol=0, atol=1e-3 * rate) for v in (-rate, 0.0, rate)]
            assert np.all(on_rule[0] | on_rule[1] | on_rule[2]), (path, delta)
            moved_biases += int(np.sum(~on_rule[1]))
        else:
            assert kind is nnx.Param, path
            assert np.any(delta != 0), f"{path} did not move with lr={lr}"
    assert moved_biases > 0


def test_train_step_differentiates_params_only_and_keeps_the_compressed_vocabulary():
    """A model whose Engram hashes compressed ids holds an int32 `CompressedVocab` table: the step differentiates
    the `nnx.Param`s alone (no gradient of an integer leaf) and hands the table back unchanged (traced only)."""
    cfg = CFG.replace(engram_compressed_vocab_size=200, engram_pad_id=0)
    state = jax.eval_shape(lambda: init_train_state(cfg, TC))
    tokens = jax.ShapeDtypeStruct((2, 32), jnp.int32)
    new, metrics = jax.eval_shape(lambda s, x: train_step(cfg, TC, s, x, x), state, tokens)
    assert jax.tree.structure(new.params) == jax.tree.structure(state.params)
    table = new.params[engram_vocab.PARAM]
    assert type(table) is engram_vocab.CompressedVocab and table.get_value().dtype == jnp.int32
    assert metrics["grad_norm"].dtype == jnp.float32


def test_update_router_bias_moves_each_layers_bias_by_its_own_load():
    """`update_router_bias` on the grouped layout (tiny: groups of 2 and 4 iterations): layer l's bias moves
    by `bias_update(bias_l, load[l], rate)`; every other variable is the same array."""
    cfg = preset("tiny")
    rng = np.random.default_rng(0)
    abstract = model.abstract_params(cfg)
    params = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape).astype(x.dtype)), abstract)
    load = jnp.asarray(rng.dirichlet(np.ones(cfg.n_routed_experts), cfg.num_hidden_layers), jnp.float32)  # [L, E]
    rate = 0.01
    new = model.update_router_bias(cfg, params, load, rate)
    assert _kinds(new) == _kinds(params)
    old_pure, new_pure = nnx.to_pure_dict(params), nnx.to_pure_dict(new)
    for layer in range(cfg.num_hidden_layers):
        a, b = stack.layer_params(cfg, old_pure, layer), stack.layer_params(cfg, new_pure, layer)
        want = bias_update(a["moe"]["bias"], load[layer], rate)
        np.testing.assert_allclose(b["moe"]["bias"], want, rtol=0, atol=1e-6)
        assert not np.allclose(b["moe"]["bias"], a["moe"]["bias"])
        np.testing.assert_array_equal(b["moe"]["bias_vl"], a["moe"]["bias_vl"])
    old, got = _flat_values(params), _flat_values(new)
    for path in old:
        if path[-2:] != ("moe", "bias"):
            np.testing.assert_array_equal(got[path], old[path])


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


def test_loss_plot_leaves_the_pyplot_backend_alone(tmp_path):
    """A notebook that trains keeps its inline plots: writing loss.png must not switch the process to Agg."""
    import matplotlib

    previous = matplotlib.get_backend()
    matplotlib.use("svg")
    try:
        records = [{"step": s, "bpb": 3.0 - s / 10, "index_kl": 0.1} for s in (1, 2, 3)]
        assert plot_losses(records, tmp_path / "loss.png")
        assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG" and matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(previous)
