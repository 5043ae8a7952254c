"""Where a step's time goes, per engine, from a py-spy profile of benchmarks/bench_fsdp.py.

  py-spy record --subprocesses --rate 50 --format raw -o prof.txt -- \\
      python -m torch.distributed.run --nproc_per_node 2 -m benchmarks.bench_fsdp --engines "deepspeed floor,lomo"
  python -m benchmarks.profile_summary prof.txt [--top 25]

py-spy's raw format is one collapsed stack per line with its sample count. Each sample is given to
the engine whose `train_step` is on its stack (lomo_ds's LomoEngine, the floor's FloorEngine, the
FSDP2 engine); within an engine, samples are summed by function: inclusive (on the stack at all),
so that "everything under LOMO's gradient hook" is one row. Ranks are summed. The engines took
turns on the same batches, so their sample counts compare as their step times do.
"""
from __future__ import annotations

import argparse
import collections
import re

ENGINES = {  # a frame of the engine's train_step, as py-spy prints it: "function (file:line)"
    "lomo": re.compile(r"^(\w+\.)?train_step \(.*lomo_engine\.py"),
    "deepspeed floor": re.compile(r"^(\w+\.)?train_step \(.*devkit/floor\.py"),
    "fsdp2": re.compile(r"^(\w+\.)?train_step \(.*bench_fsdp\.py"),
}
_LINE = re.compile(r":\d+\)$")


def frame_name(frame: str) -> str:
    """"function (path/file.py:123)" -> "function (file.py)": one row per function, not per line."""
    frame = _LINE.sub(")", frame)
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit('/', 1)[-1]}" if where else name


def summarize(path: str) -> dict[str, collections.Counter]:
    """engine -> Counter(function -> inclusive samples), plus "<total>" per engine."""
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not count.isdigit():
                continue
            frames = stack.split(";")
            engine = next((e for e in ENGINES for fr in frames if ENGINES[e].match(fr)), None)
            if engine is None:
                continue
            n = int(count)
            out[engine]["<total>"] += n
            # py-spy's first frames name the processes (the launcher, the rank): not functions.
            for name in {frame_name(fr) for fr in frames if not fr.startswith("process ")}:
                out[engine][name] += n
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", help="py-spy record --format raw output")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    by_engine = summarize(args.profile)
    for engine, counts in by_engine.items():
        total = counts["<total>"]
        print(f"\n{engine}: {total} samples in train_step (both ranks); inclusive share by function")
        for name, n in counts.most_common(args.top + 1):
            if name != "<total>":
                print(f"  {100 * n / total:6.1f}%  {n:7d}  {name}")
    if "lomo" in by_engine and "deepspeed floor" in by_engine:
        lomo, floor = by_engine["lomo"], by_engine["deepspeed floor"]
        print(f"\nlomo / floor samples: {lomo['<total>'] / floor['<total>']:.3f}; functions with the most "
              "extra samples in lomo (lomo - floor, as a share of the floor's total)")
        extra = {k: lomo[k] - floor.get(k, 0) for k in lomo if k != "<total>"}
        for name, n in sorted(extra.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"  {100 * n / floor['<total>']:6.1f}%  {n:7d}  {name}")


if __name__ == "__main__":
    main()
