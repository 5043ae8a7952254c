"""The planner's update and loss terms against what a whole engine step allocates in them
(benchmarks/vocab_memory.py's counter), at two vocabulary sizes: equal within 10%, and flat in V."""
import pytest

from tests.ranks import multi_rank, ok

VOCABS = (1024, 8192)


@multi_rank(worlds=[1])
def vocab_terms() -> dict:
    from benchmarks.vocab_memory import measure

    # chunks below the largest slice (V x 32) and below the logits (V x 31 positions) at both sizes
    return {f"{opt}/{v}": measure(v, opt, hidden=32, layers=1, seq=32, update_chunk=4096, loss_chunk=8192)
            for opt in ("sgd", "adalomo") for v in VOCABS}


@pytest.mark.parametrize("world", [1])  # the launch it reads (tests/conftest.py groups the tests by it)
@pytest.mark.parametrize("opt", ["sgd", "adalomo"])
def test_update_and_loss_terms_are_the_planners_and_flat_in_the_vocabulary(rank_results, opt, world):
    r = ok(rank_results(world), vocab_terms)
    rows = [r[f"{opt}/{v}"] for v in VOCABS]
    for row in rows:
        assert row["update"] == pytest.approx(row["planner_update"], rel=0.10), row
        assert row["loss"] == pytest.approx(row["planner_loss"], rel=0.10), row
    # Flat in V: the chunk's temporaries; AdaLomo's statistics beside them are a row and a column
    # of its largest matrix (V + h floats, 12 bytes each: the planner's term), not V x h.
    stats = [12 * (v + 32) if opt == "adalomo" else 0 for v in VOCABS]
    small, large = rows
    assert large["update"] - stats[1] == pytest.approx(small["update"] - stats[0], rel=0.10)
    assert large["loss"] == pytest.approx(small["loss"], rel=0.10)


def test_the_docs_table_is_the_planners():
    import glob
    import os

    from lomo_ds.planning.tables import format_models_table

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    configs = sorted(glob.glob(os.path.join(root, "docs", "models", "*.json")))
    assert len(configs) == 6
    table = format_models_table(configs, [2048, 4096])
    doc = open(os.path.join(root, "docs", "memory.md")).read()
    assert table in doc, "docs/memory.md is out of date: regenerate it with lomo-ds plan --models docs/models/*.json"
