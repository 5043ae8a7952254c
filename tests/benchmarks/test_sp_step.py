"""benchmarks/sp_step.py end to end on a tiny model in the 2-rank launch: both engines step, the
ratio is printed. It proves the code runs, not how fast it is (docs/results.md has the figure)."""
from __future__ import annotations

import contextlib
import io

from tests.ranks import multi_rank, ok

ARGS = ["--layers", "1", "--hidden", "64", "--vocab", "128", "--seq", "16", "--steps", "2", "--warmup", "1"]


@multi_rank(worlds=[2])
def sp_step_report() -> dict:
    import torch

    from benchmarks import sp_step

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        sp_step.main(ARGS)
    return {"stdout": text.getvalue() if torch.distributed.get_rank() == 0 else None}


def test_sp_step_prints_the_ratio(rank_results):
    out = ok(rank_results(2), sp_step_report)["stdout"]
    assert "SP / DP = " in out and out.count("RESULT ") == 1
