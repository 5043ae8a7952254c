"""Table 3: SuperGLUE accuracy of zero-shot, LoRA, LOMO (and AdaLomo, LoRA+LOMO, AdamW) through the training program.

    python3 -m experiments.table3 --cpu        # built-in model and task, 2 ranks, experiments/table3_hparams/cpu.yaml
    python3 -m experiments.table3 --model-path 7b=/m/llama-7b --gpus 8                  # GPU: six tasks x methods
    python3 -m experiments.table3 --model-root /m --tasks rte,copa --methods lomo --dry-run   # print the commands

Every run is `launch/train.py` on `python -m torch.distributed.run --nproc_per_node N` (what the
`deepspeed` launcher does, LOCAL_SIZE included), configured by a base config (ds_configs/cpu_default.json,
ds_configs/llama{7,13,30,65}b.json) plus `--set` overrides built from the YAML hyperparameters in
experiments/table3_hparams/ (Table 4 of the paper: one file per task, and cpu.yaml). A list in the
YAML is a sweep: every combination runs and, as in the paper ("the best result", seed 42), the best
final accuracy is reported, with the setting that gave it. `shared.seeds` (or --seeds) lists more
seeds: the sweep runs on the first, the best setting is then rerun on the others (train.seed), and
the table reports the mean and the minimum over the seeds. The accuracy is the training program's
(candidates scored by the mean log-probability of their tokens), read from
`<output.dir>/summary.json`.

Writes experiments/results/table3{,_cpu}.{csv,md,png}; GPU mode puts the paper's figures beside ours.
"""
from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import subprocess
import sys
import time

from benchmarks import common
from devkit.launch_local import run_local, torchrun_command
from lomo_ds.config.tasks import SUPERGLUE_TASKS
from lomo_ds.config.tasks import TASKS as TASK_REGISTRY

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
HPARAMS = os.path.join(HERE, "table3_hparams")
RESULTS = os.path.join(HERE, "results")
TASKS = SUPERGLUE_TASKS  # the paper's column order
TASK_NAMES = {name: task.title for name, task in TASK_REGISTRY.items()}
METHODS = ("zero_shot", "lora", "lomo", "adalomo", "lora_lomo", "adamw")
METHOD_NAMES = {"zero_shot": "Zero-shot", "lora": "LoRA", "lomo": "LOMO", "adalomo": "AdaLomo",
                "lora_lomo": "LoRA+LOMO", "adamw": "AdamW"}
SIZES = ("7b", "13b", "30b", "65b")
# The paper's Table 3 (accuracy %, columns TASKS then the average).
PAPER_T3 = {
    ("7b", "zero_shot"): (57.0, 66.5, 36.5, 49.7, 42.3, 85.0, 56.2),
    ("7b", "lora"): (85.9, 85.2, 64.4, 65.5, 84.8, 87.0, 78.8),
    ("7b", "lomo"): (86.6, 87.5, 66.4, 71.2, 84.0, 89.0, 80.8),
    ("13b", "zero_shot"): (60.6, 65.0, 36.5, 49.5, 43.4, 88.0, 57.2),
    ("13b", "lora"): (89.9, 87.1, 63.5, 69.9, 86.1, 92.0, 81.4),
    ("13b", "lomo"): (89.9, 87.3, 75.0, 74.3, 85.7, 93.0, 84.2),
    ("30b", "zero_shot"): (53.4, 74.6, 36.5, 50.0, 46.9, 89.0, 58.4),
    ("30b", "lora"): (91.0, 89.7, 83.7, 74.0, 87.0, 93.0, 86.4),
    ("30b", "lomo"): (92.8, 89.3, 85.6, 74.1, 87.9, 93.0, 87.1),
    ("65b", "zero_shot"): (59.6, 73.6, 44.2, 51.3, 48.3, 91.0, 61.3),
    ("65b", "lora"): (93.1, 90.9, 88.5, 74.5, 90.0, 97.0, 89.0),
    ("65b", "lomo"): (93.9, 90.7, 92.3, 75.4, 89.9, 97.0, 89.9),
}
MIN_GAIN = 20.0  # CPU check: points every fine-tuned method must gain over zero-shot on its worst seed
NOT_SWEPT = {"targets"}  # list-valued keys that are values, not sweeps


