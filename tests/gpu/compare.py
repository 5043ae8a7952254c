"""The arithmetic of the GPU checks (planner prediction, tolerance, step-time ratios, the summary),
device-independent so that tests/gpu/test_helpers.py proves it on a CPU."""
from __future__ import annotations

import glob
import json
import os
import statistics
import sys

from lomo_ds.config.run import load_run_config
from lomo_ds.planning.planner import GIB, plan_for_run

MEMORY_TOLERANCE = 0.10  # |predicted - measured| / measured: the planner's promised bound
STEP_TIME_ORDER = ("floor", "lomo", "deepspeed_sgd")


def memory_run_config(model_dir: str, micro: int, seq: int) -> dict:
    """The run the memory check trains and the planner predicts: bf16 with stochastic rounding and
    activation checkpointing, as the shipped GPU configs; a model small enough for any GPU whose
    model states still dwarf the allocator's fixed costs. `model_dir` holds its config.json."""
    return {"train_micro_batch_size_per_gpu": micro, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3},
            "lomo": {"lr": 1e-3, "stochastic_rounding": True},
            "model": {"path": model_dir, "gradient_checkpointing": True},
            "tokenizer": {"max_length": seq}}


def predicted_peak_bytes(run: dict, world: int) -> float:
    """The planner's per-GPU peak for `run` on `world` GPUs, through the typed run config (as --dry-run)."""
    return plan_for_run(load_run_config(run, check_files=False), world).estimates[("lomo", world)].total


def relative_gap(measured: float, predicted: float) -> float:
    return (predicted - measured) / measured


def within_tolerance(measured: float, predicted: float, tol: float = MEMORY_TOLERANCE) -> bool:
    return abs(relative_gap(measured, predicted)) <= tol


