"""Checkpoints: the framework's own (`native`, orbax) and the released DeepSeek-V4.1 layout (`hf`)."""

from csa2.checkpoints.hf import dry_run, load_hf, read_hf, save_hf

__all__ = ["load_hf", "read_hf", "save_hf", "dry_run"]
