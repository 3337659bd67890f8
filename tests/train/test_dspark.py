"""DSpark adaptation (train.dspark, SPEC §12): the backbone stays bit-identical, the loss is the SPEC formula
(weights, masking, α as a stop-gradient target), it falls on a repeating sequence, drafter checkpoints round
trip and refuse other configs, bad input is refused by name."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from csa2 import model
from csa2.checkpoints import native as checkpoint
from csa2.moe import RouterBias
from csa2.presets import BOS_ID, preset
from train import dspark
from train.data import load_corpus
from train.dspark import DSparkTrainConfig

CFG = preset("mini")
# One static config for every step below: the step compiles once for the whole module.
DC = DSparkTrainConfig(steps=8, batch_size=2, seq_len=32, anchors=2, lr=1e-2, warmup=0)


def _values(tree) -> list[np.ndarray]:
    return [np.array(x) for x in jax.tree_util.tree_leaves(tree)]


def _flat(params) -> dict:
    return {path: v for path, v in nnx.to_flat_state(params)}


@pytest.fixture(scope="module")
def adapted(tmp_path_factory, mini_params):
    """Three adaptation steps on the corpus, from the mini model's initial drafter; the backbone as it was before."""
    before = {path: np.array(v.get_value()) for path, v in nnx.to_flat_state(mini_params)}
    out = tmp_path_factory.mktemp("dspark")
    params = dspark.adapt(CFG, mini_params, load_corpus().train, DC, out, log=lambda _: None,
                          drafter=mini_params[model.DRAFTER], until=3)
    return out, params, before


def test_backbone_is_frozen_and_drafter_learns(adapted, mini_params):
    out, params, before = adapted
    after, given = _flat(params), _flat(mini_params)
    assert after.keys() == before.keys()
    changed = []
    for path, value in before.items():
        assert np.array_equal(np.asarray(given[path].get_value()), value), path  # the caller's params untouched
        now = np.asarray(after[path].get_value())
        if path[0] != model.DRAFTER:
            assert np.array_equal(now, value), path  # every backbone leaf bit-identical
        elif isinstance(after[path], RouterBias):
            assert np.array_equal(now, value), path  # frozen by type
        elif not np.array_equal(now, value):
            changed.append(path)
    assert changed, "no drafter parameter moved"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    gamma = CFG.dspark_block_size
    for r in records:
        assert np.isfinite(r["loss"]) and len(r["accept"]) == len(r["greedy"]) == gamma
        assert 0.0 <= r["accept_len"] <= gamma and 0.0 <= r["ece"] <= 1.0
        assert r["loss"] == pytest.approx(0.1 * r["ce"] + 0.9 * r["l1"] + r["bce"], rel=1e-5)
    assert (out / "dspark.png").exists()


def _hand_loss(draft, conf, target, tokens, anchors, alpha=None):
    """The SPEC §12 formula from an explicit list of the valid slots (jnp, so it can be differentiated);
    `alpha` given: a constant."""
    b_n, a_n, gamma, _ = draft.shape
    s = tokens.shape[1]
    slots = [(b, i, k, int(anchors[b, i])) for b in range(b_n) for i in range(a_n) for k in range(gamma)
             if int(anchors[b, i]) + 1 + k < s]  # slots past the end of the window have no target
    bi, ii, kk, aa = (np.array(x) for x in zip(*slots))
    p_t = jax.nn.softmax(target[bi, aa + kk])  # the target's prediction of position a + 1 + k
    p_d = jax.nn.softmax(draft[bi, ii, kk])
    ce = -jnp.log(p_d[np.arange(len(slots)), np.asarray(tokens)[bi, aa + kk + 1]])
    l1 = jnp.sum(jnp.abs(p_d - p_t), axis=-1)
    al = 1.0 - 0.5 * l1 if alpha is None else alpha[bi, ii, kk]
    c = conf[bi, ii, kk]
    bce = -(al * jnp.log(c) + (1.0 - al) * jnp.log(1.0 - c))
    w = np.exp(-kk / 4.0)
    return jnp.sum(w * (0.1 * ce + 0.9 * l1 + bce)) / np.sum(w)