def step_time_table(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per engine: the median step time and its ratio to the floor's (forward + backward, gradients dropped)."""
    floor = statistics.median(times["floor"])
    return {name: {"median_s": statistics.median(times[name]), "x_floor": statistics.median(times[name]) / floor}
            for name in STEP_TIME_ORDER if name in times}


def format_summary(results: dict[int, dict]) -> str:
    """One line per check and world size, from the workers' JSON (world -> check -> figures)."""
    lines = []
    for world, checks in sorted(results.items()):
        for name, r in checks.items():
            if name in ("_seconds", "_cpu_seconds"):  # what each check took (tests/ranks.py), not a check
                continue
            head = f"[{world} GPU(s)] {name}:"
            if "error" in r:
                lines.append(f"{head} ERROR {r['error'].strip().splitlines()[-1]}")
            elif "max_abs_diff" in r:
                against = "AdaLomo - reference" if name.startswith("adalomo") else "LOMO - torch.optim.SGD"
                lines.append(f"{head} max |{against}| = {r['max_abs_diff']:.2e}"
                             + (f", shards on {r['shard_device']}" if "shard_device" in r else "")
                             + (f", {r['host_updates']} slices updated on the host thread"
                                if r.get("host_updates") else ""))
            elif name == "bucket_path":
                lines.append(f"{head} {r['backend']}, {r['transport']}, side stream {r['side_stream']}, "
                             f"{r['buckets']} buckets and {r['reduce_scatters']} reduce-scatters a step, timers on "
                             f"{'events' if r['timers_on_accelerator'] else 'the host clock'}, gather stream "
                             f"{r['gather_stream']}")
            elif name == "evaluation":
                got, want = r["engine"], r["reference"]
                lines.append(f"{head} accuracy {got['accuracy']['accuracy']:.3f} (unpartitioned "
                             f"{want['accuracy']['accuracy']:.3f}), LM loss {got['loss']['loss']:.6f} "
                             f"({want['loss']['loss']:.6f})")
            elif name == "generation":
                same = sum(a == b for a, b in zip(r["replies"], r["reference"], strict=True))
                lines.append(f"{head} {same} of {len(r['reference'])} replies as each prompt alone "
                             f"(lengths {r['lengths']})")
            elif name == "offload_two_devices":
                lines.append(f"{head} shards on {r['shard_devices']}; max |LOMO - SGD| {r['sgd']['max_abs_diff']:.2e}, "
                             f"|AdaLomo - reference| {r['adalomo']['max_abs_diff']:.2e}; bf16 losses "
                             + " ".join(f"{x:.4f}" for x in r["bf16_losses"]))
            elif name.endswith("offload_overlap"):
                lines.append(f"{head} median step " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in
                                                               r["median_s"].items())
                             + f"; host thread saves {r['saved_s'] * 1e3:.1f} ms over inline, {r['applied']} "
                             "updates on it")
            elif name == "host_syncs":
                lines.append(f"{head} " + ("; ".join(f"{k}: from lomo_ds {v['lomo_ds'] or 'none'}, "
                                                      f"{len(v['others'])} elsewhere" for k, v in r.items())
                                           if "skipped" not in r else r["skipped"]))
            elif name == "reduction_overflow":
                lines.append(f"{head} skipped per step " + " ".join(str(all(s["skipped"])) for s in r["steps"])
                             + ", shards finite " + " ".join(str(all(s["finite"])) for s in r["steps"]))
            elif name == "lora_lomo":
                lines.append(f"{head} adapter gradient norm {r['one_pass']['lora_grad_norm']:.6g} in one pass, "
                             f"{r['two_passes']['lora_grad_norm']:.6g} in two")
            elif name == "fetch_per_layer":
                lines.append(f"{head} loss before -> after one step: " + ", ".join(
                    f"{m} {v['loss_before']:.4f} -> {v['loss_after']:.4f}" for m, v in r.items()))
            elif name == "bf16":
                lines.append(f"{head} realized update share " + ", ".join(
                    f"{mode} {v['realized']:.3f}" for mode, v in r.items()))
            elif name == "overflow":
                lines.append(f"{head} skipped per step " + " ".join(
                    str(all(s["skipped_all_ranks"])) for s in r["steps"]) + ", scale " + " -> ".join(
                    f"{s['scale_after']:g}" for s in r["steps"]))
            elif name == "memory":
                lines.append(f"{head} peak {r['measured'] / GIB:.3f} GiB measured, {r['predicted'] / GIB:.3f} GiB "
                             f"predicted ({100 * relative_gap(r['measured'], r['predicted']):+.1f}%)")
            elif name == "host_memory":
                lines.append(f"{head} rank 0's host memory above its start: export {r['export'] / 2**20:.1f} MiB "
                             f"({r['export_live'] / 2**20:.1f} MiB of tensors at a file's write; a file holds at most "
                             f"{r['file_limit'] / 2**20:.1f}), save {r['save'] / 2**20:.1f} MiB, load "
                             f"{r['load'] / 2**20:.1f} MiB (model {r['model_bytes'] / 2**20:.1f} MiB)")
            elif name == "step_time":
                lines.append(f"{head} " + ", ".join(f"{k} {v['median_s'] * 1e3:.1f} ms ({v['x_floor']:.2f}x floor)"
                                                     for k, v in r["table"].items()))
            else:
                lines.append(f"{head} {r}")
    return "\n".join(lines)


def summarize_dir(path: str) -> str:
    """The summary of a results folder: results_<world>.json from the workers, train_builtin.json."""
    results = {}
    for name in glob.glob(os.path.join(path, "results_*.json")):
        with open(name) as f:
            results[int(os.path.basename(name)[len("results_"):-len(".json")])] = json.load(f)
    lines = ([format_summary(results)] if results else
             ["no worker results (no GPU here, or the launches failed: see pytest.log)"])
    train = os.path.join(path, "train_builtin.json")
    if os.path.exists(train):
        with open(train) as f:
            t = json.load(f)
        lines.append(f"[1 GPU] launch/train.py builtin, bf16 + clip_grad_norm, {len(t['losses'])} steps: loss "
                     f"{t['losses'][0]:.3f} -> {t['losses'][-1]:.3f}; peak {t['peak_measured'] / GIB:.3f} GiB "
                     f"(model loading included), planner {t['peak_predicted'] / GIB:.3f} GiB")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize_dir(sys.argv[1]))
