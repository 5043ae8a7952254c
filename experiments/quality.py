"""The quality benchmark: LOMO and AdaLomo against DeepSpeed AdamW, LoRA and LoRA+LOMO on three tasks
with headroom (valence, spelling, syllables: lomo_ds/data/builtin/, datagen/make_*_task.py).

    python3 -m experiments.quality --stage 1 --reuse --max-runs 4    # the next 4 runs of the coarse grid
    python3 -m experiments.quality --stage 1 --reuse --only adamw     # one method's grid
    python3 -m experiments.quality --stage 2 --reuse --max-runs 9     # best settings x 3 tasks x 3 seeds
    python3 -m experiments.quality --stage 2 --reuse --max-runs 0     # write the table of what has finished
    python3 -m experiments.quality --stage 1 --dry-run                # print the commands of the next runs

The sweep is experiments/quality.yaml. Stage 1 tunes each method on one task, the first seed and the
validation split by a coordinate search (its base setting, then each axis from the best setting so
far); stage 2 runs each method's best setting on every task and seed and reports the held-out split
(eval.split: heldout), which stage 1 never reads; a method's `also` settings (a shipped recipe the
search did not choose) run there too, each a row of its own. The best is chosen among the runs that saw the
budget's examples (max_steps batches): a K > 1 run at equal optimizer steps, which sees K times as
many, is shown in stage 1's table but never becomes a recipe. Every run is the training program, launched as
experiments/table3.py launches it (its train_overrides, train_program, run_train), in a directory of
its own whose table3_run.json records the config, the overrides and the result: with --reuse a
finished run with the same overrides is kept, so the sweep runs in pieces (--max-runs N new runs, or
--only some methods) and resumes where it stopped. Stage 2 needs stage 1 finished for the methods
it runs. After the runs, the tables of every finished run go to docs/results.md (between
the quality markers), with the date, the commit and the command.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import hashlib
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field

from devkit.launch_local import torchrun_command
from experiments import table3
from lomo_ds.config.engine_sections import EngineTrainConfig
from lomo_ds.config.overrides import parse_override_args
from lomo_ds.config.tasks import TASKS

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
HPARAMS = os.path.join(HERE, "quality.yaml")
RESULTS_MD = os.path.join(ROOT, "docs", "results.md")
# Every finished run's result, one JSON line each, committed: runs/ is not, so a new machine or a
# fresh clone resumes the sweep (and rewrites its table) from this file.
LEDGER = os.path.join(HERE, "quality_runs.jsonl")
METHODS = ("zero_shot", "lomo", "adalomo", "adamw", "lora", "lora_lomo")  # zero_shot: stage 2 only
# Setting keys that replace the shared protocol's (table3.train_overrides reads them from `shared`).
SHARED_KEYS = ("clip_grad_norm", "clip_grad_value", "schedule")
BEGIN, END = "<!-- quality:begin -->", "<!-- quality:end -->"


def accumulation_available() -> bool:
    """Whether this lomo_ds has gradient accumulation (train.accumulation_steps); its axis waits for it."""
    return "accumulation_steps" in EngineTrainConfig.model_fields


# ----------------------------------------------------------------------------- runs
@dataclass(frozen=True)
class Run:
    """One training run of the sweep: a method's setting on a task, a seed and an evaluation split."""

    stage: int
    method: str
    setting: tuple  # sorted (key, value) pairs, so that equal settings are one run
    task: str
    seed: int
    split: str  # validation | heldout
    max_steps: int

    @property
    def settings(self) -> dict:
        return dict(self.setting)

    @property
    def accumulation(self) -> int:
        return int(self.settings.get("accumulation_steps", 1))

    @property
    def name(self) -> str:
        digest = hashlib.sha1(json.dumps([self.setting, self.max_steps]).encode()).hexdigest()[:8]
        return f"s{self.stage}/{self.task}-{self.method}-{digest}-seed{self.seed}-{self.split}"