def test_loss_is_the_spec_formula():
    """Fixed anchors, one block running past the end of the window: the objective equals the hand-written
    formula, masked slots carry no loss or gradient, and α is a stop-gradient target (its live version,
    a planted mutant, gives other gradients)."""
    rng = np.random.default_rng(0)
    b, a_n, gamma, v, s = 2, 2, 5, 7, 8
    draft = jnp.asarray(rng.normal(size=(b, a_n, gamma, v)) * 2, jnp.float32)
    conf = jnp.asarray(rng.uniform(0.05, 0.95, size=(b, a_n, gamma)), jnp.float32)
    target = jnp.asarray(rng.normal(size=(b, s, v)) * 2, jnp.float32)
    tokens = jnp.asarray(rng.integers(0, v, size=(b, s)), jnp.int32)
    anchors_np = np.array([[0, 5], [6, 2]], np.int32)  # a = 5: slots 0, 1 valid; a = 6: slot 0 only
    anchors, tokens_np = jnp.asarray(anchors_np), np.asarray(tokens)
    dc = DSparkTrainConfig()
    objective = jax.jit(lambda dc, d, c: dspark.objective(dc, d, c, target, tokens, anchors), static_argnums=0)
    hand_loss = jax.jit(lambda d, c: _hand_loss(d, c, target, tokens_np, anchors_np))

    loss, metrics = objective(dc, draft, conf)
    np.testing.assert_allclose(loss, hand_loss(draft, conf), rtol=1e-5)
    unweighted = DSparkTrainConfig(position_decay=1e9)  # w_k ≈ 1: the weights matter
    assert abs(float(objective(unweighted, draft, conf)[0]) - float(loss)) > 1e-3

    # Masked slots: neither their values nor gradients matter.
    masked = np.zeros((b, a_n, gamma), bool)
    masked[0, 1, 2:] = masked[1, 0, 1:] = True
    noisy = jnp.where(masked[..., None], draft + 100.0, draft)
    np.testing.assert_allclose(objective(dc, noisy, conf)[0], loss, rtol=1e-6)
    g_draft, g_conf = jax.jit(jax.grad(lambda d, c: objective(dc, d, c)[0], argnums=(0, 1)))(draft, conf)
    assert not np.any(np.asarray(g_draft)[masked]) and not np.any(np.asarray(g_conf)[masked])

    # α as a constant target: the hand formula with α frozen has the objective's gradients; with α live it does not.
    p_t = jax.nn.softmax(jnp.take_along_axis(target, jnp.clip(anchors[..., None] + jnp.arange(gamma), 0, s - 1)
                                             .reshape(b, -1)[..., None], axis=1).reshape(b, a_n, gamma, v))
    alpha = np.asarray(1.0 - 0.5 * jnp.sum(jnp.abs(jax.nn.softmax(draft) - p_t), -1))
    frozen = jax.grad(lambda d, c: _hand_loss(d, c, target, tokens_np, anchors_np, alpha), argnums=(0, 1))
    hand = jax.jit(frozen)(draft, conf)
    live = jax.jit(jax.grad(lambda d: hand_loss(d, conf)))(draft)
    np.testing.assert_allclose(g_draft, hand[0], atol=1e-6)
    np.testing.assert_allclose(g_conf, hand[1], atol=1e-6)
    assert np.max(np.abs(np.asarray(live) - np.asarray(g_draft))) > 1e-3

    # Per-slot acceptance, accepted length (full blocks only), ECE.
    valid = ~masked
    np.testing.assert_allclose(metrics["accept"], [alpha[..., k][valid[..., k]].mean() for k in range(gamma)],
                               rtol=1e-5)
    full = valid[..., -1]
    np.testing.assert_allclose(metrics["accept_len"], np.cumprod(alpha, -1).sum(-1)[full].mean(), rtol=1e-5)
    c, al = np.asarray(conf)[valid], alpha[valid]
    bins = np.minimum((c * 10).astype(int), 9)
    ece = sum(abs(c[bins == i].sum() - al[bins == i].sum()) for i in range(10)) / c.size
    np.testing.assert_allclose(metrics["ece"], ece, rtol=1e-5)


