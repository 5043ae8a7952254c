"""The 8-bit throughput script's plumbing on a tiny slice (no timing asserted): every operation's
line, and the scale-recompute table for both headrooms."""
from benchmarks import quant8_bench


def test_prints_every_operation_and_the_recompute_table(capsys):
    quant8_bench.main(["--elements", "3000", "--start", "5", "--repeats", "1", "--steps", "2", "--pieces", "3"])
    out = capsys.readouterr().out
    for line in ("int8 write: requantize (rule + keyed SR)", "bf16 write: stochastic round", "scale recomputes"):
        assert line in out
    table = out.split("scale recomputes")[1].splitlines()[2:]
    assert len(table) == 6 and {row.split()[0] for row in table} == {"0.0000", "0.0625"}