# ----------------------------------------------------------------------------- hyperparameters
def load_hparams(name: str) -> dict:
    """experiments/table3_hparams/<name>.yaml (a task name, or "cpu"), or a path to a YAML file."""
    import yaml

    path = name if name.endswith((".yaml", ".yml")) else os.path.join(HPARAMS, f"{name}.yaml")
    with open(path) as f:
        hp = yaml.safe_load(f)
    if not isinstance(hp, dict) or "shared" not in hp:
        raise ValueError(f"{path}: expected a mapping with 'shared', 'lomo', 'lora', 'lora_lomo'")
    return hp


def _expand(section: dict, prefix: str = "") -> list[dict]:
    """Every combination of the list-valued entries of a (nested) section, as flat dotted dicts."""
    keys, choices = [], []
    for k, v in section.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            sub = _expand(v, key + ".")
            keys.append(None)
            choices.append(sub)
        elif isinstance(v, list) and k not in NOT_SWEPT:
            keys.append(key)
            choices.append(v)
        else:
            keys.append(key)
            choices.append([v])
    out = []
    for combo in itertools.product(*choices):
        d: dict = {}
        for k, c in zip(keys, combo, strict=True):
            if k is None:
                d.update(c)
            else:
                d[k] = c
        out.append(d)
    return out


def settings(method: str, hp: dict) -> list[dict]:
    """The sweep for `method`: a list of flat settings ({"lr": .., "warmup_ratio": ..} or
    {"lora.lr": .., "lomo.lr": ..} for LoRA+LOMO). Zero-shot has one empty setting."""
    if method == "zero_shot":
        return [{}]
    return _expand(hp[method])


def seeds_of(hp: dict) -> list[int]:
    """The seeds of a table: shared.seeds, else the single shared.seed (42, the paper's)."""
    sh = hp["shared"]
    return [int(s) for s in sh.get("seeds", [sh.get("seed", 42)])]


def train_overrides(method: str, setting: dict, hp: dict, nproc: int, out_dir: str, seed: int | None = None) -> dict:
    """`--set` overrides for launch/train.py: the shared protocol plus this method's setting."""
    sh = hp["shared"]
    seed = seeds_of(hp)[0] if seed is None else seed
    global_batch = int(sh.get("global_batch", 16))
    if global_batch % nproc:
        raise ValueError(f"global batch {global_batch} does not split over {nproc} ranks")
    o = {
        "train.method": method,
        "data.task": hp.get("task", "builtin"),
        "data.train_samples": sh.get("train_samples", 1000),
        "data.eval_samples": sh.get("eval_samples", 1000),
        "train.seed": seed,
        "train.epochs": sh.get("epochs", 10),
        "train.max_steps": sh.get("max_steps"),
        "train.zero_shot_eval": method == "zero_shot",
        "train_micro_batch_size_per_gpu": global_batch // nproc,
        "eval.every_steps": None,
        "eval.at_end": True,
        "output.dir": out_dir,
        "output.export_hf": False,
        "output.checkpoint_every": None,
        "train.clip_grad_norm": sh.get("clip_grad_norm", 1.0),
        "train.clip_grad_value": sh.get("clip_grad_value"),  # Table 4 clips by norm only
        "train.scheduler.type": sh.get("schedule", "linear"),
    }
    if "max_length" in sh:
        o["tokenizer.max_length"] = sh["max_length"]

    def lora(prefix: str) -> None:
        for k in ("warmup_ratio", "rank", "alpha", "targets"):
            if f"{prefix}{k}" in setting:
                o[f"train.lora.{k}"] = setting[f"{prefix}{k}"]
        if f"{prefix}lr" in setting:  # the adapters' optimizer's learning rate
            o["train.lr"] = setting[f"{prefix}lr"]

    if method in ("lomo", "adalomo"):  # AdaLomo: LOMO's engine with the adaptive update rule
        o["train.method"] = "lomo"
        # named either way: the rule must not follow the config file's default
        o["lomo.optimizer"] = "adalomo" if method == "adalomo" else "sgd"
        o["lomo.lr"] = setting["lr"]
        o["train.scheduler.warmup_ratio"] = setting["warmup_ratio"]
    elif method == "adamw":  # DeepSpeed's AdamW on ZeRO-3, clipped by train.clip_grad_norm
        o["train.lr"] = setting["lr"]
        o["train.scheduler.warmup_ratio"] = setting["warmup_ratio"]
    elif method == "lora":
        lora("")
    elif method == "lora_lomo":
        lora("lora.")
        o["lomo.optimizer"] = "sgd"
        o["lomo.lr"] = setting["lomo.lr"]
        o["train.scheduler.warmup_ratio"] = setting["lomo.warmup_ratio"]
    return o


