"""Argument checks shared by the reference and the kernels, and backend plumbing for `pallas_call`.

Kernels take plain arrays and `Stored` buffers, never model objects (DESIGN §4). Public boundaries raise ValueError
naming the field, the value and the fix (DESIGN §7).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu, triton as plt

from pallas_kernels.formats import INDEX, MAIN, WINDOW, QuantFormat
from pallas_kernels.stored import Stored

Array = jax.Array


# Where a kernel runs: "interpret" (the Pallas interpreter), "tpu_interpret" (the interpreter with TPU
# semantics, `pltpu.InterpretParams`: Mosaic's compiler params and memory model, on CPU), "triton" (GPU),
# "mosaic" (TPU).
TARGETS = ("interpret", "tpu_interpret", "triton", "mosaic")


def resolve_target(interpret: bool | None, kernel: str) -> str:
    """`interpret=True` → "interpret"; None → from the backend: the interpreter on CPU, Triton on GPU, Mosaic on
    TPU. Any other platform (or CPU with `interpret=False`) is refused by name: `impl="xla"` runs everywhere."""
    backend = jax.default_backend()
    if interpret or (interpret is None and backend == "cpu"):
        return "interpret"
    if backend in ("gpu", "cuda", "rocm"):
        return "triton"
    if backend == "tpu":
        return "mosaic"
    raise NotImplementedError(
        f"pallas_kernels.{kernel} compiles for GPU (Triton) and TPU (Mosaic) only; backend={backend!r}. "
        f"Use impl='xla' here, or interpret=True to run it in the Pallas interpreter.")


def pick_target(interpret: bool | None, target: str | None, kernel: str) -> str:
    """The lowering a kernel runs: `target` when named (one of `TARGETS`: e.g. "tpu_interpret" runs the TPU form
    under the interpreter on CPU), else `resolve_target(interpret, kernel)`."""
    if target is None:
        return resolve_target(interpret, kernel)
    if target not in TARGETS:
        raise ValueError(f"pallas_kernels.{kernel}: target={target!r}; use one of {TARGETS} or None (the platform's)")
    return target


def mosaic(target: str) -> bool:
    """Mosaic's block rule holds (compiled for TPU or interpreted with TPU semantics): each block's last two
    dims are multiples of (8, 128) or the whole array dim."""
    return target in ("mosaic", "tpu_interpret")


def interpret_arg(target: str):
    """`pallas_call(interpret=...)` of a target."""
    return {"interpret": True, "tpu_interpret": pltpu.InterpretParams()}.get(target, False)


def compiler_params(target: str, num_warps: int, grid_rank: int, num_stages: int = 2):
    """Triton params on GPU (they also select Triton over Mosaic GPU); Mosaic params on TPU, every grid axis
    parallel (each program writes its own output block)."""
    if target == "triton":
        return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    if target in ("mosaic", "tpu_interpret"):
        return pltpu.CompilerParams(dimension_semantics=("parallel",) * grid_rank)
    return None


def min_block(target: str) -> int:
    """Smallest block of rows: Triton's tensor-core dots need M, N, K ≥ 16; Mosaic a whole sublane tile (8);
    elsewhere 1."""
    return 16 if target == "triton" else 8 if mosaic(target) else 1


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


def _check_store(name: str, store: Stored, fmt: QuantFormat, b: int, d: int) -> None:
    """A per-row stored buffer `[B, rows, ·]` of `d`-feature entries in format `fmt` (packed or float)."""
    _need(isinstance(store, Stored), f"{name}: {type(store).__name__}; pass a pallas_kernels.stored.Stored")
    _need(store.fmt == fmt, f"{name}: entries in format {store.fmt.name!r}; this argument holds {fmt.name!r} entries")
    data = store.payload
    _need(data.ndim == 3 and data.shape[0] == b,
          f"{name}.payload.shape={data.shape}: expected [B={b}, rows, ...], one buffer per batch row")
    rows = data.shape[1]
    if not store.packed:
        _need(jnp.issubdtype(data.dtype, jnp.floating) and data.shape[2] == d,
              f"{name}: float storage {data.dtype}{list(data.shape)}; expected [B, rows, D={d}] floating")
        return
    width = fmt.payload_width(d)
    _need(data.dtype in (jnp.uint8, fmt.payload_dtype) and data.shape[2] == width,
          f"{name}.payload: {data.dtype}{list(data.shape)}; packed {fmt.name} payload must be "
          f"{jnp.dtype(fmt.payload_dtype).name} [B, rows, {width}] for D={d}")
    _need(store.scale.shape == (b, rows, d // fmt.block) and store.scale.dtype in (fmt.scale_dtype, jnp.uint8),
          f"{name}.scale: {store.scale.dtype}{list(store.scale.shape)}; expected {jnp.dtype(fmt.scale_dtype).name} "
          f"[B={b}, rows={rows}, D/{fmt.block}={d // fmt.block}]")


def _check_ids(name: str, idx: Array, b: int, s: int) -> None:
    _need(idx.ndim == 3 and idx.shape[:2] == (b, s) and jnp.issubdtype(idx.dtype, jnp.integer),
          f"{name}: {idx.dtype}{list(idx.shape)}; expected int32 [B={b}, S={s}, entries], −1 = skip")


def check_sparse_attention(q, sink, main: Stored, main_idx, window: Stored, window_idx) -> None:
    """Shapes and dtypes of `sparse_attention`'s arguments (see ops.sparse_attention)."""
    _need(q.ndim == 4, f"q.shape={q.shape}: expected [B, S, H, D]")
    b, s, h, d = q.shape
    _need(d % WINDOW.block == 0,
          f"q.shape[-1]={d}: the latent D must be a multiple of {WINDOW.block} (window scale block)")
    _need(sink.shape == (h,), f"sink.shape={sink.shape}: expected [H={h}], one sink logit per head")
    _check_store("main", main, MAIN, b, d)
    _check_store("window", window, WINDOW, b, d)
    _check_ids("main_idx", main_idx, b, s)
    _check_ids("window_idx", window_idx, b, s)


def check_indexer(q, w, ikey: Stored, visible, ids=None) -> None:
    """Shapes and dtypes of the indexer ops' arguments (see ops.indexer_scores / indexer_scores_gathered)."""
    _need(q.ndim == 4, f"q.shape={q.shape}: expected [B, S, Hi, Di]")
    b, s, hi, di = q.shape
    _need(di % INDEX.block == 0, f"q.shape[-1]={di}: the index head dim must be a multiple of {INDEX.block}")
    _need(w.shape == (b, s, hi), f"w.shape={w.shape}: expected [B, S, Hi]={(b, s, hi)}")
    _check_store("ikey", ikey, INDEX, b, di)
    _need(visible.shape == (b, s) and jnp.issubdtype(visible.dtype, jnp.integer),
          f"visible: {visible.dtype}{list(visible.shape)}; expected int32 [B={b}, S={s}] entry counts")
    if ids is not None:
        _check_ids("ids", ids, b, s)


def check_block_max(scores, block: int) -> None:
    _need(isinstance(block, int) and block >= 1 and scores.ndim == 3,
          f"block_max: scores.shape={scores.shape}, block={block!r}; expected [B, S, N] and an integer block ≥ 1")
