"""The DSpark drafter (`csa2.model.draft`, SPEC §12) against an independent numpy oracle
(`tests/parity/dspark_oracle.py`, float64, written from the SPEC, importing nothing from csa2), planted mutants
the oracle must catch, and the released-layout orientation of the drafter's tensors.

How the oracle gets its inputs, independently of csa2's drafter path:
- weights: csa2's parameter pytree (the drafter, the backbone's embedding and LM head), as float64 numpy;
- target features: a spy on `csa2.stack.layer` / `csa2.stack.site_input` records, during the one prefill, the
  streams X [B, S, n, d] each layer hands its attention site (after Engram: exactly what `site_input` gets),
  through `jax.debug.callback`; the oracle takes their per-token stream mean itself. csa2's own feature route
  (`csa2.stack._collect` → `out.features` → `dspark.write_context` → `State.draft`) is never read: the oracle
  builds every stage's context window from the recorded streams, so a wrong collection or a wrong window
  write is caught as a difference in the draft;
- Markov inputs: the proposal's own tokens (and greedy argmax of the oracle's logits must give them back).

The parameters are random, with every "neutral" initial value (norm weights 1, sinks 0, mHC base 0 / scale 1,
router bias 0) replaced by a random one, so that mixing up two norms, dropping a sink or letting the router bias
into the weights would show; the Markov and confidence heads get a larger scale so both terms of each head
matter. `mini` has one draft stage; the tests use two, so the per-stage context windows (mutant d) and the
`mtp.0` / `mtp.{last}` split of the released names are exercised.

Tolerance. csa2 runs in float32 and the oracle in float64; the FP8 (e4m3, UE8M0 per 32) window storage is the
only discontinuity. Measured: max |Δ logits| ≈ 3e-7 of max |logit| (≈ 1.4) and max |Δ confidence| ≈ 2e-7, so
TOL = 1e-5 (relative to the largest logit; absolute for confidences) leaves ~30× headroom, on every element.
A float32 ulp could only matter if an FP8 payload sat on a rounding midpoint (then one latent element moves by
an e4m3 step and the logits by ~1e-3); the oracle records how close its nearest rounding decision came
(`oracle.MARGINS`, in e4m3 steps; float32 noise is ~1e-5 of a step): 1.7e-4 here, and a failure message
reports it, so such a flip would be told apart from a bug. The mutants miss by more than 100 × TOL.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from csa2 import dspark, model, stack
from csa2.checkpoints import hf, load_hf, save_hf
from csa2.checkpoints.shards import Shards, write_shards
from csa2.norm import rms_norm
from csa2.presets import preset
from csa2.state import init_state
from tests.parity import dspark_oracle as oracle

CFG = preset("mini").replace(num_nextn_predict_layers=2)
TOL = 1e-5
B, S = 2, 20
N_VALID = (20, 13)  # row 1's window [L−W, L−1] reaches below position 0 (W = 16)
ANCHORS = (7, 100)


def random_params(cfg, seed: int):
    """Random parameters in `init_params(cfg)`'s structure (no compile), no neutral values left (module doc)."""
    rng = np.random.default_rng(seed)

    def value(name: str, shape) -> np.ndarray:
        n = rng.standard_normal(shape)
        if name.endswith("norm") or name in ("q_weight", "k_weight"):  # RMSNorm weights
            x = 1.0 + 0.2 * n
        elif name == "scale":  # mHC a0, a1, a2
            x = 1.0 + 0.2 * n
        elif name == "sink":
            x = n
        elif name in ("base", "bias", "bias_vl"):
            x = (0.5 if name == "base" else 0.1) * n
        elif name in ("markov_embed", "markov_head"):
            x = 0.3 * n
        elif name == "confidence":
            x = 0.5 * n
        else:
            x = 0.05 * n
        return x.astype(np.float32)

    def fill(node: dict) -> dict:
        return {k: fill(v) if isinstance(v, dict) else value(str(k), v.shape) for k, v in node.items()}

    return hf.as_params(cfg, fill(nnx.to_pure_dict(model.abstract_params(cfg))))


def as_numpy(tree, dtype=np.float64):
    return jax.tree.map(lambda a: np.asarray(a, dtype), nnx.to_pure_dict(tree))