def describe(method: str, setting: dict) -> str:
    keep = {k: v for k, v in setting.items() if not k.endswith(("optimizer", "targets", "alpha"))}
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in keep.items()) or "-"


# ----------------------------------------------------------------------------- running
def train_program(config: str, overrides: dict) -> list[str]:
    """launch/train.py's command line (what each rank runs) for `config` with `overrides`."""
    program = [os.path.join(ROOT, "launch", "train.py"), "--config", config]
    for k, v in overrides.items():
        program += ["--set", f"{k}={json.dumps(v)}"]
    return program


def run_train(program: list[str], nproc: int, cpu: bool, out_dir: str, timeout: float) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.time()
    with open(os.path.join(out_dir, "table3.log"), "w") as f:
        try:
            proc = run_local(program, nproc, timeout=timeout, cpu=cpu, cwd=ROOT, capture=False, stdout=f,
                             stderr=subprocess.STDOUT)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    res = {"rc": rc, "minutes": (time.time() - t0) / 60}
    summary = os.path.join(out_dir, "summary.json")
    if rc == 0 and os.path.exists(summary):
        with open(summary) as f:
            res.update(json.load(f))
    else:
        with open(os.path.join(out_dir, "table3.log")) as f:
            tail = f.read()[-3000:]
        print(f"run failed (rc {rc}); log {out_dir}/table3.log:\n{tail}", file=sys.stderr)
    metrics = os.path.join(out_dir, "metrics.jsonl")
    if os.path.exists(metrics):
        with open(metrics) as f:
            recs = [json.loads(line) for line in f if line.strip()]
        losses = [r["loss"] for r in recs if "loss" in r and r.get("loss") is not None]
        if losses:
            res["first_loss"], res["last_loss"] = losses[0], losses[-1]
    return res


def finished_run(out_dir: str, config: str, overrides: dict) -> dict | None:
    """The result of an earlier run with exactly this config and these overrides (--reuse), or None."""
    try:
        with open(os.path.join(out_dir, "table3_run.json")) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    same = rec.get("config") == config and rec.get("overrides") == overrides
    return rec["result"] if same and rec["result"].get("rc") == 0 else None


def record_run(out_dir: str, config: str, overrides: dict, res: dict) -> None:
    with open(os.path.join(out_dir, "table3_run.json"), "w") as f:
        json.dump({"config": config, "overrides": overrides, "result": res}, f, indent=1)


def accuracy_of(method: str, res: dict) -> float | None:
    acc = res.get("zero_shot_accuracy") if method == "zero_shot" else res.get("final_accuracy")
    return None if acc is None else 100.0 * acc


