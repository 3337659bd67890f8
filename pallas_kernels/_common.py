"""Argument checks shared by the oracles and the kernels, and backend plumbing for `pallas_call`.

Kernels take plain arrays only (DESIGN §4). Public boundaries raise ValueError naming the field,
the value and the fix (DESIGN §7).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plt

from pallas_kernels._formats import INDEX_BLOCK, MAIN_BLOCK, WINDOW_BLOCK

Array = jax.Array


def resolve_interpret(interpret: bool | None) -> bool:
    """`interpret=None` → True on CPU (the Pallas interpreter), False on GPU.

    The kernels gather rows with vector-indexed ref loads, which lower through Triton (GPU) but
    not through Mosaic (TPU needs scalar-prefetched ids and per-row DMAs), so a compiled TPU
    run is refused with a clear message instead of an obscure Mosaic error.
    """
    backend = jax.default_backend()
    if interpret is None:
        interpret = backend == "cpu"
    if not interpret and backend not in ("gpu", "cuda", "rocm"):
        raise NotImplementedError(
            f"pallas_kernels compiles for GPU (Triton) only; backend={backend!r}. Use impl='xla' "
            "here, or interpret=True to run the kernels in the Pallas interpreter.")
    return interpret


def compiler_params(interpret: bool, num_warps: int, num_stages: int = 2):
    """Triton compiler params on GPU (this also selects the Triton lowering over Mosaic GPU)."""
    return None if interpret else plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def min_block(interpret: bool) -> int:
    """Smallest dot operand dim: Triton's tensor-core dots need M, N, K ≥ 16; the interpreter needs 1."""
    return 1 if interpret else 16


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def pad_axis(x: Array, axis: int, size: int, value) -> Array:
    """x padded along `axis` to `size` with `value` (no-op when already that size)."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_store(name: str, data: Array, scale: Array | None, b: int, d: int, block: int,
                 payload: str, scale_dtypes: tuple) -> None:
    """A stored buffer `[B, rows, ·]`: packed (payload + scales) or float32 `[B, rows, D]` + None."""
    _need(data.ndim == 3 and data.shape[0] == b,
          f"{name}.shape={data.shape}: expected [B={b}, rows, ...], one buffer per batch row")
    rows = data.shape[1]
    if scale is None:
        _need(jnp.issubdtype(data.dtype, jnp.floating) and data.shape[2] == d,
              f"{name}: {data.dtype}{list(data.shape)} with {name}_scale=None; a float cache must be "
              f"[B, rows, D={d}] floating, or pass the packed payload with its scales")
        return
    width = d // 2 if payload == "e2m1" else d
    want = jnp.uint8 if payload == "e2m1" else jnp.float8_e4m3fn
    _need(data.dtype in (jnp.uint8, want) and data.shape[2] == width,
          f"{name}: {data.dtype}{list(data.shape)}; packed {payload} payload must be {jnp.dtype(want).name} "
          f"[B, rows, {width}] for D={d}")
    _need(scale.shape == (b, rows, d // block) and (scale.dtype in scale_dtypes or scale.dtype == jnp.uint8),
          f"{name}_scale: {scale.dtype}{list(scale.shape)}; expected {jnp.dtype(scale_dtypes[0]).name} "
          f"[B={b}, rows={rows}, D/{block}={d // block}]")


def check_sparse_attention(q, sink, main, main_scale, main_idx, window, window_scale, window_idx) -> None:
    """Shapes and dtypes of `sparse_attention`'s arguments (see ops.sparse_attention)."""
    _need(q.ndim == 4, f"q.shape={q.shape}: expected [B, S, H, D]")
    b, s, h, d = q.shape
    _need(d % 32 == 0, f"q.shape[-1]={d}: the latent D must be a multiple of 32 (window scale block)")
    _need(sink.shape == (h,), f"sink.shape={sink.shape}: expected [H={h}], one sink logit per head")
    _check_store("main", main, main_scale, b, d, MAIN_BLOCK, "e2m1", (jnp.float8_e4m3fn,))
    _check_store("window", window, window_scale, b, d, WINDOW_BLOCK, "e4m3", (jnp.float8_e8m0fnu,))
    for name, idx in (("main_idx", main_idx), ("window_idx", window_idx)):
        _need(idx.ndim == 3 and idx.shape[:2] == (b, s) and jnp.issubdtype(idx.dtype, jnp.integer),
              f"{name}: {idx.dtype}{list(idx.shape)}; expected int32 [B={b}, S={s}, entries], −1 = skip")


def check_indexer(q, w, ikey, ikey_scale, visible) -> None:
    """Shapes and dtypes of the indexer ops' shared arguments (see ops.indexer_scores)."""
    _need(q.ndim == 4, f"q.shape={q.shape}: expected [B, S, Hi, Di]")
    b, s, hi, di = q.shape
    _need(di % INDEX_BLOCK == 0, f"q.shape[-1]={di}: the index head dim must be a multiple of {INDEX_BLOCK}")
    _need(w.shape == (b, s, hi), f"w.shape={w.shape}: expected [B, S, Hi]={(b, s, hi)}")
    _check_store("ikey", ikey, ikey_scale, b, di, INDEX_BLOCK, "e2m1", (jnp.float8_e8m0fnu,))
    _need(visible.shape == (b, s) and jnp.issubdtype(visible.dtype, jnp.integer),
          f"visible: {visible.dtype}{list(visible.shape)}; expected int32 [B={b}, S={s}] entry counts")