def freeze(setting: dict) -> tuple:
    """The setting as a run's identity. accumulation_steps 1 is every run's default: a setting that
    names it is the same run as the one that does not (the accumulation axis's K = 1 is the best
    setting so far, already run)."""
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in setting.items()
                        if not (k == "accumulation_steps" and v == 1)))


def overrides_of(run: Run, hp: dict, nproc: int, out_dir: str) -> dict:
    """launch/train.py's overrides for `run`: table3's protocol with the setting's shared keys in
    `shared`, accumulation as gradient_accumulation_steps, and the split evaluated."""
    setting = {k: list(v) if isinstance(v, tuple) else v for k, v in run.settings.items()}
    hp = copy.deepcopy(hp)
    hp["task"] = run.task
    hp["shared"].update({k: setting.pop(k) for k in SHARED_KEYS if k in setting}, max_steps=run.max_steps)
    k = setting.pop("accumulation_steps", 1)
    o = table3.train_overrides(run.method, setting, hp, nproc, out_dir, run.seed)
    if k != 1:
        # DeepSpeed's key, which maps to train.accumulation_steps for every method: the config file
        # sets it (to 1), and a different train.accumulation_steps beside it is refused as a conflict.
        o["gradient_accumulation_steps"] = k
    o["eval.split"] = run.split
    return o


def tokens_of(run: Run, hp: dict) -> int:
    """Training sequences the run sees: optimizer steps x global batch x accumulation steps."""
    return run.max_steps * int(hp["shared"]["global_batch"]) * run.accumulation


class Ledger:
    """The sweep's committed record of finished runs: {run name: (config, overrides, result)}, with the
    config relative to the checkout and the overrides without the run's directory, so that a record
    made on one machine is the same run on another. Appended to as runs finish; of two lines for
    the same run, the last wins."""

    def __init__(self, path: str):
        self.path, self.entries = path, {}
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            rec = json.loads(line)
                            self.entries[self._key(rec["run"], rec["overrides"])] = rec
                        except (ValueError, KeyError) as e:
                            raise ValueError(f"{path}:{n}: expected a JSON object with a 'run' key ({e})") from e

    @staticmethod
    def _portable(config: str, overrides: dict) -> tuple[str, dict]:
        return os.path.relpath(config, ROOT), {k: v for k, v in overrides.items() if k != "output.dir"}

    @staticmethod
    def _key(name: str, portable_overrides: dict) -> str:
        return name + " " + json.dumps(portable_overrides, sort_keys=True)

    def find(self, name: str, config: str, overrides: dict) -> dict | None:
        """The recorded result of the run `name` with this config and these overrides, or None."""
        config, overrides = self._portable(config, overrides)
        rec = self.entries.get(self._key(name, overrides))
        if rec is None or rec["config"] != config:
            return None
        return rec["result"] if rec["result"].get("rc") == 0 else None

    def add(self, name: str, config: str, overrides: dict, res: dict) -> None:
        config, overrides = self._portable(config, overrides)
        rec = {"run": name, "config": config, "overrides": overrides, "result": res}
        self.entries[self._key(name, overrides)] = rec
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec, sort_keys=True) + "\n")


