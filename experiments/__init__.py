"""Measuring code behind the notebooks (`notebooks/*.ipynb`): each module is tested, each notebook only calls
and plots. `fast()` is the switch CI uses to execute every notebook at small sizes (`CSA2_FAST=1`)."""

from train.longctx import fast_mode


def fast() -> bool:
    """Whether the notebooks run at CI sizes: the environment variable `CSA2_FAST=1` (the switch that also selects
    the fast research checkpoint, `train.longctx.fast_mode`)."""
    return fast_mode()
