"""The OpenMP defaults reach libgomp only if they are set before torch loads."""

from __future__ import annotations

import subprocess
import sys

from specd.openmp import OPENMP_DEFAULTS, apply_openmp_defaults


def test_defaults_fill_only_what_the_operator_left_unset():
    environ = {"OMP_WAIT_POLICY": "PASSIVE", "PATH": "/bin"}
    applied = apply_openmp_defaults(environ)
    assert environ["OMP_WAIT_POLICY"] == "PASSIVE"  # the operator's choice stands
    assert environ["GOMP_SPINCOUNT"] == OPENMP_DEFAULTS["GOMP_SPINCOUNT"]
    assert applied == {"GOMP_SPINCOUNT": OPENMP_DEFAULTS["GOMP_SPINCOUNT"]}
    assert apply_openmp_defaults(environ) == {}


def test_the_cli_sets_them_before_torch_is_imported():
    """specd.cli's main() applies the defaults first; importing the module must not load torch."""
    code = ("import os, sys; import specd.cli; loaded = 'torch' in sys.modules; "
            "from specd.openmp import apply_openmp_defaults; apply_openmp_defaults(); "
            "import torch; print(loaded, os.environ['OMP_WAIT_POLICY'])")
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout.split()
    assert out == ["False", "ACTIVE"]