@dataclasses.dataclass
class Setup:
    params: nnx.State
    tokens: jax.Array
    n_valid: jax.Array
    anchor: jax.Array
    state: object  # the prefilled state (draft reads it, never donates it)
    p: dict  # float64 numpy drafter params, stages as a list
    embed: np.ndarray
    head: np.ndarray
    recorded: dict  # {layer: X [B, S, n, d]} the spy's attention-site inputs
    hidden: list  # the oracle's h [γ, d] per row
    margin: float  # the oracle's nearest FP8 rounding decision, in e4m3 steps (or log2 units for a scale)


def spy_attention_inputs(monkeypatch) -> dict:
    """Record {layer: X [B, S, n, d]}, the streams each layer's attention site collapses (module doc)."""
    recorded, current = {}, [None]
    layer, site_input = stack.layer, stack.site_input

    def spy_layer(cfg, spec, p, flow, ctx, index, slot, enter=None):
        current[0] = index  # the next site_input is this layer's attention site
        return layer(cfg, spec, p, flow, ctx, index, slot, enter)

    def spy_site(cfg, hc, norm, X, pre_prev):
        if current[0] is not None:
            jax.debug.callback(lambda i, x: recorded.__setitem__(int(i), np.asarray(x)), current[0], X)
            current[0] = None
        return site_input(cfg, hc, norm, X, pre_prev)

    monkeypatch.setattr(stack, "layer", spy_layer)
    monkeypatch.setattr(stack, "site_input", spy_site)
    return recorded


def run_prefill(params, tokens, n_valid):
    state = init_state(CFG, B, 64, "float")
    _, state, _ = model.prefill(CFG, params, state, tokens, n_valid, replay=model.EXACT)
    jax.effects_barrier()
    return state


def run_draft(setup: Setup, state=None):
    return model.draft(CFG, setup.params, setup.state if state is None else state, setup.anchor,
                       jax.random.PRNGKey(0))


def oracle_hidden(p, embed, recorded, position_offset=0) -> list:
    """The oracle's h [γ, d] of each row, from the recorded attention-site inputs of the target layers."""
    feats = np.stack([recorded[layer].astype(np.float64).mean(axis=-2) for layer in CFG.dspark_target_layer_ids],
                     axis=2)  # [B, S, n_t, d], concatenated in layer order by `oracle.context`
    return [oracle.draft_hidden(CFG, p, embed, oracle.context(CFG, p, feats[b]), ANCHORS[b], N_VALID[b],
                                position_offset) for b in range(B)]


@pytest.fixture(scope="module")
def setup():
    jax.clear_caches()  # the spy and the mutants need this module's programs traced here, not reused
    params = random_params(CFG, 0)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 256, (B, S)), jnp.int32)
    n_valid = jnp.asarray(N_VALID, jnp.int32)
    with pytest.MonkeyPatch.context() as mp:
        recorded = spy_attention_inputs(mp)
        state = run_prefill(params, tokens, n_valid)
    jax.clear_caches()  # drop the spied prefill
    assert set(CFG.dspark_target_layer_ids) <= set(recorded), f"the spy saw layers {sorted(recorded)}"
    tree = as_numpy(params)
    p = tree["drafter"]
    p["stages"] = [p["stages"][i] for i in range(CFG.num_nextn_predict_layers)]
    oracle.MARGINS.clear()
    hidden = oracle_hidden(p, tree["embed"], recorded)
    margin = min(oracle.MARGINS)
    return Setup(params, tokens, n_valid, jnp.asarray(ANCHORS, jnp.int32), state, p, tree["embed"], tree["head"],
                 recorded, hidden, margin)


def errors(setup: Setup, prop, hidden=None) -> dict:
    """The proposal against the oracle: max |Δ logits| / max |oracle logit|, max |Δ confidence|, and whether the
    proposal's tokens are the argmax of the oracle's logits (Markov inputs = the proposal's own tokens)."""
    hidden = setup.hidden if hidden is None else hidden
    tokens = np.asarray(prop.tokens)
    got_logits, got_conf = np.asarray(prop.logits, np.float64), np.asarray(prop.confidence, np.float64)
    out = {"logits": 0.0, "conf": 0.0, "tokens": True}
    for b in range(B):
        prev = np.concatenate([[ANCHORS[b]], tokens[b, :-1]])
        logits, conf = oracle.heads(CFG, setup.p, setup.head, hidden[b], prev)
        out["logits"] = max(out["logits"], float(np.abs(got_logits[b] - logits).max() / np.abs(logits).max()))
        out["conf"] = max(out["conf"], float(np.abs(got_conf[b] - conf).max()))
        out["tokens"] &= bool((logits.argmax(-1) == tokens[b]).all())
    return out


