"""Parity of csa2.rope against transformers' DeepSeek-V4 rotary (torch CPU, float32).

V4 and SPEC §7 coincide here: interleaved adjacent pairs on the trailing rope slice,
``main`` = plain θ=10000, ``compress`` = θ=160000 + YaRN with ``attention_factor`` forced
to 1.0 (no mscale), same correction-range/ramp formula (transformers' ``_compute_yarn_parameters``).
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers.models.deepseek_v4.modeling_deepseek_v4 as v4
from transformers import DeepseekV4Config

from csa2 import rope
from csa2.config import YarnScaling

YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}
OURS_YARN = YarnScaling(16.0, 65536, 32.0, 1.0)


def _rotary(head_dim, rope_dim):
    cfg = DeepseekV4Config(
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        head_dim=head_dim,
        qk_rope_head_dim=rope_dim,
        layer_types=["compressed_sparse_attention"],
        mlp_layer_types=["moe"],
        rope_parameters=dict(YARN),
    )
    return v4.DeepseekV4RotaryEmbedding(cfg)


def _ulp_distance(a, b):
    return np.abs(a.astype(np.float32).view(np.int32).astype(np.int64) - b.astype(np.float32).view(np.int32))


def _frequency_ulps(head_dim, rope_dim) -> tuple[int, int]:
    """Worst ulp distance of our main and compress frequencies from transformers'."""
    rotary = _rotary(head_dim, rope_dim)
    assert rotary.main_attention_scaling == 1.0 and rotary.compress_attention_scaling == 1.0
    main = _ulp_distance(rope.rope_frequencies(rope_dim, 10000.0), rotary.main_inv_freq.numpy()).max()
    compress = rope.rope_frequencies(rope_dim, 160000.0, OURS_YARN)
    return int(main), int(_ulp_distance(compress, rotary.compress_inv_freq.numpy()).max())


@pytest.mark.parametrize("head_dim,rope_dim", [(512, 64), (32, 8), (64, 16)])
def test_frequencies_match(head_dim, rope_dim):
    # transformers evaluates in float32 torch, we round a float64 result: a couple of ulp apart.
    main, compress = _frequency_ulps(head_dim, rope_dim)
    assert main <= 1
    assert compress <= 2


def _reference(rotary, x, pos, layer_type, inverse):
    cos, sin = rotary(x, position_ids=pos, layer_type=layer_type)
    return v4.apply_rotary_pos_emb(x, cos, -sin if inverse else sin, unsqueeze_dim=2).numpy()


def _apply_errors(layer_type, inverse) -> dict:
    """Our rotation against transformers' on x [B, S, H, D] with 32 pass-through + 64 rope channels: whether the
    pass-through channels are untouched, max |Δ| with the same frequencies on both sides, and end to end."""
    rotary = _rotary(512, 64)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 3, 96, generator=gen)  # [B, S, H, D]: 32 pass-through + 64 rope channels
    x_j = jnp.asarray(x.numpy())

    # Same frequencies on both sides: the rotation itself must agree at any position (up to 2^20).
    pos = torch.tensor([[0, 1, 2, 127, 4096, 65535], [7, 300, 1 << 16, 1 << 18, 1 << 19, (1 << 20) - 1]])
    hf_freqs = getattr(rotary, f"{layer_type}_inv_freq").numpy()
    ours = np.asarray(rope.apply_rope(x_j, jnp.asarray(pos.numpy(), jnp.int32)[:, :, None], hf_freqs, inverse=inverse))
    out = {"pass_through": np.array_equal(ours[..., :32], x.numpy()[..., :32]),
           "same_freqs": float(np.abs(ours - _reference(rotary, x, pos, layer_type, inverse)).max())}

    # End to end with our own frequencies: the ulp-level frequency difference turns into an angle
    # error growing with the position (~pos * 1e-8 rad), so compare at moderate positions.
    pos = torch.tensor([[0, 1, 2, 127, 1000, 4095], [7, 300, 511, 2048, 3000, 4000]])
    freqs = (rope.rope_frequencies(64, 10000.0) if layer_type == "main"
             else rope.rope_frequencies(64, 160000.0, OURS_YARN))
    ours = np.asarray(rope.apply_rope(x_j, jnp.asarray(pos.numpy(), jnp.int32)[:, :, None], freqs, inverse=inverse))
    out["end_to_end"] = float(np.abs(ours - _reference(rotary, x, pos, layer_type, inverse)).max())
    return out


@pytest.mark.parametrize("layer_type", ["main", "compress"])
@pytest.mark.parametrize("inverse", [False, True])
def test_apply_matches(layer_type, inverse):
    err = _apply_errors(layer_type, inverse)
    assert err["pass_through"]
    assert err["same_freqs"] <= 1e-5, err
    assert err["end_to_end"] <= 3e-4, err


# ---------------------------------------------------------------------------------------------
# Planted mutants: each must make the comparison fail, by far more than its tolerance (the `mutant` fixture: conftest)

def _split_halves(apply_rope):
    """RoPE on the pairs (r_i, r_{i+n}) of the rope slice r (the split-halves layout) instead of adjacent pairs:
    our rotation applied to the slice reordered so that those pairs sit side by side, then ordered back."""

    def mutant(x, positions, freqs, *, inverse=False):
        n, d = freqs.shape[-1], x.shape[-1]
        order = np.arange(d)
        order[d - 2 * n:] = d - 2 * n + np.stack([np.arange(n), n + np.arange(n)], -1).reshape(-1)
        return apply_rope(x[..., order], positions, freqs, inverse=inverse)[..., np.argsort(order)]

    return mutant


def test_mutant_rope_on_split_halves_is_caught(mutant):
    mutant.setattr(rope, "apply_rope", _split_halves(rope.apply_rope))
    for layer_type in ("main", "compress"):
        err = _apply_errors(layer_type, inverse=False)
        print(f"\nmutant split halves, {layer_type}: {err}")
        assert err["pass_through"]  # only the pairing is wrong
        assert err["same_freqs"] > 100 * 1e-5 and err["end_to_end"] > 100 * 3e-4, err


def test_mutant_compress_frequencies_without_yarn_are_caught(mutant):
    frequencies = rope.rope_frequencies
    mutant.setattr(rope, "rope_frequencies", lambda rope_dim, base, yarn=None: frequencies(rope_dim, base))
    main, compress = _frequency_ulps(512, 64)
    err = _apply_errors("compress", inverse=False)
    print(f"\nmutant YaRN dropped: compress frequencies {compress} ulp off, main {main}; rotation {err}")
    assert main <= 1 and compress > 100 * 2  # only the YaRN frequencies move
    assert err["same_freqs"] <= 1e-5 and err["end_to_end"] > 100 * 3e-4, err