def run_cell(size: str, task: str, method: str, hp: dict, config: str, nproc: int, a, base_dir: str,
             extra: dict | None = None) -> dict:
    """All settings of one (size, task, method) on the first seed, then the best setting on the other
    seeds. Returns the best setting with its accuracy per seed, mean and minimum."""
    seeds = a.seeds or seeds_of(hp)

    def run_one(setting: dict, i: int, seed: int) -> dict:
        out_dir = os.path.join(base_dir, f"{size}-{task}-{method}-{i}" + (f"-seed{seed}" if seed != seeds[0] else ""))
        overrides = train_overrides(method, setting, hp, nproc, out_dir, seed)
        overrides.update(extra or {})
        overrides.update(a.extra_overrides)
        program = train_program(config, overrides)
        if a.dry_run:
            print(" ".join(torchrun_command(program, nproc, port=29500)))
            return {}
        res = finished_run(out_dir, config, overrides) if a.reuse else None
        if res is None:
            res = run_train(program, nproc, a.cpu, out_dir, a.timeout)
            record_run(out_dir, config, overrides, res)
        acc = accuracy_of(method, res)
        print(f"{size} {task:8s} {method:9s} [{describe(method, setting)}] seed {seed} -> "
              f"{'FAILED' if acc is None else f'{acc:.1f}%'} ({res['minutes']:.1f} min"
              + (f", loss {res['first_loss']:.3f} -> {res['last_loss']:.3f}" if "last_loss" in res else "") + ")",
              flush=True)
        return {**res, "accuracy": acc, "setting": setting, "index": i}

    tried = [run_one(setting, i, seeds[0]) for i, setting in enumerate(settings(method, hp))]
    ok = [r for r in tried if r.get("accuracy") is not None]
    if not ok:
        return None
    top = max(ok, key=lambda r: r["accuracy"])
    per_seed = [top] + [run_one(top["setting"], top["index"], seed) for seed in seeds[1:]]
    accs = [r["accuracy"] for r in per_seed]
    if any(acc is None for acc in accs):  # a failed seed makes the row meaningless
        return None
    return {"size": size, "task": task, "method": method, "accuracy": sum(accs) / len(accs),
            "seeds": dict(zip(seeds, accs, strict=True)), "setting": top["setting"],
            "steps": top.get("steps"), "minutes": sum(r["minutes"] for r in per_seed) / len(per_seed),
            "first_loss": top.get("first_loss"), "last_loss": top.get("last_loss"),
            "tried": [{"setting": r["setting"], "accuracy": r["accuracy"], "minutes": r["minutes"]} for r in tried]}


# ----------------------------------------------------------------------------- output
def markdown(rows: list[dict], cpu: bool, title: str = "") -> str:
    """The paper's layout: per model size, a row per method with the six tasks and their average;
    ours first, the paper's in brackets (GPU). For the CPU run: our rows on the built-in task."""
    lines = [f"# Table 3{' (CPU)' if cpu else ''}: accuracy (%){title}", ""]
    if cpu:
        # The gain is the fine-tuned minimum over seeds against zero-shot's maximum: the worst case.
        zs = next((r for r in rows if r["method"] == "zero_shot"), None)
        zs_max = None if zs is None else max(r_seeds(zs).values())
        lines += ["Mean and minimum over the seeds (train.seed); the sweep ran on the first seed.", "",
                  "| method | mean | min | min - zero-shot max | per seed | steps | setting | minutes/run |",
                  "|---|---|---|---|---|---|---|---|"]
        for m in METHODS:
            for r in (r for r in rows if r["method"] == m):
                accs = r_seeds(r)
                delta = "" if zs_max is None or m == "zero_shot" else f"{min(accs.values()) - zs_max:+.1f}"
                lines.append(f"| {METHOD_NAMES[m]} | {r['accuracy']:.1f} | {min(accs.values()):.1f} | {delta} | "
                             + " ".join(f"{acc:.0f}" for acc in accs.values())
                             + f" | {r.get('steps') or 0} | {describe(m, r.get('setting', {}))} | "
                             + f"{r.get('minutes', 0):.1f} |")
        return "\n".join(lines) + "\n"
    lines += ["Ours, the paper's in brackets (LoRA+LOMO: the paper shows it only in Figure 3). "
              "Best of the Table 4 sweep, seed 42.", "",
              "| size | method | " + " | ".join(TASK_NAMES[t] for t in TASKS) + " | Avg. |",
              "|---|---|" + "---|" * (len(TASKS) + 1)]
    by = {(r["size"], r["task"], r["method"]): r["accuracy"] for r in rows}
    sizes = [s for s in SIZES if any(r["size"] == s for r in rows)] or [r["size"] for r in rows[:1]]
    for size in sizes:
        for m in METHODS:
            if not any((size, t, m) in by for t in TASKS) and (size, m) not in PAPER_T3:
                continue
            paper = PAPER_T3.get((size, m))
            cells = []
            for i, t in enumerate(TASKS):
                ours = by.get((size, t, m))
                cell = "-" if ours is None else f"{ours:.1f}"
                cells.append(cell + (f" [{paper[i]:.1f}]" if paper else ""))
            got = [by[(size, t, m)] for t in TASKS if (size, t, m) in by]
            avg = f"{sum(got) / len(got):.1f}" if len(got) == len(TASKS) else ("-" if not got else
                                                                              f"{sum(got) / len(got):.1f}*")
            cells.append(avg + (f" [{paper[-1]:.1f}]" if paper else ""))
            lines.append(f"| {size.upper()} | {METHOD_NAMES[m]} | " + " | ".join(cells) + " |")
    if any(by.get(k) is not None for k in by) and len({r["task"] for r in rows}) < len(TASKS):
        lines += ["", "* average over the tasks run only."]
    return "\n".join(lines) + "\n"