def agrees(err: dict) -> bool:
    return err["logits"] <= TOL and err["conf"] <= TOL and err["tokens"]


# ---------------------------------------------------------------------------------------------
# The drafter against the oracle

def test_draft_matches_the_numpy_oracle(setup):
    prop = run_draft(setup)
    err = errors(setup, prop)
    print(f"\ncsa2 vs oracle: {err}; nearest FP8 rounding decision {setup.margin:.2e} steps")
    assert prop.logits.shape == (B, CFG.dspark_block_size, CFG.vocab_size)
    assert prop.confidence.shape == (B, CFG.dspark_block_size)
    assert agrees(err), f"{err}; nearest FP8 rounding midpoint in the oracle: {setup.margin:.2e} e4m3 steps"


def test_training_blocks_match_the_numpy_oracle(setup):
    """`dspark.anchored` (training: teacher-forced Markov inputs, many blocks per row) on the spy's features:
    block a is the inference block of a state of length a with C = tokens[a] (SPEC §12, same geometry)."""
    anchors = np.array([[0, 3, 15], [1, 12, 12]])  # a = 0: no context at all; row 1 is valid up to 13
    feats = np.stack([setup.recorded[layer].mean(axis=-2) for layer in CFG.dspark_target_layer_ids], axis=2)
    run = jax.jit(lambda p, f, t, a: dspark.anchored(CFG, p, f, t, a, quantize=True))
    logits, conf = run(nnx.to_pure_dict(setup.params), jnp.asarray(feats), setup.tokens, jnp.asarray(anchors))
    tokens, gamma = np.asarray(setup.tokens), CFG.dspark_block_size
    worst = {"logits": 0.0, "conf": 0.0}
    for b in range(B):
        feats64 = np.stack([setup.recorded[layer].astype(np.float64).mean(axis=-2)[b]
                            for layer in CFG.dspark_target_layer_ids], axis=1)
        ctx = oracle.context(CFG, setup.p, feats64)
        for j, a in enumerate(anchors[b]):
            h = oracle.draft_hidden(CFG, setup.p, setup.embed, ctx, tokens[b, a], a)
            want_logits, want_conf = oracle.heads(CFG, setup.p, setup.head, h, tokens[b, a:a + gamma])
            worst["logits"] = max(worst["logits"],
                                  float(np.abs(np.asarray(logits[b, j], np.float64) - want_logits).max()
                                        / np.abs(want_logits).max()))
            worst["conf"] = max(worst["conf"], float(np.abs(np.asarray(conf[b, j], np.float64) - want_conf).max()))
    print(f"\nanchored vs oracle: {worst}")
    assert worst["logits"] <= TOL and worst["conf"] <= TOL, worst


# ---------------------------------------------------------------------------------------------
# Planted mutants: each must make the comparison fail, by far more than TOL (the `mutant` fixture: conftest)

def assert_caught(err: dict, what: str) -> None:
    print(f"\nmutant {what}: {err}")
    assert not agrees(err), f"the oracle did not catch {what}: {err}"
    assert max(err["logits"], err["conf"]) > 100 * TOL, f"{what} caught only marginally: {err}"


def test_mutant_block_positions_off_by_one_is_caught(setup, mutant):
    hidden = dspark.hidden
    mutant.setattr(dspark, "hidden", lambda cfg, p, embed, block, positions, *a, **k:
                   hidden(cfg, p, embed, block, positions + 1, *a, **k))  # the block at L+1 … L+γ
    prop = run_draft(setup)
    assert_caught(errors(setup, prop), "(a) block at L+1 … L+γ")
    # Positive control: the oracle with its block moved by one reproduces the mutant.
    assert agrees(errors(setup, prop, oracle_hidden(setup.p, setup.embed, setup.recorded, position_offset=1)))


