"""A module's `python -m MODULE --help` text, run in this process: the same `__main__` code path
and argument parser as the command, without a second interpreter importing torch again (a
subprocess per script cost seconds of the suite each)."""
from __future__ import annotations

import contextlib
import io
import runpy
import sys

import pytest


def help_text(module: str) -> str:
    """What `python -m module --help` prints; fails the test unless it exits with status 0."""
    out = io.StringIO()
    argv = sys.argv
    sys.argv = [module, "--help"]
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
            runpy.run_module(module, run_name="__main__", alter_sys=False)
    finally:
        sys.argv = argv
    assert exit_.value.code in (0, None), f"python -m {module} --help exited with {exit_.value.code}"
    return out.getvalue()