def r_seeds(row: dict) -> dict:
    """{seed: accuracy} of a result row (a row from one seed has only "accuracy")."""
    return row.get("seeds") or {"-": row["accuracy"]}


def write_outputs(rows: list[dict], cpu: bool, title: str = "") -> str:
    os.makedirs(RESULTS, exist_ok=True)
    base = os.path.join(RESULTS, f"table3{'_cpu' if cpu else ''}")
    with open(base + ".csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["size", "task", "method", "accuracy", "accuracy_min", "per_seed", "setting", "steps", "minutes",
                    "first_loss", "last_loss", "paper_accuracy"])
        for r in rows:
            paper = PAPER_T3.get((r["size"], r["method"]))
            p = paper[TASKS.index(r["task"])] if paper and r["task"] in TASKS else ""
            w.writerow([r["size"], r["task"], r["method"], f"{r['accuracy']:.2f}", f"{min(r_seeds(r).values()):.2f}",
                        json.dumps(r_seeds(r)), json.dumps(r.get("setting", {})),
                        r.get("steps", ""), f"{r.get('minutes', 0):.2f}", r.get("first_loss", ""),
                        r.get("last_loss", ""), p])
    text = markdown(rows, cpu, title)
    with open(base + ".md", "w") as f:
        f.write(text)
    with open(base + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    print(text)
    try:
        plot(rows, base + ".png", cpu)
    except Exception as e:  # the table matters more than the picture
        print(f"plot not written: {e}", file=sys.stderr)
    return text


def plot(rows: list[dict], path: str, cpu: bool) -> None:
    plt = common.pyplot()

    tasks = [t for t in (("builtin",) if cpu else TASKS) if any(r["task"] == t for r in rows)]
    sizes = sorted({r["size"] for r in rows}, key=lambda s: SIZES.index(s) if s in SIZES else -1)
    width_in = max(5, 3 + 1.6 * len(tasks)) * len(sizes) / max(1, len(sizes)) + 1
    fig, axes = plt.subplots(1, len(sizes), figsize=(width_in, 4), squeeze=False)
    colors = {"zero_shot": "#999999", "lora": "#DD8452", "lomo": "#4C72B0", "adalomo": "#8172B3",
              "lora_lomo": "#55A868", "adamw": "#C44E52"}
    width = 0.8 / len(METHODS)
    for ax, size in zip(axes[0], sizes, strict=True):
        for j, m in enumerate(METHODS):
            vals = [next((r["accuracy"] for r in rows if (r["size"], r["task"], r["method"]) == (size, t, m)), 0)
                    for t in tasks]
            ax.bar([i + j * width for i in range(len(tasks))], vals, width, label=METHOD_NAMES[m], color=colors[m])
            paper = PAPER_T3.get((size, m))
            if paper and not cpu:
                ax.scatter([i + j * width for i in range(len(tasks))], [paper[TASKS.index(t)] for t in tasks],
                           marker="_", s=120, color="k", zorder=3)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(tasks))], [TASK_NAMES[t] for t in tasks])
        ax.set_ylim(0, 100)
        ax.set_ylabel("accuracy (%)")
        ax.set_title(size if not cpu else "SmolLM2-135M, built-in task (2 CPU ranks)", fontsize=9)
    axes[0][0].legend(fontsize=7)
    common.save_figure(fig, path, "Table 3" + ("" if cpu else " (black ticks: the paper)"))


