"""The model's two hooks (`csa2.hooks`), used from outside the core: a new read policy and a new tap, each
written here, in a test, touching no file of `csa2`."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from csa2 import model
from csa2.hooks import Instrument, Joined
from csa2.indexer import select_topk
from csa2.layout import layer_plan
from csa2.presets import preset
from research.probe import Probes

MINI = preset("mini")
S = 32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RandomK(Instrument):
    """Every Global-reading layer reads `k` visible entries drawn at random per query (its own draw per layer)."""

    k: int = dataclasses.field(metadata=dict(static=True))
    seed: int = dataclasses.field(metadata=dict(static=True))

    def width(self, cfg):
        return self.k

    def read(self, cfg, sight):
        _, visible = sight.dense_ids()  # [B, S, N]
        key = jax.random.fold_in(jax.random.PRNGKey(self.seed), sight.layer)
        return select_topk(jax.random.uniform(key, visible.shape), visible, self.k)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WindowCount(Instrument):
    """Taps how many window entries each query read `[B, S]`."""

    def tap(self, cfg, sight, read):
        return jnp.sum(sight.window_idx >= 0, axis=-1)


@pytest.fixture(scope="module")
def tokens():
    return jnp.asarray(np.random.default_rng(11).integers(0, 256, (2, S)), jnp.int32)


def test_a_new_read_policy_plugs_in_without_the_core(mini_params, tokens):
    k = 5
    logits, aux = model.forward(MINI, mini_params, tokens, qat=True, instrument=Joined(RandomK(k, seed=3), Probes()))
    plain, _ = model.forward(MINI, mini_params, tokens, qat=True)
    read = np.asarray(aux["tap"].topk)  # [L, B, S, k]: what each layer read
    for spec in layer_plan(MINI):
        if spec.role == "swa":
            assert (read[spec.index] == -1).all()
            continue
        visible = (np.arange(S) + 1) // spec.ratio
        ids = read[spec.index]
        np.testing.assert_array_equal(np.sum(ids >= 0, axis=-1), np.minimum(visible, k)[None].repeat(2, 0))
        assert (ids < visible[None, :, None]).all()  # only visible entries, and distinct ones
        assert all(len(set(row[row >= 0])) == np.sum(row >= 0) for row in ids.reshape(-1, k))
    reader = [s.index for s in layer_plan(MINI) if s.role != "swa"]
    assert not np.array_equal(read[reader[0]], read[reader[1]]), "each layer draws its own"
    assert not np.allclose(logits, plain)  # the reads changed the run


def test_a_new_tap_records_what_the_layer_saw(mini_params, tokens):
    logits, aux = model.forward(MINI, mini_params, tokens, instrument=WindowCount())
    plain, _ = model.forward(MINI, mini_params, tokens)
    np.testing.assert_array_equal(logits, plain)  # tapping changes nothing
    counts = np.asarray(aux["tap"])  # [L, B, S]
    want = np.minimum(np.arange(S) + 1, MINI.sliding_window)
    np.testing.assert_array_equal(counts, np.broadcast_to(want, counts.shape))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OwnPerHead(Instrument):
    """Every head reads the layer's own top-k, handed over as one set per head."""

    def heads(self, cfg):
        return cfg.num_attention_heads

    def read(self, cfg, sight):
        topk = sight.bus.topk
        return jnp.broadcast_to(topk[:, :, None, :], topk.shape[:2] + (cfg.num_attention_heads, topk.shape[-1]))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RandomPerHead(Instrument):
    """Every head of a Global-reading layer reads `k` visible entries of its own random draw."""

    k: int = dataclasses.field(metadata=dict(static=True))

    def width(self, cfg):
        return self.k

    def heads(self, cfg):
        return cfg.num_attention_heads

    def read(self, cfg, sight):
        _, visible = sight.dense_ids()  # [B, S, N]
        h = cfg.num_attention_heads
        draw = jax.random.uniform(jax.random.fold_in(jax.random.PRNGKey(5), sight.layer), visible.shape[:2] + (h,)
                                  + visible.shape[2:])
        return select_topk(draw, jnp.broadcast_to(visible[:, :, None], draw.shape), self.k)


def test_per_head_reads_plug_in_and_attend_head_by_head(mini_params, tokens):
    """One read set per head (`Instrument.heads`): when every head reads the shared top-k the run is the plain one;
    when each draws its own, each layer records `[B, S, H, k]` (−1 on SWA layers) and the run changes."""
    plain, _ = model.forward(MINI, mini_params, tokens, qat=True)
    same, aux = model.forward(MINI, mini_params, tokens, qat=True, instrument=Joined(OwnPerHead(), Probes()))
    np.testing.assert_allclose(same, plain, rtol=1e-6, atol=1e-6)
    h, k = MINI.num_attention_heads, 5
    logits, aux = model.forward(MINI, mini_params, tokens, qat=True, instrument=Joined(RandomPerHead(k), Probes()))
    read = np.asarray(aux["tap"].topk)
    assert read.shape == (MINI.num_hidden_layers, 2, S, h, k)
    for spec in layer_plan(MINI):
        ids = read[spec.index]
        if spec.role == "swa":
            assert (ids == -1).all()
            continue
        visible = (np.arange(S) + 1) // spec.ratio
        np.testing.assert_array_equal(np.sum(ids >= 0, axis=-1), np.minimum(visible, k)[None, :, None].repeat(2, 0)
                                      .repeat(h, 2))
        assert not np.array_equal(ids[:, :, 0], ids[:, :, 1]), "each head draws its own"
    assert not np.allclose(logits, plain)
