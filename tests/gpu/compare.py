"""The arithmetic of the GPU checks (planner prediction, tolerance, step-time ratios, the summary)
and the bounds test_gpu.py holds their figures to, device-independent so that
tests/gpu/test_helpers.py proves it on a CPU, and feeds each bound a figure it must refuse."""
from __future__ import annotations

import glob
import json
import os
import statistics
import sys

from lomo_ds.config.run import load_run_config
from lomo_ds.planning.planner import GIB, plan_for_run
from tests.tiny import engine_sections  # noqa: E402

MEMORY_TOLERANCE = 0.10  # |predicted - measured| / measured: the planner's promised bound
STEP_TIME_ORDER = ("floor", "lomo", "deepspeed_sgd")
# LOMO's step over its floor's (forward + backward, every gradient dropped): the extra a fused update
# may cost, the same limit as benchmarks/bench_step.py's FLAG_ABOVE (test_helpers checks they agree).
# Below 0.9 a timer is broken: LOMO does strictly more than the floor.
STEP_TIME_LIMIT = 1.10
STEP_TIME_FLOOR = 0.9
# The host-update thread must hide at least half of what it could: what it saves over the updates
# inside the hook, against the least of its busy time and the floor's backward (it can hide no more
# than the backward lasts). A serialised worker saves nothing; a full overlap saves all but the last
# bucket's update.
OVERLAP_HIDDEN_MIN = 0.5
# bf16 AdaLomo against its reference from the same bf16 weights: one rounding of one update apart.
# The reference must have moved further than that (else the comparison proves nothing), and its
# twin with the last micro-batch counted twice must be told apart by the same bound.
BF16_ULPS = 1.0
BF16_MIN_MOVED_ULPS = 2.0
# The chunked loss's gradients against fp64: at most twice the error of the fp64 gradient merely
# rounded to bf16 (one chunk's is 1.0x). A per-chunk bf16 sum of the head's gradient measured 2.9x
# at 32 chunks and 5.2x at 128 (8188 positions, V 4096); the loss's fp32 sums hold it to 1e-3.
CHUNK_GRAD_FACTOR = 2.0
CHUNK_LOSS_REL = 1e-3


def memory_run_config(model_dir: str, micro: int, seq: int, attn: str | None = None, **lomo) -> dict:
    """The run the memory check trains and the planner predicts: bf16 with stochastic rounding and
    activation checkpointing, as the shipped GPU configs; a model small enough for any GPU whose
    model states still dwarf the allocator's fixed costs. `model_dir` holds its config.json;
    `attn`: model.attn_implementation (None: transformers' default, sdpa); `lomo`: more lomo options
    (norm clipping and its two_pass_mode)."""
    return {"train_micro_batch_size_per_gpu": micro, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3},
            **engine_sections({"lr": 1e-3, "stochastic_rounding": True, **lomo}),
            "model": {"path": model_dir, "gradient_checkpointing": True, "attn_implementation": attn},
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


def assert_step_time(r: dict, limit: float = STEP_TIME_LIMIT) -> None:
    """check_step_time's figures: LOMO within `limit` of its floor, and not below it (a broken timer)."""
    ratio = r["table"]["lomo"]["x_floor"]
    assert ratio > STEP_TIME_FLOOR, f"LOMO at {ratio:.3f}x its floor: below {STEP_TIME_FLOOR}x is a broken timer"
    assert ratio <= limit, (f"LOMO at {ratio:.3f}x its floor, above {limit:.2f}x: look for host syncs in the "
                            "backward or an update that does not overlap with it")


def assert_offload_overlapped(r: dict, hidden_min: float = OVERLAP_HIDDEN_MIN) -> None:
    """check_offload_overlap's figures: the worker ran, and the thread saved at least `hidden_min` of
    what it could hide over the updates inside the hook."""
    busy, backward, saved = r["worker_busy_s"], r["floor_backward_s"], r["saved_s"]
    assert r["applied"] > 0 and busy > 0, "no update ran on the host-update thread"
    hideable = min(busy, backward)
    assert saved >= hidden_min * hideable, (
        f"the host-update thread saved {saved * 1e3:.1f} ms a step over inline; its updates take "
        f"{busy * 1e3:.1f} ms and the backward {backward * 1e3:.1f} ms, so it should hide at least "
        f"{hidden_min * hideable * 1e3:.1f} ms: the updates do not overlap with the backward")