def test_mutant_normed_h_in_the_confidence_head_is_caught(setup, mutant):
    heads = dspark.heads
    mutant.setattr(dspark, "heads", lambda cfg, p, U, h, prev:
                   heads(cfg, p, U, rms_norm(h, p["norm"], cfg.rms_norm_eps), prev))
    err = errors(setup, run_draft(setup))
    assert_caught(err, "(b) normed h in the confidence head")
    assert err["logits"] <= TOL  # only the confidences move


def test_mutant_target_layer_outputs_as_features_is_caught(setup, mutant):
    layer = stack.layer

    def output_features(cfg, spec, p, flow, ctx, index, slot, enter=None):
        out, y = layer(cfg, spec, p, flow, ctx, index, slot, enter)
        if flow.features is not None:  # collect the layer's output streams instead of its attention input
            out = out.replace(features=stack._collect(cfg, flow.features, out.X, index))
        return out, y

    mutant.setattr(stack, "layer", output_features)
    state = run_prefill(setup.params, setup.tokens, setup.n_valid)
    assert_caught(errors(setup, run_draft(setup, state)), "(c) output features of the target layers")


def test_mutant_stages_sharing_stage_0s_window_is_caught(setup, mutant):
    stage = dspark._stage
    mutant.setattr(dspark, "_stage", lambda ring, i: stage(ring, 0))
    assert_caught(errors(setup, run_draft(setup)), "(d) every stage reads stage 0's window")


# ---------------------------------------------------------------------------------------------
# Released layout: nn.Linear [out, in] tensors land transposed in csa2's x @ w orientation

def test_released_drafter_tensors_load_in_the_right_orientation(setup, tmp_path):
    d, v, r = CFG.hidden_size, CFG.vocab_size, CFG.dspark_markov_rank
    last = f"mtp.{CFG.num_nextn_predict_layers - 1}"
    n_t, dh, e = len(CFG.dspark_target_layer_ids), CFG.head_dim, CFG.dspark_n_routed_experts
    hand = {  # released name → (shape [out, in], csa2 path, how the parameter relates to it)
        "mtp.0.main_proj.weight": ((d, n_t * d), ("main_proj",), "T"),
        "mtp.0.main_norm.weight": ((d,), ("main_norm",), "="),
        f"{last}.markov_head.embed.weight": ((v, r), ("markov_embed",), "="),
        f"{last}.markov_head.head.weight": ((v, r), ("markov_head",), "T"),
        f"{last}.confidence_head.proj.weight": ((1, d + r), ("confidence",), "row"),
        f"{last}.norm.weight": ((d,), ("norm",), "="),
        f"{last}.attn.wkv.weight": ((dh, d), ("stages", 1, "attn", "wkv"), "T"),
        "mtp.0.ffn.gate.weight": ((e, d), ("stages", 0, "moe", "router"), "T"),
    }
    src, dst = tmp_path / "saved", tmp_path / "hand"
    save_hf(setup.params, CFG, src, formats="float")
    store = Shards(src)
    tensors = {name: np.array(store.read(name)) for name in store.names()}
    for tag, (name, (shape, _, _)) in enumerate(hand.items(), start=1):
        assert tensors[name].shape == shape, (name, tensors[name].shape)
        # Distinct, float32-exact values, different in every tensor: any transpose or swap shows.
        tensors[name] = (tag * 100_000 + np.arange(np.prod(shape))).reshape(shape).astype(np.float32)
    write_shards(dst, sorted(tensors.items()))
    (dst / hf.CONFIG).write_text((src / hf.CONFIG).read_text())

    _, loaded = load_hf(dst, CFG)
    drafter = as_numpy(loaded, np.float32)["drafter"]
    for name, (shape, path, how) in hand.items():
        got = drafter
        for key in path:
            got = got[key]
        want = {"T": tensors[name].T, "=": tensors[name], "row": tensors[name].reshape(-1)}[how]
        assert got.shape == want.shape and np.array_equal(got, want), name
    # e.g. W2: csa2's markov_head [r, V] is the release's markov_head.head.weight [V, r] transposed.
    assert drafter["markov_head"].shape == (r, v)