class Runner:
    """Runs (or, over budget, only looks up) the sweep's runs; one directory and result file per run,
    and a line of the ledger per finished run."""

    def __init__(self, hp: dict, a, runnable: set[tuple[int, str]]):
        self.hp, self.a = hp, a
        self.ledger = Ledger(a.ledger)
        self.runnable = runnable  # the (stage, method) pairs this invocation may run; the rest are looked up
        self.nproc = int(hp.get("ranks", 2))
        self.config = os.path.join(ROOT, hp.get("config", "ds_configs/cpu_default.json"))
        self.started = 0
        self.missing: list[Run] = []  # runs the sweep needs that have not finished

    def __call__(self, run: Run) -> dict | None:
        """The run's result ({"accuracy", "minutes", ...}), or None when it has not finished and is not run now."""
        out_dir = os.path.join(self.a.runs_dir, run.name)
        overrides = {**overrides_of(run, self.hp, self.nproc, out_dir), **self.a.extra_overrides}
        res = table3.finished_run(out_dir, self.config, overrides)
        if res is None:  # not on this machine: a run recorded elsewhere
            res = self.ledger.find(run.name, self.config, overrides)
        may_run = (run.stage, run.method) in self.runnable
        if res is not None and (self.a.reuse or not may_run):
            return self._result(run, res)
        if may_run:
            self.missing.append(run)
        if not may_run or (self.a.max_runs is not None and self.started >= self.a.max_runs):
            return None
        program = table3.train_program(self.config, overrides)
        self.started += 1
        if self.a.dry_run:
            print(shlex.join(torchrun_command(program, self.nproc, port=29500)))
            return None
        res = table3.run_train(program, self.nproc, True, out_dir, self.a.timeout)
        table3.record_run(out_dir, self.config, overrides, res)
        if res.get("rc") == 0 and not self.a.extra_overrides:  # a --set smoke run is not the sweep's
            self.ledger.add(run.name, self.config, overrides, res)
        out = self._result(run, res)
        if out is not None:
            self.missing.remove(run)
        acc = "FAILED" if out is None else f"{out['accuracy']:.1f}%"
        print(f"[{run.name}] {table3.describe(run.method, run.settings)} -> {acc} ({res['minutes']:.1f} min)",
              flush=True)
        return out

    def _result(self, run: Run, res: dict) -> dict | None:
        acc = table3.accuracy_of(run.method, res)
        if res.get("rc") != 0 or acc is None:
            return None
        if res.get("eval_split", "validation") != run.split:
            raise RuntimeError(f"{run.name}: evaluated on {res.get('eval_split')!r}, expected {run.split!r}")
        return {"accuracy": acc, "minutes": res["minutes"], "steps": res.get("steps"),
                "eval_examples": res.get("eval_examples"), "last_loss": res.get("last_loss")}


# ----------------------------------------------------------------------------- the two stages
def axes_of(hp: dict, method: str) -> dict[str, list[dict]]:
    """{axis: [partial settings]} of a method's coordinate search, the accumulation axis only when
    lomo_ds has accumulation."""
    out = {}
    for axis, values in hp["methods"][method].get("axes", {}).items():
        if axis == "accumulation_steps" and not accumulation_available():
            continue
        out[axis] = [v if isinstance(v, dict) else {axis: v} for v in values]
    return out