def assert_bf16_adalomo_case(r: dict, k: int) -> None:
    """One case of check_bf16_adalomo_accumulation: every window stepped, the weights in bf16; from
    the second window on (AdaLomo's first update of a vector is the sign of its gradient, which a
    legitimate rounding flips where the window's sum cancels: 12.5 and 6.5 ulps measured there with a
    bf16 accumulator at K = 4 on 3 gloo ranks, 1.0 after) within BF16_ULPS of the reference,
    which moved further than that; at K > 1 a last micro-batch added twice exceeds the bound."""
    assert all(r["stepped"]) and r["dtype"] == "torch.bfloat16", r
    later = slice(1, None)
    assert max(r["ulps"][later]) <= BF16_ULPS, f"{r['ulps']} ulps from the reference (max |diff| {r['max_abs_diff']})"
    assert min(r["moved_ulps"][later]) >= BF16_MIN_MOVED_ULPS, f"the reference moved only {r['moved_ulps']} ulps"
    if k > 1:
        assert min(r["ulps_last_doubled"][later]) > BF16_ULPS, \
            f"a last micro-batch added twice is {r['ulps_last_doubled']} ulps away: the bound cannot tell it"


def assert_chunked_loss_precise(r: dict, factor: float = CHUNK_GRAD_FACTOR) -> None:
    """check_chunked_loss_precision's figures: at every chunk count the head's weight gradient and
    the hidden states' within `factor` of bf16's own rounding of the fp64 gradients, the loss within
    CHUNK_LOSS_REL."""
    assert r["finite"] and len(r["chunks"]) > 1, r
    for count, c in r["chunks"].items():
        assert c["dw_rel"] <= factor * c["dw_rounding_rel"], (
            f"{count} chunks: the head's weight gradient is {c['dw_rel']:.2e} from fp64, "
            f"{c['dw_rel'] / c['dw_rounding_rel']:.1f}x bf16's rounding of it (limit {factor}x)")
        assert c["dh_rel"] <= factor * c["dh_rounding_rel"], (count, c)
        assert c["loss_rel"] <= CHUNK_LOSS_REL, (count, c)


def assert_trainer_bf16_near_masters(r: dict) -> None:
    """trainer_bf16_adalomo's figures: the run without masters within one ulp a step of the run with
    them (its own rounding, and the master run's of its fp32 weights), which moved further."""
    assert r["dtype"] == "torch.bfloat16", r
    assert r["ulps"] <= r["steps"] + 1, f"{r['ulps']} ulps from the fp32-master run after {r['steps']} steps"
    assert r["moved_ulps"] >= BF16_MIN_MOVED_ULPS, r


def bound_line(name: str, r: dict) -> str | None:
    """The summary line of a check this module bounds beyond a max |diff| (None: another's)."""
    if name.startswith("int8_"):  # 8-bit weight shards: tests/gpu/int8_checks.py writes their lines
        from tests.gpu.int8_checks import summary_line

        return summary_line(name, r)
    if name.endswith("offload_overlap"):
        return ("median step " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in r["median_s"].items())
                + f"; host thread saves {r['saved_s'] * 1e3:.1f} ms over inline of its {r['worker_busy_s'] * 1e3:.1f}"
                f" ms of updates (backward {r['floor_backward_s'] * 1e3:.1f} ms), {r['applied']} updates on it")
    if name == "bf16_adalomo_accumulation":
        return "; ".join(f"{case} {max(c['ulps'][1:], default=0):g} ulps (first window {c['ulps'][0]:g}, reference "
                         f"moved {min(c['moved_ulps']):g})" for case, c in r.items())
    if name == "chunked_loss_precision":
        return ", ".join(f"{n} chunks: head gradient {c['dw_rel'] / c['dw_rounding_rel']:.2f}x bf16 rounding, "
                         f"loss {c['loss_rel']:.1e}" for n, c in r["chunks"].items())
    if name == "trainer_bf16_adalomo":
        return (f"{r['ulps']:g} ulps from the fp32-master run after {r['steps']} steps (it moved "
                f"{r['moved_ulps']:g}); losses " + " ".join(f"{x:.4f}" for x in r["losses"]))
    if name.startswith(("trainer_", "sft", "dpo_")):
        return (f"max |trained - reference| = {r['max_abs_diff']:.2e}, losses "
                + " ".join(f"{x:.4f}" for x in r["loss"]))
    return None


def format_summary(results: dict[int, dict]) -> str:
    """One line per check and world size, from the workers' JSON (world -> check -> figures)."""
    lines = []
    for world, checks in sorted(results.items()):
        for name, r in checks.items():
            if name in ("_seconds", "_cpu_seconds"):  # what each check took (tests/ranks.py), not a check
                continue
            head = f"[{world} GPU(s)] {name}:"
            extra = None if "error" in r else bound_line(name, r)
            if extra is not None:
                lines.append(f"{head} {extra}")
            elif "error" in r:
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
            elif name.startswith("memory"):
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
