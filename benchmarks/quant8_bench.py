"""Throughput of the 8-bit block format's operations on one slice, against bf16 stochastic rounding.

  OMP_NUM_THREADS=1 python -m benchmarks.quant8_bench [--elements 4194304 --start 1000 --repeats 9]

Prints the best and the median time of each operation on a slice of `elements` fp32 values starting at flat
element `start` of its parameter (unaligned by default: the slice's first and last blocks are cut),
in ms, and the best in million elements a second, and the bytes a stored element takes in each format. The
operations an update pays per element are "read" (dequantize to fp32) and "write" (requantize,
stochastic); bf16's are its fp32 read and its stochastic round. Then the share of pieces the
scale rule recomputes a step, with and without headroom.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from lomo_ds.engine.precision import stochastic_round_to_bf16
from lomo_ds.runtime import quant8


def timed(fn, repeats: int) -> tuple[float, float]:
    """(best, median) seconds: on a shared machine the best is the operation's own cost, the
    median what it paid beside the other work."""
    fn()  # warm-up: allocator and kernels
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def cases(w: torch.Tensor, start: int, block: int):
    device = w.device
    key = (1234, 17, 42)
    q, scales = quant8.quantize(w, start, block=block)
    updated = quant8.dequantize(q, scales, start, block=block) + torch.randn_like(w) * 1e-3
    w_bf16 = w.to(torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(0)
    return {
        "int8 quantize, nearest (load)": lambda: quant8.quantize(w, start, block=block),
        "int8 quantize, keyed stochastic": lambda: quant8.quantize(w, start, block=block, key=key),
        "int8 keyed noise alone": lambda: quant8.noise(key, start, w.numel(), device),
        "int8 read: dequantize to fp32": lambda: quant8.dequantize(q, scales, start, block=block),
        "int8 dequantize to bf16": lambda: quant8.dequantize(q, scales, start, block=block, dtype=torch.bfloat16),
        "int8 write: requantize (rule + keyed SR)": lambda: quant8.requantize(updated, scales, start, key, block=block),
        "bf16 read: to fp32": lambda: w_bf16.float(),
        "bf16 write: stochastic round": lambda: stochastic_round_to_bf16(updated, gen),
    }


def recompute_shares(block: int, steps: int = 100, pieces: int = 2048) -> None:
    """Share of pieces whose scale the rule recomputes a step, for updates of a fixed share of a
    step (Gaussian, random signs) on Gaussian weights, with and without headroom."""
    device = torch.device("cpu")
    print(f"scale recomputes: {pieces} pieces of {block}, {steps} steps of Gaussian updates")
    print(f"{'headroom':>9s} {'update/step':>12s} {'first 10':>11s} {'second half':>13s} {'scale growth':>13s}")
    for headroom in (0.0, 1 / 16):
        for ratio in (0.01, 0.03, 0.1):
            g = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(pieces * block, generator=g, device=device) * 0.02
            q, s = quant8.quantize(x, 0, block=block, headroom=headroom)
            s0, counts = s, []
            for step in range(steps):
                w = quant8.dequantize(q, s, 0, block=block)
                w += torch.randn(w.shape, generator=g, device=device) * ratio * s.repeat_interleave(block)
                q, s, grown = quant8.requantize(w, s, 0, (0, step, 0), block=block, headroom=headroom)
                counts.append(int(grown) / pieces)
            early, late = statistics.mean(counts[:10]), statistics.mean(counts[steps // 2:])
            print(f"{headroom:9.4f} {ratio:12.2f} {early:11.4f} {late:13.4f} {float((s / s0).mean()):13.4f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=int, default=4 * 1024 * 1024)
    parser.add_argument("--start", type=int, default=1000)
    parser.add_argument("--block", type=int, default=quant8.DEFAULT_BLOCK)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--steps", type=int, default=100, help="updates in the scale-recompute count")
    parser.add_argument("--pieces", type=int, default=2048, help="pieces in the scale-recompute count")
    args = parser.parse_args(argv)
    device = torch.device("cpu")
    w = torch.randn(args.elements, generator=torch.Generator(device=device).manual_seed(1), device=device) * 0.02
    print(f"slice: {args.elements} elements at flat start {args.start}, block {args.block}, "
          f"{torch.get_num_threads()} thread(s), torch {torch.__version__}")
    print(f"stored bytes an element: int8 {1 + 4 / args.block:.4f}, bf16 2")
    print(f"{'operation':44s} {'best ms':>9s} {'median ms':>10s} {'Melem/s':>9s}")
    for name, fn in cases(w, args.start, args.block).items():
        best, median = timed(fn, args.repeats)
        print(f"{name:44s} {best * 1e3:9.2f} {median * 1e3:10.2f} {args.elements / best / 1e6:9.1f}")
    recompute_shares(args.block, args.steps, args.pieces)


if __name__ == "__main__":
    main()
