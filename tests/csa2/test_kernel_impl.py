"""`kernel_impl="pallas"` (interpreted on CPU) and `"dense"` give the outputs of the "xla" oracle (DESIGN §4).

The same parameters run through both impls: an attention stack of every role (SWA, Full,
candidate source, Reindex, Reuse) on a chunk and a decode step, then the whole model on a
prefill and decode steps, and the gradient of the training forward with the indexer loss (sparse
attention's own backward kernel; the indexer ops' gradient is the reference's, `ops._reference_gradient`).
Shapes stay tiny (the Pallas interpreter is slow), and the two impls
run in two threads: compiling dominates these tests and XLA compiles outside the GIL.
"""

from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from csa2 import model
from csa2.index_loss import IndexLoss
from csa2.layout import kv_stacks
from csa2.presets import preset
from csa2.state import init_state
from pallas_kernels import ops, reference
from tests.csa2.attention_stack import init_stack, run_stack

XLA = preset("mini")
B, CAP = 2, 64
# Rows out of step; 20 positions nearly fill the 21-slot rings and give the ratio-1 groups more visible
# entries (20) than index_topk (16), so selection by score matters.
PROMPT = (20, 13)


def _vec(*v):
    return jnp.asarray(v, jnp.int32)


# mini with a second ratio-2 KV source (layer 2): Global KV stacks ((1, 2), (4,)), so layers 2 and 3 read
# source 1 of a 2-source stack, whose entry ids are not the rows of the flat buffers the kernels read.
TWO_SOURCES = XLA.replace(kv_source_layer_ids=(1, 2, 4), index_source_layer_ids=(1, 2, 4, 6))


def _both_impls(run, xla=XLA, other="pallas"):
    """{"xla": run(xla), other: run(xla with kernel_impl=other)}, side by side."""
    with ThreadPoolExecutor(2) as pool:
        return dict(zip(("xla", other), pool.map(run, (xla, xla.replace(kernel_impl=other)))))


@pytest.mark.parametrize("fmt, quantize, base", [("fp4", True, XLA), ("float", False, XLA),
                                                 ("fp4", True, TWO_SOURCES)], ids=["fp4", "float", "fp4-stacked"])
def test_attention_stack_matches_xla(fmt, quantize, base):
    if base is TWO_SOURCES:
        assert kv_stacks(base) == ((1, 2), (4,))
    params = init_stack(base, jax.random.PRNGKey(0))
    h = jax.random.normal(jax.random.PRNGKey(1), (2, B, max(PROMPT), base.hidden_size), jnp.float32)

    def run(cfg):
        state = init_state(cfg, B, CAP, fmt)
        chunk, state = run_stack(cfg, params, state, h[0], _vec(0, 0), _vec(*PROMPT), quantize=quantize)
        # The decode step: one token per row after the prompt, in the same chunk bucket (one compile;
        # the model test runs real S = 1 decode steps), reading its window back from the ring.
        step, _ = run_stack(cfg, params, state, h[1], _vec(*PROMPT), _vec(1, 1), quantize=quantize)
        return chunk, step[:, :, :1]

    outs = _both_impls(run, base)
    for row, n in enumerate(PROMPT):  # padding positions of the chunk are not compared
        np.testing.assert_allclose(outs["pallas"][0][:, row, :n], outs["xla"][0][:, row, :n], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outs["pallas"][1], outs["xla"][1], rtol=1e-5, atol=1e-5)


def _prefill_and_decode(cfg, params):
    """Logits [B, 9, V] of a 12-token prefill and 8 decode steps."""
    prompt = jax.random.randint(jax.random.PRNGKey(2), (B, 12), 0, 256, jnp.int32)
    steps = jax.random.randint(jax.random.PRNGKey(3), (8, B), 0, 256, jnp.int32)
    # prefill / decode_step donate the state: each run starts from its own fresh one.
    logits, state, _ = model.prefill(cfg, params, init_state(cfg, B, CAP, "fp4"), prompt)
    seq = [logits]
    for tokens in steps:
        logits, state = model.decode_step(cfg, params, state, tokens)
        seq.append(logits)
    return jnp.stack(seq, 1)


