"""Checkpoints: the framework's own (`native`, orbax), the released DeepSeek-V4.1 layout (`hf`), either of them by
directory (`layouts`) and the checkpoints the package ships (`bundled`)."""

from csa2.checkpoints.bundled import bundled
from csa2.checkpoints.hf import dry_run, load_hf, read_config, read_hf, save_hf

__all__ = ["bundled", "load_hf", "read_config", "read_hf", "save_hf", "dry_run"]