def test_anchors_are_distinct_and_uniform_over_valid_positions():
    """Without replacement, inside the window, never where the next token starts a new document; a row with
    fewer valid positions than anchors draws every valid one and its other blocks are masked whole."""
    s, a_n, gamma = 12, 3, 4
    tokens = np.arange(2 * s, dtype=np.int32).reshape(2, s) % 200
    tokens[0, [4, 9]] = BOS_ID  # row 0: anchors 3 and 8 would predict a BOS; 11 has no next token
    tokens[1, 1:] = BOS_ID  # row 1: every next token starts a new document …
    tokens[1, 11] = 7  # … except at position 10, followed by 7
    tokens = jnp.asarray(tokens)
    want0 = sorted(set(range(s - 1)) - {3, 8})
    np.testing.assert_array_equal(np.flatnonzero(dspark.valid_anchors(tokens)[0]), want0)
    np.testing.assert_array_equal(np.flatnonzero(dspark.valid_anchors(tokens)[1]), [10])
    draws = np.stack([np.asarray(dspark.sample_anchors(jax.random.PRNGKey(i), tokens, a_n)) for i in range(400)])
    assert all(len(set(row)) == a_n for row in draws.reshape(-1, a_n))  # distinct within a row
    assert set(draws[:, 0].ravel()) == set(want0)
    counts = np.bincount(draws[:, 0].ravel(), minlength=s)[want0]  # 1200 draws over 9 positions: ~133 each
    assert counts.min() > 90 and counts.max() < 180
    assert (draws[:, 1] == 10).any(axis=1).all()  # row 1's one valid position is always drawn
    mask = np.asarray(jax.vmap(lambda a: dspark.block_mask(tokens, a, gamma))(jnp.asarray(draws)))
    others = draws[:, 1] != 10
    assert not mask[:, 1][others].any() and mask[:, 1][~others][:, 0].all()


def test_block_mask_stops_at_the_window_and_at_document_boundaries():
    tokens = jnp.asarray([[1, 2, BOS_ID, 3, 4, 5, 6, BOS_ID, 8, 9]], jnp.int32)
    anchors = jnp.asarray([[0, 1, 3, 6, 8]], jnp.int32)
    want = [[1, 0, 0, 0],  # a = 0 predicts 2, then BOS (a new document)
            [0, 0, 0, 0],  # a = 1 predicts the BOS itself
            [1, 1, 1, 0],  # a = 3 predicts 4, 5, 6, then BOS
            [0, 0, 0, 0],  # a = 6 predicts the BOS
            [1, 0, 0, 0]]  # a = 8 predicts 9, then the window ends
    np.testing.assert_array_equal(dspark.block_mask(tokens, anchors, 4)[0], np.asarray(want, bool))


