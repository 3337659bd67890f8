"""Checkpoints shipped inside the package, in the released DeepSeek-V4.1 layout.

`bundled(name)` is the directory of one (`config.json`, safetensors shards and their index, `accuracy.json`
and the model card `README.md`); it loads with `load_hf` like any released checkpoint and is accepted by
`python -m infer --checkpoint` and `python -m infer.bench_spec --checkpoint`. Nothing is downloaded.

- `tiny-v41`: the `tiny` preset (the release's 40-layer schedule at d = 64, byte vocabulary) trained with the
  long-context recipe, with a DSpark drafter adapted on it (`python -m train.research_model` builds it;
  its card says how and what it measures).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).parent / "shipped"
NAMES = ("tiny-v41",)


def bundled(name: str = "tiny-v41") -> Path:
    """The directory of the shipped checkpoint `name` (one of `NAMES`)."""
    if name not in NAMES:
        raise ValueError(f"bundled: unknown checkpoint {name!r}; the package ships {NAMES}")
    path = ROOT / name
    if not (path / "config.json").is_file():
        raise ValueError(f"bundled({name!r}): {path} has no config.json; the package was installed without its "
                         "checkpoint files (install from the repository: pip install -e .)")
    return path