@pytest.mark.parametrize("impl", ["pallas", "dense"])
def test_model_prefill_and_decode_match_xla(mini_params, impl):
    logits = _both_impls(lambda cfg: _prefill_and_decode(cfg, mini_params), other=impl)
    np.testing.assert_allclose(logits[impl], logits["xla"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", ["pallas", "dense"])
def test_forward_gradient_with_index_loss_matches_xla(mini_params, impl):
    """jax.grad through `forward(..., instrument=IndexLoss("sparse"))`: the kernels' custom VJPs (sparse attention's
    backward kernel), and the dense reads' autodiff, give the xla config's gradient, for every parameter, within
    1e-4 of its norm. (The reference's backward on the kernels' forward measured the same worst figures: the gap
    is the forward's.)"""
    tokens = jax.random.randint(jax.random.PRNGKey(4), (B, 10), 0, 256, jnp.int32)

    def run(cfg):
        def loss(p):
            logits, aux = model.forward(cfg, p, tokens, instrument=IndexLoss("sparse"))
            return jnp.sum(logits**2) + jnp.sum(aux["tap"]), aux["tap"]
        return jax.grad(loss, has_aux=True)(mini_params)

    out = _both_impls(run, other=impl)
    (g_other, kl_other), (g_xla, kl_xla) = out[impl], out["xla"]
    # The indexer loss is live on every index source (layers 1, 4, 6), so its gradient is exercised.
    index_sources = list(XLA.index_source_layer_ids)
    assert np.all(np.asarray(kl_xla)[index_sources] > 0)
    np.testing.assert_allclose(kl_other, kl_xla, rtol=1e-4, atol=1e-7)
    flat_p, flat_x = nnx.to_flat_state(g_other), nnx.to_flat_state(g_xla)
    assert [path for path, _ in flat_p] == [path for path, _ in flat_x]
    indexer_grads = 0
    for (path, a), (_, b) in zip(flat_p, flat_x):
        a, b = np.asarray(a.get_value(), np.float64), np.asarray(b.get_value(), np.float64)
        assert np.all(np.isfinite(a)), path
        scale = np.linalg.norm(b)
        assert np.linalg.norm(a - b) <= 1e-4 * scale, (path, np.linalg.norm(a - b), scale)
        indexer_grads += "indexer" in path and scale > 0
    assert indexer_grads > 0  # the indexer weights get their gradient from the KL loss alone


# ---------------------------------------------------------------------------------------------
# Planted mutants: a "pallas" backend that differs from the reference must fail the comparison above, by far
# more than its tolerance. The mutant backend is the reference with one change (the Pallas interpreter would
# only add minutes): every op of the table's "pallas" column is replaced (the `mutant` fixture: conftest).

def _dropped_sink(q, sink, main, main_idx, window, window_idx):
    """The sink left out of the softmax's denominator."""
    return reference.sparse_attention(q, jnp.full_like(sink, -jnp.inf), main, main_idx, window, window_idx)


def _window_without_its_newest_row(q, sink, main, main_idx, window, window_idx):
    """The window one row short at its top (t − W + 1 … t − 1: the token's own KV left out; oldest first)."""
    return reference.sparse_attention(q, sink, main, main_idx, window, window_idx.at[..., -1].set(-1))


@pytest.fixture(scope="module")
def xla_logits(mini_params):
    return np.asarray(_prefill_and_decode(XLA, mini_params))


@pytest.mark.parametrize("sparse_attention", [reference.sparse_attention, _dropped_sink,
                                              _window_without_its_newest_row],
                         ids=["control", "dropped_sink", "window_short"])
def test_mutant_backend_is_caught(mini_params, xla_logits, mutant, sparse_attention):
    for op, impls in ops.BACKENDS.items():
        mutant.setitem(impls, "pallas", sparse_attention if op == "sparse_attention" else impls["xla"])
    err = float(np.abs(np.asarray(_prefill_and_decode(XLA.replace(kernel_impl="pallas"), mini_params))
                       - xla_logits).max())
    print(f"\nbackend {sparse_attention.__name__}: max |Δ logits| {err:.2e}")
    if sparse_attention is reference.sparse_attention:  # the control: the harness itself changes nothing
        assert err == 0.0
    else:
        assert err > 100 * 1e-4