def test_loss_falls_on_a_repeating_sequence(mini_params):
    pattern = np.frombuffer(b"abcdefg ", np.uint8).astype(np.int32)
    tokens = jnp.asarray(np.tile(pattern, (DC.batch_size, DC.seq_len // pattern.size + 1))[:, :DC.seq_len])
    state = dspark.init_state(CFG, DC, mini_params[model.DRAFTER])
    losses = []
    for _ in range(DC.steps):
        state, metrics = dspark.dspark_step(CFG, DC, state, mini_params, tokens)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.9 * losses[0], losses


def test_resume_is_bit_identical(adapted, mini_params, tmp_path):
    """2 steps, stop, resume to 3 == 3 straight steps (drafter, checkpointed optimizer state)."""
    straight_dir, straight, _ = adapted
    corpus = load_corpus().train
    dspark.adapt(CFG, mini_params, corpus, DC, tmp_path, log=lambda _: None, drafter=mini_params[model.DRAFTER],
                 until=2)
    resumed = dspark.adapt(CFG, mini_params, corpus, DC, tmp_path, log=lambda _: None, resume=True, until=3)
    for a, b in zip(_values(straight), _values(resumed)):
        np.testing.assert_array_equal(a, b)
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_drafter_checkpoint_round_trip(adapted, mini_params, tmp_path):
    out, params, _ = adapted
    assert checkpoint.latest_step(out) == 3
    _, drafter = checkpoint.restore_params(out, CFG, kind=checkpoint.DRAFTER_KIND)
    want = params[model.DRAFTER]
    assert jax.tree_util.tree_structure(drafter) == jax.tree_util.tree_structure(want)
    for a, b in zip(_values(drafter), _values(want)):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    merged = checkpoint.with_drafter(mini_params, drafter)
    assert jax.tree_util.tree_structure(merged) == jax.tree_util.tree_structure(mini_params)  # no retrace
    for a, b in zip(_values(merged), _values(params)):
        np.testing.assert_array_equal(a, b)

    with pytest.raises(ValueError, match="sliding_window"):
        checkpoint.restore_params(out, CFG.replace(sliding_window=8), kind=checkpoint.DRAFTER_KIND)
    with pytest.raises(ValueError, match="dspark_markov_rank"):
        checkpoint.restore_params(out, CFG.replace(dspark_markov_rank=8), kind=checkpoint.DRAFTER_KIND)
    with pytest.raises(ValueError, match="sliding_window"):  # a run holds one config
        checkpoint.save(out, 4, params=drafter, cfg=CFG.replace(sliding_window=8), kind=checkpoint.DRAFTER_KIND)
    with pytest.raises(ValueError, match="markov_embed"):  # the parameters must be the config's drafter
        checkpoint.save(tmp_path / "other", 1, params=drafter, cfg=CFG.replace(dspark_markov_rank=8),
                        kind=checkpoint.DRAFTER_KIND)
    full = tmp_path / "backbone"
    checkpoint.save(full, 1, params=mini_params, opt_state={"count": jnp.zeros((), jnp.int32)}, data_step=0,
                    rng=jax.random.PRNGKey(0), cfg=CFG)
    with pytest.raises(ValueError, match="full-model parameters"):
        checkpoint.restore_params(full, CFG, kind=checkpoint.DRAFTER_KIND)
    with pytest.raises(ValueError, match="full-model parameters"):  # refused before any step runs
        dspark.adapt(CFG, mini_params, load_corpus().train, DC, full, log=lambda _: None)


def test_bad_inputs_are_refused(mini_params, tmp_path, capsys):
    for field, value in (("anchors", 0), ("steps", 0), ("batch_size", -1), ("seq_len", 1), ("lr", 0.0),
                         ("log_every", 0), ("warmup", -1)):
        with pytest.raises(ValueError, match=f"DSparkTrainConfig.{field}={value}"):
            DSparkTrainConfig(**{field: value})
    with pytest.raises(ValueError, match="DSparkTrainConfig.anchors=8: .* at most seq_len − 1 = 7"):
        DSparkTrainConfig(seq_len=8, anchors=8)
    no_drafter = CFG.replace(num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match="num_nextn_predict_layers=0"):
        dspark.adapt(no_drafter, mini_params, load_corpus().train, DC, tmp_path / "x", log=lambda _: None)
    with pytest.raises(ValueError, match="num_nextn_predict_layers=0"):
        checkpoint.restore_params(tmp_path, no_drafter, kind=checkpoint.DRAFTER_KIND)
    with pytest.raises(ValueError, match="DSparkTrainConfig"):
        dspark.adapt(CFG, mini_params, load_corpus().train, {"steps": 3}, tmp_path / "x", log=lambda _: None)
    with pytest.raises(ValueError, match="does not exist"):
        checkpoint.restore_params(tmp_path / "missing", CFG, kind=checkpoint.DRAFTER_KIND)

    missing = tmp_path / "no_backbone"
    assert dspark.main(["--backbone", str(missing), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "--backbone" in err and str(missing) in err and "python -m train" in err
    assert dspark.main(["--backbone", str(tmp_path), "--anchors", "0"]) == 2
    assert "anchors=0" in capsys.readouterr().err

    flat = [(path, nnx.Param(jnp.zeros((3, 3))) if path == ("markov_embed",) else v)
            for path, v in nnx.to_flat_state(mini_params[model.DRAFTER])]
    with pytest.raises(ValueError, match="markov_embed"):
        checkpoint.with_drafter(mini_params, nnx.from_flat_state(flat))


def test_self_distillation_adapts_on_the_targets_rows_and_keeps_its_pool(mini_params, tmp_path, monkeypatch):
    """data="greedy": the pool is the target's continuations, saved in the run directory, the batches are its
    rows, and a resumed run reads the pool instead of generating it again."""
    dc = DSparkTrainConfig(**{**DC.__dict__, "data": "greedy", "distill_rows": 3, "distill_prompt": 24})
    seen = []
    real_step = dspark.dspark_step
    monkeypatch.setattr(dspark, "dspark_step", lambda cfg, dc, state, backbone, tokens: (
        seen.append(np.asarray(tokens)), real_step(cfg, dc, state, backbone, tokens))[1])
    corpus = load_corpus().train
    dspark.adapt(CFG, mini_params, corpus, dc, tmp_path, log=lambda _: None, drafter=mini_params[model.DRAFTER],
                 until=1)
    pool = np.load(tmp_path / dspark.POOL)
    assert pool.shape == (3, dc.seq_len)
    assert all(any(np.array_equal(row, p) for p in pool) for row in seen[0])

    def regenerate(*args, **kwargs):
        raise AssertionError("the saved pool was generated again")

    monkeypatch.setattr(dspark, "continuations", regenerate)
    dspark.adapt(CFG, mini_params, corpus, dc, tmp_path, log=lambda _: None, resume=True, until=2)
    assert all(any(np.array_equal(row, p) for p in pool) for row in seen[1])
    with pytest.raises(AssertionError, match="generated again"):  # a pool of another recipe is not reused
        dspark._pool(CFG, DSparkTrainConfig(**{**dc.__dict__, "data": "sampled"}), mini_params, corpus, tmp_path,
                     lambda _: None)
    with pytest.raises(ValueError, match="DSparkTrainConfig.data='web'"):
        DSparkTrainConfig(data="web")
    with pytest.raises(ValueError, match="distill_prompt=32"):
        DSparkTrainConfig(data="greedy", seq_len=32, distill_prompt=32)
    with pytest.raises(ValueError, match="distill_temperature=0.0"):
        DSparkTrainConfig(data="sampled", distill_temperature=0.0)


def test_a_drafter_of_three_stages_on_a_backbone_trained_with_one(mini_params, tmp_path):
    """The stage count is the drafter's: `with_stages` puts a fresh 3-stage drafter on the 1-stage backbone, its
    checkpoint stores the 3-stage config, and `restore_with_drafter` rebuilds exactly those params."""
    cfg3, params3 = dspark.with_stages(CFG, mini_params, 3, seed=0)
    assert cfg3.num_nextn_predict_layers == 3 and CFG.num_nextn_predict_layers == 1
    assert jax.tree_util.tree_structure(params3) == jax.tree_util.tree_structure(model.abstract_params(cfg3))
    given, got = _flat(mini_params), _flat(params3)
    for path, v in got.items():
        if path[0] != model.DRAFTER:
            np.testing.assert_array_equal(np.asarray(v.get_value()), np.asarray(given[path].get_value()))
    assert len(params3[model.DRAFTER]["stages"]) == 3

    backbone, drafter = tmp_path / "backbone", tmp_path / "drafter"
    checkpoint.save(backbone, 1, params=mini_params, opt_state={"count": jnp.zeros((), jnp.int32)}, data_step=0,
                    rng=jax.random.PRNGKey(0), cfg=CFG)
    checkpoint.save(drafter, 1, params=params3[model.DRAFTER], cfg=cfg3, kind=checkpoint.DRAFTER_KIND)
    cfg, params = checkpoint.restore_with_drafter(backbone, drafter)
    assert cfg == cfg3
    for a, b in zip(_values(params), _values(params3)):
        np.testing.assert_array_equal(a, b)

    with pytest.raises(ValueError, match="stages=0"):
        dspark.with_stages(CFG, mini_params, 0, seed=0)
    with pytest.raises(ValueError, match="with_drafter: .*stages"):  # a 3-stage drafter into 1-stage params
        checkpoint.with_drafter(mini_params, params3[model.DRAFTER])
    other = tmp_path / "other"
    checkpoint.save(other, 1, params=mini_params[model.DRAFTER], cfg=CFG.replace(sliding_window=8),
                    kind=checkpoint.DRAFTER_KIND)
    with pytest.raises(ValueError, match="sliding_window 16 vs 8"):  # only the stage count is the drafter's
        checkpoint.restore_with_drafter(backbone, other)
