"""The transformers release specd needs, checked when a model loads."""

from __future__ import annotations

import pytest

from specd.models import require_transformers


@pytest.mark.parametrize("version, ok", [("5.24.0", True), ("5.30.1", True), ("6.0.0.dev0", True),
                                          ("5.23.0", False), ("4.57.6", False)])
def test_transformers_that_ignore_the_cache_argument_are_refused(version, ok):
    """Before 5.24, models ignored `cache=` and a batch's answers came out as noise (seen on a GPU
    machine with 5.17): loading refuses those releases with the command that fixes it."""
    if ok:
        require_transformers(version)
    else:
        with pytest.raises(RuntimeError, match=r"transformers>=5\.24"):
            require_transformers(version)
