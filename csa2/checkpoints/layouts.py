"""Open a checkpoint directory of either layout: the released one (`config.json` beside safetensors shards,
read by `hf.load_hf`) or the framework's own orbax run (`native`, one directory per saved step)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from csa2.checkpoints import hf, native
from csa2.config import ModelConfig


def is_released(path: str | os.PathLike) -> bool:
    """Whether `path` holds a checkpoint in the released layout (its `config.json`)."""
    return (Path(path) / hf.CONFIG).is_file()


def _no_step(path, step: int | None) -> None:
    if step is not None:
        raise ValueError(f"step={step}: {path} is a released checkpoint (one set of weights, no training steps); "
                         "leave the step out")


def load_config(path: str | os.PathLike, step: int | None = None) -> ModelConfig:
    """The model config of the checkpoint at `path` (a native run: the one stored with `step`, latest when None)."""
    if is_released(path):
        _no_step(path, step)
        return hf.read_config(path)
    return native.load_config(path, step)


def load(path: str | os.PathLike, cfg: ModelConfig | None = None, step: int | None = None) -> tuple[ModelConfig, Any]:
    """`(cfg, params)` of the checkpoint at `path` for inference, drafter included where it has one. `cfg` defaults
    to the stored config; a given one must agree with it on the released and variant fields (its runtime fields,
    such as the compute `dtype`, are the caller's)."""
    if is_released(path):
        _no_step(path, step)
        return hf.load_hf(path, cfg)
    return native.restore_params(path, cfg, step)