def stage1_runs_of(hp: dict, method: str, setting: dict) -> list[Run]:
    """The stage-1 runs of one setting: at equal optimizer steps, and for K > 1 also at equal tokens
    (max_steps / K optimizer steps of K micro-batches)."""
    sh = hp["shared"]
    base = Run(1, method, freeze(setting), hp["tune_task"], table3.seeds_of(hp)[0], "validation", int(sh["max_steps"]))
    k = base.accumulation
    if k == 1:
        return [base]
    return [base, dataclasses.replace(base, max_steps=max(1, int(sh["max_steps"]) // k))]


@dataclass
class Search:
    """A method's stage-1 coordinate search: every run tried with its result, and the best so far."""

    method: str
    budget: int  # batches each run may see: the benchmark's max_steps at K = 1 (its token budget)
    tried: list = field(default_factory=list)  # [(Run, result or None)]
    complete: bool = True

    def eligible(self, run: Run) -> bool:
        """Whether `run` saw the budget's tokens. A K > 1 run at equal optimizer steps sees K times the
        examples every other method trains on, so it is shown beside the others but never chosen:
        stage 2 compares every method at the same examples and the same optimizer steps as AdamW's."""
        return run.max_steps * run.accumulation == self.budget

    @property
    def best(self) -> tuple | None:
        done = [(r, res) for r, res in self.tried if res is not None and self.eligible(r)]
        return max(done, key=lambda x: x[1]["accuracy"]) if done else None  # ties: the earlier


def stage1(hp: dict, method: str, runner: Runner) -> Search:
    """Base setting, then each axis's values from the best setting so far. Stops at the first run
    that has not finished (the next axis depends on it)."""
    search = Search(method, int(hp["shared"]["max_steps"]))
    seen: set[Run] = set()

    def trial(setting: dict) -> bool:
        for run in stage1_runs_of(hp, method, setting):
            if run in seen:
                continue
            seen.add(run)
            res = runner(run)
            search.tried.append((run, res))
            if res is None:
                search.complete = False
        return search.complete

    if not trial(dict(hp["methods"][method]["base"])):
        return search
    for variants in axes_of(hp, method).values():
        start = search.best[0].settings
        for variant in variants:
            trial({**start, **variant})
        if not search.complete:
            return search
    return search


def step_multiples(hp: dict) -> dict[str, int]:
    """quality.yaml's `step_multiple`: per task, how many times stage 1's steps its stage-2 runs take
    (a task on which AdamW has not settled by then); 1 for the others."""
    given = hp.get("step_multiple") or {}
    for task, k in given.items():
        if task not in hp["tasks"]:
            raise ValueError(f"quality.yaml step_multiple: unknown task {task!r}; expected one of {hp['tasks']}")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"quality.yaml step_multiple.{task}: expected a whole number >= 1, got {k!r}")
    return {t: int(given.get(t, 1)) for t in hp["tasks"]}


def also_of(hp: dict, method: str) -> list[tuple[str, Run]]:
    """quality.yaml's `also` of a method: {label: setting} that stage 2 runs beside the search's best,
    each a row of its own (a shipped recipe the search did not choose, say), as (label, the setting's
    stage-1 run at the budget's examples). The goals stay on the search's best."""
    at_budget = Search(method, int(hp["shared"]["max_steps"])).eligible
    out = []
    for label, setting in (hp["methods"][method].get("also") or {}).items():
        if not isinstance(setting, dict):
            raise ValueError(f"quality.yaml methods.{method}.also.{label}: expected a mapping of setting keys, "
                             f"got {setting!r}")
        out.append((label, next(r for r in stage1_runs_of(hp, method, setting) if at_budget(r))))
    return out


def stage2(hp: dict, method: str, best: Run | None, runner: Runner) -> list[tuple]:
    """[(Run, result or None)] of `best`'s setting (zero-shot: none) on every task and seed, heldout,
    for the best run's steps times the task's step multiple (so a K > 1 setting chosen at equal tokens
    keeps equal tokens). Zero-shot does not train nor depend on the seed: one run per task."""
    seeds = table3.seeds_of(hp)
    multiple = step_multiples(hp)
    if method == "zero_shot":
        setting, steps, seeds = (), int(hp["shared"]["max_steps"]), seeds[:1]
        multiple = dict.fromkeys(multiple, 1)
    else:
        setting, steps = best.setting, best.max_steps
    out = []
    for task in hp["tasks"]:
        for seed in seeds:
            run = Run(2, method, setting, task, seed, "heldout", steps * multiple[task])
            out.append((run, runner(run)))
    return out


# ----------------------------------------------------------------------------- the table
def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def stage1_table(searches: dict[str, Search], hp: dict) -> list[str]:
    lines = [f"### Stage 1: coarse grid on {TASKS[hp['tune_task']].title}, seed {table3.seeds_of(hp)[0]}, "
             "validation split", "",
             "Coordinate search per method (experiments/quality.yaml): the base setting, then each axis from "
             "the best setting so far; **bold**: the method's best.", "",
             "| method | setting | steps | tokens | accuracy | minutes |", "|---|---|---|---|---|---|"]
    for method, search in searches.items():
        best = search.best
        for run, res in search.tried:
            acc = "not run yet" if res is None else _pct(res["accuracy"])
            if best is not None and run == best[0]:
                acc = f"**{acc}**"
            elif res is not None and not search.eligible(run):
                acc += f" ({run.accumulation}x the tokens: not chosen)"
            minutes = "-" if res is None else f"{res['minutes']:.1f}"
            lines.append(f"| {table3.METHOD_NAMES[method]} | {table3.describe(method, run.settings)} | {run.max_steps} "
                         f"| {tokens_of(run, hp)} | {acc} | {minutes} |")
        if not search.complete:
            lines.append(f"| {table3.METHOD_NAMES[method]} | (search not finished) | | | | |")
    return lines


def stage2_rows(results: dict[tuple[str, str | None], list[tuple]]) -> list[dict]:
    """Per (method, label: None for the search's best, else an `also` setting's): the accuracies per
    task and seed of the finished runs, their mean and minimum."""
    rows = []
    for (method, label), runs in results.items():
        per_task: dict[str, dict[int, float]] = {}
        for run, res in runs:
            if res is not None:
                per_task.setdefault(run.task, {})[run.seed] = res["accuracy"]
        accs = [a for seeds in per_task.values() for a in seeds.values()]
        first = min((run for run, _ in runs), key=lambda run: run.max_steps, default=None)
        rows.append({"method": method, "label": label, "setting": first.settings if first else {}, "per_task": per_task,
                     "steps": 0 if method == "zero_shot" or not first else first.max_steps,
                     "accumulation": first.accumulation if first else 1,
                     "runs": len(accs), "planned": len(runs), "mean": sum(accs) / len(accs) if accs else None,
                     "min": min(accs) if accs else None})
    return rows


def goals(rows: list[dict]) -> list[str]:
    """The benchmark's goals on the 9-run means: LOMO >= AdamW - 2, AdaLomo >= AdamW."""
    by = {r["method"]: r for r in rows if r["label"] is None and r["mean"] is not None and r["runs"] == r["planned"]}
    if "adamw" not in by:
        return ["Goals: not judged yet (AdamW's stage 2 has not finished)."]
    out, ref = [], by["adamw"]["mean"]
    for method, margin in (("lomo", -2.0), ("adalomo", 0.0)):
        if method in by:
            ok = by[method]["mean"] >= ref + margin
            out.append(f"- {table3.METHOD_NAMES[method]} {by[method]['mean']:.1f} against AdamW {ref:.1f}"
                       f"{f' {margin:+g}' if margin else ''}: {'met' if ok else 'NOT met'}")
    return ["Goals (means over every task and seed):", ""] + out


def stage2_table(rows: list[dict], hp: dict) -> list[str]:
    tasks = hp["tasks"]
    lines = ["### Stage 2: each method's best setting, every task and seed, held-out split", "",
             "Mean and minimum over the finished runs (tasks x seeds); per task: mean, minimum and the "
             "per-seed figures (seeds " + ", ".join(map(str, table3.seeds_of(hp))) + "; zero-shot does not "
             "depend on the seed and runs once per task)."
             + "".join(f" {TASKS[t].title}'s runs take {k} times the steps and tokens shown (the same for every "
                       "method: AdamW had not settled there by then)." for t, k in step_multiples(hp).items() if k > 1),
             "",
             "| method | setting | steps | tokens | runs | mean | min | "
             + " | ".join(TASKS[t].title for t in tasks) + " |",
             "|---|---|---|---|---|---|---|" + "---|" * len(tasks)]
    for r in rows:
        cells = []
        for t in tasks:
            seeds = r["per_task"].get(t, {})
            vals = list(seeds.values())
            cells.append("-" if not vals else f"{sum(vals) / len(vals):.1f} (min {min(vals):.1f}; "
                         + " ".join(f"{a:.1f}" for a in vals) + ")")
        tokens = r["steps"] * int(hp["shared"]["global_batch"]) * r["accumulation"]
        name = table3.METHOD_NAMES[r["method"]] + (f" ({r['label']})" if r["label"] else "")
        lines.append(f"| {name} | {table3.describe(r['method'], r['setting'])} | "
                     f"{r['steps']} | {tokens} | {r['runs']}/{r['planned']} | {_pct(r['mean'])} | {_pct(r['min'])} | "
                     + " | ".join(cells) + " |")
    return lines + [""] + goals(rows)


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + (" (with uncommitted changes)" if dirty else "")
    except OSError:
        return "unknown"


def section(searches: dict, stage2_results: dict, hp: dict, command: str, missing: int) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    sh = hp["shared"]
    lines = [BEGIN, "## Quality benchmark (python3 -m experiments.quality)", "",
             f"Written {now} at commit {commit()} by `{command}`.", "",
             f"Protocol: the built-in SmolLM2-135M, {hp.get('ranks', 2)} CPU ranks, {sh['max_steps']} optimizer steps "
             f"of global batch {sh['global_batch']} for every method (equal optimizer steps; the tokens column "
             f"counts sequences seen, which differ where K > 1), {sh['eval_samples']} evaluation examples, "
             f"max length {sh['max_length']}. "
             + ("" if accumulation_available() else "Accumulation steps are not swept: this lomo_ds has no "
                "train.accumulation_steps. ")
             + f"Runs of this piece not finished yet: {missing} (a search reaches its next runs once these finish).",
             ""]
    lines += stage1_table(searches, hp) + [""]
    if stage2_results:
        lines += stage2_table(stage2_rows(stage2_results), hp) + [""]
    return "\n".join(lines + [END]) + "\n"


def write_section(path: str, text: str) -> None:
    """Replace the quality section of `path` (between the markers), or append it; the rest is kept."""
    old = open(path, encoding="utf-8").read() if os.path.exists(path) else "# Results\n"
    if BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        new = head + text.rstrip("\n") + rest.split(END, 1)[1]
    else:
        new = old.rstrip("\n") + "\n\n" + text
    with open(path, "w", encoding="utf-8") as f:
        f.write(new)


# ----------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", type=int, choices=(1, 2), required=True,
                    help="1: the coarse grid on one task and seed; 2: the best settings on every task and seed")
    ap.add_argument("--only", default=None, help="comma list of methods (default all): " + ",".join(METHODS))
    ap.add_argument("--max-runs", type=int, default=None, help="start at most N new runs (0: only write the table)")
    ap.add_argument("--reuse", action="store_true", help="keep every run already finished with the same overrides")
    ap.add_argument("--dry-run", action="store_true", help="print the commands of the next runs, run nothing")
    ap.add_argument("--hparams", default=HPARAMS, help="the sweep's YAML (default experiments/quality.yaml)")
    ap.add_argument("--runs-dir", default=os.path.join(ROOT, "runs", "quality"), help="where the runs' directories go")
    ap.add_argument("--ledger", default=LEDGER, help="the committed record of finished runs (JSON lines)")
    ap.add_argument("--results", default=RESULTS_MD, help="the Markdown file whose quality section is rewritten")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra launch/train.py override for every run (a smoke test: train.max_steps=2)")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    a.extra_overrides = parse_override_args(a.set)
    methods = list(METHODS) if a.only is None else [m for m in a.only.split(",") if m]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        ap.error(f"--only: unknown {bad}; expected some of {list(METHODS)}")
    if a.max_runs is not None and a.max_runs < 0:
        ap.error("--max-runs: expected a number >= 0")
    hp = table3.load_hparams(a.hparams)
    # Only the asked stage's runs of the asked methods run; every other finished run is read, for
    # stage 2's choice of settings and for the table.
    runner = Runner(hp, a, {(a.stage, m) for m in methods})
    searches = {m: stage1(hp, m, runner) for m in METHODS if m != "zero_shot"}
    results = {}
    for m in METHODS:
        if m != "zero_shot" and not searches[m].complete:
            if a.stage == 2 and m in methods:
                print(f"{m}: stage 1 has not finished; run --stage 1 --only {m} --reuse first", file=sys.stderr)
            continue
        results[(m, None)] = stage2(hp, m, None if m == "zero_shot" else searches[m].best[0], runner)
        for label, run in also_of(hp, m) if m != "zero_shot" else ():
            results[(m, label)] = stage2(hp, m, run, runner)
    if a.dry_run:
        return 0
    command = "python3 -m experiments.quality " + shlex.join(sys.argv[1:] if argv is None else argv)
    write_section(a.results, section({m: s for m, s in searches.items() if s.tried},
                                     {m: r for m, r in results.items() if any(res for _, res in r)},
                                     hp, command, len(runner.missing)))
    print(f"{a.results}: quality section written; runs of this piece still missing: {len(runner.missing)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
