"""Measuring code behind the notebooks (`notebooks/*.ipynb`): each module is tested, each notebook only calls
and plots. `fast()` is the switch CI uses to execute every notebook at small sizes (`CSA2_FAST=1`)."""

import os


def fast() -> bool:
    """Whether the notebooks run at CI sizes: the environment variable `CSA2_FAST=1`."""
    return os.environ.get("CSA2_FAST", "0") == "1"