# ----------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true",
                    help="built-in model and task on 2 CPU ranks (table3_hparams/cpu.yaml)")
    ap.add_argument("--model-path", action="append", metavar="[SIZE=]PATH", help="LLaMA HF folder (GPU); repeatable")
    ap.add_argument("--model-root", default=None, help="folder holding llama-7b, llama-13b, ... (GPU)")
    ap.add_argument("--gpus", type=int, default=None, help="ranks per run (GPU default 8; --cpu: cpu.yaml's ranks)")
    ap.add_argument("--tasks", default=",".join(TASKS), help="GPU: comma list of SuperGLUE tasks")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma list of " + ",".join(METHODS))
    ap.add_argument("--hparams", default=None, help="a YAML file instead of table3_hparams/<task>.yaml (or cpu.yaml)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra launch/train.py override for every run (value parsed as JSON)")
    ap.add_argument("--runs-dir", default=os.path.join(ROOT, "runs", "table3"), help="where each run's output.dir goes")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per run (default 1800 CPU, none GPU)")
    ap.add_argument("--seeds", default=None, help="comma list of seeds, overriding the YAML's shared.seeds")
    ap.add_argument("--dry-run", action="store_true", help="print the training commands, run nothing")
    ap.add_argument("--reuse", action="store_true",
                    help="keep the result of a run already finished with the same config and overrides")
    ap.add_argument("--update", action="store_true",
                    help="keep the rows of the methods not run now from the previous results file")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    if not a.cpu and not (a.model_path or a.model_root or a.dry_run):
        ap.error("give --cpu, or --model-path / --model-root (GPU)")
    a.extra_overrides = {}
    for item in a.set:
        k, sep, v = item.partition("=")
        if not sep:
            ap.error(f"--set {item!r}: expected KEY=VALUE")
        try:
            a.extra_overrides[k] = json.loads(v)
        except json.JSONDecodeError:
            a.extra_overrides[k] = v
    a.seeds = [int(x) for x in a.seeds.split(",") if x] if a.seeds else None
    methods = [m for m in a.methods.split(",") if m]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        ap.error(f"--methods: unknown {bad}; expected some of {list(METHODS)}")
    a.timeout = a.timeout or (1800 if a.cpu else None)
    rows: list[dict] = []
    t0 = time.time()
    if a.cpu:
        hp = load_hparams(a.hparams or "cpu")
        nproc = a.gpus or int(hp.get("ranks", 2))
        config = os.path.join(ROOT, hp.get("config", "ds_configs/cpu_default.json"))
        for m in methods:
            best = run_cell("cpu", "builtin", m, hp, config, nproc, a, os.path.join(a.runs_dir, "cpu"))
            if best:
                rows.append(best)
    else:
        from lomo_ds.planning import planner

        paths = planner.llama_model_paths(a.model_path, a.model_root)
        if not paths and a.dry_run:
            paths = {"7b": "/path/to/llama-7b"}
        nproc = a.gpus or 8
        for size in [s for s in SIZES if s in paths]:
            for task in [t for t in a.tasks.split(",") if t]:
                hp = load_hparams(a.hparams or task)
                hp["task"] = task
                config = os.path.join(ROOT, "ds_configs", f"llama{size}.json")
                for m in methods:
                    best = run_cell(size, task, m, hp, config, nproc, a, a.runs_dir, {"model.path": paths[size]})
                    if best:
                        rows.append(best)
                if rows and not a.dry_run:
                    write_outputs(rows, False)  # after every task: a long sweep leaves a table behind
    if a.dry_run:
        return 0
    prev = os.path.join(RESULTS, f"table3{'_cpu' if a.cpu else ''}.json")
    if a.update and os.path.exists(prev):
        with open(prev) as f:
            done = {(r["size"], r["task"], r["method"]) for r in rows}
            rows = [r for r in json.load(f) if (r["size"], r["task"], r["method"]) not in done] + rows
    if not rows:
        print("no run finished", file=sys.stderr)
        return 1
    write_outputs(rows, a.cpu)
    print(f"total {(time.time() - t0) / 60:.1f} min")
    if a.cpu:
        # The goal: every fine-tuned method's worst seed at least 20 points above zero-shot's best.
        zs = next((max(r_seeds(r).values()) for r in rows if r["method"] == "zero_shot"), None)
        if zs is not None:
            worse = [r for r in rows if r["method"] != "zero_shot" and min(r_seeds(r).values()) < zs + MIN_GAIN]
            for r in worse:
                print(f"CHECK FAILED: {METHOD_NAMES[r['method']]} {min(r_seeds(r).values()):.1f}% (min over seeds) is "
                      f"not {MIN_GAIN:g} points above zero-shot {zs:.1f}%", file=sys.stderr)
            return 3 if worse else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
