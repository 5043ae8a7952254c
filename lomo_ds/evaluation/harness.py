"""lm-evaluation-harness on an exported model, with tasks read from local files only.

Two kinds of task name:
- a lomo_ds task with candidates (builtin, rte, the quality tasks...): written here as a harness task
  (YAML plus a JSONL of the run's own eval examples: the same records, prompts and candidates
  lomo_ds's evaluation scores), so the harness's figure can be set beside lomo_ds's;
- any other name: a harness YAML task found under one of the `include` folders (the harness's own
  registry is not read: its tasks' data is on a hub).

The harness scores a candidate by the sum of its tokens' log-probabilities (`acc`) and by that sum
over the candidate's length in bytes (`acc_norm`); lomo_ds's evaluation takes the mean over tokens.
They agree wherever every candidate is one token, as in the Yes/No tasks.
"""
from __future__ import annotations

import json
import os
from typing import Any, Sequence

from lomo_ds.config.tasks import TASKS
from lomo_ds.data.examples import format_example
from lomo_ds.data.io import load_split, sample_indices

TASK_PREFIX = "lomo_"  # a lomo_ds task's name in the harness: lomo_builtin, lomo_rte, ...


class HarnessError(ValueError):
    """A harness run that cannot start: lm-eval missing, a task not found, a bad model folder."""


def _lm_eval():
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise HarnessError("evaluating with lm-evaluation-harness needs lm-eval: pip install 'lomo_ds[eval]'") from e
    return lm_eval, TaskManager


def scored_tasks() -> list[str]:
    """The lomo_ds tasks the harness can score (those with candidates)."""
    return sorted(name for name, spec in TASKS.items() if spec.has_candidates)


def write_task(run_cfg, out_dir: str) -> str:
    """Write run_cfg.data.task's eval examples as a harness task under out_dir/<harness name>/;
    returns the harness name. The records are the ones lomo_ds's evaluation samples (train.seed,
    data.eval_samples, eval.split), in the same order."""
    d = run_cfg.data
    if not TASKS[d.task].has_candidates:
        raise HarnessError(f"data.task {d.task!r} has no candidates to score; the harness tasks lomo_ds writes "
                           f"are {', '.join(scored_tasks())}")
    records = load_split(d, "eval", run_cfg.eval.split)
    rows = []
    for i in sample_indices(len(records), d.eval_samples, run_cfg.train.seed):
        ex = format_example(d.task, records[i])
        rows.append({"context": ex.prompt, "choices": list(ex.candidates), "label": ex.label})
    name = TASK_PREFIX + d.task
    folder = os.path.join(out_dir, name)
    os.makedirs(folder, exist_ok=True)
    data_file = os.path.abspath(os.path.join(folder, f"{name}.jsonl"))
    with open(data_file, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    # The harness's own YAML schema (a multiple-choice task over a local JSON file). The context
    # already ends where the answer starts, so no delimiter is added between them.
    yaml = "\n".join([
        f"task: {name}",
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {json.dumps(data_file)}",
        "test_split: test",
        "output_type: multiple_choice",
        'doc_to_text: "{{context}}"',
        'doc_to_choice: "{{choices}}"',
        'doc_to_target: "{{label}}"',
        'target_delimiter: ""',
        "metric_list:",
        "  - metric: acc",
        "    aggregation: mean",
        "    higher_is_better: true",
        "  - metric: acc_norm",
        "    aggregation: mean",
        "    higher_is_better: true",
        "metadata:",
        "  version: 1.0",
        "",
    ])
    with open(os.path.join(folder, f"{name}.yaml"), "w") as f:
        f.write(yaml)
    return name


def resolve_tasks(tasks: Sequence[str], include: Sequence[str], written: str | None = None):
    """A TaskManager that reads `include` and the folder lomo_ds `written` its tasks to; each task name
    is checked: one that no local folder holds is refused here."""
    _, TaskManager = _lm_eval()
    for folder in include:
        if not os.path.isdir(folder):
            raise HarnessError(f"harness include folder {folder!r} does not exist")
    # Local folders only: the harness's own registry names thousands of tasks whose data is on a hub
    # (indexing it costs seconds, and nothing here can fetch them).
    folders = [*include, *([written] if written else [])]
    manager = TaskManager(include_path=folders or None, include_defaults=False)
    known = set(manager.all_tasks)
    local = sorted(set(_local_names(include)))
    for name in tasks:
        if name not in known:
            where = ", ".join(include) or "no include folder"
            raise HarnessError(f"harness task {name!r} is not found locally ({where}; local tasks: "
                               f"{', '.join(local) or 'none'}); lomo_ds writes {', '.join(scored_tasks())} itself")
    return manager


def _local_names(include: Sequence[str]) -> list[str]:
    names = []
    for folder in include:
        for root, _, files in os.walk(folder):
            for f in files:
                if f.endswith((".yaml", ".yml")):
                    with open(os.path.join(root, f)) as fh:
                        for line in fh:
                            if line.startswith("task:"):
                                names.append(line.split(":", 1)[1].strip())
    return names


# The harness's names of the run's precisions (lomo_ds.config.lomo_section.Precision.dtype).
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def run(model_dir: str, tasks: Sequence[str], include: Sequence[str] = (), written: str | None = None,
        batch_size: int = 8, device: str = "cpu", limit: int | None = None,
        dtype: str = "auto") -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """The harness's metrics per task, {task: {"acc": .., "acc_stderr": .., "n": ..}}, and the model as
    the harness loaded it, {"dtype": "bfloat16", "params": ..}; model_dir being an exported Hugging
    Face folder (output.dir/hf_model). `dtype`: the harness's name of a torch dtype, or "auto" (the
    folder's config.json torch_dtype: an export's is its run's training dtype)."""
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise HarnessError(f"--model {model_dir!r} is not a Hugging Face model folder (no config.json); "
                           f"a run exports one to output.dir/hf_model")
    lm_eval, _ = _lm_eval()
    manager = resolve_tasks(tasks, include, written)
    out = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": model_dir, "dtype": dtype},
                                  tasks=list(tasks), batch_size=batch_size, device=device, limit=limit,
                                  task_manager=manager, log_samples=False, bootstrap_iters=0)
    results = {}
    for task, metrics in out["results"].items():
        clean = {k.split(",")[0]: v for k, v in metrics.items() if isinstance(v, (int, float))}
        clean["n"] = int(clean.pop("sample_len", 0))
        results[task] = clean
    # What lm-eval's model is (its parameters' dtype), not what it was asked for.
    loaded = out["config"].get("model_dtype")
    model = {"dtype": str(loaded).removeprefix("torch.") if loaded is not None else None,
             "params": out["config"].get("model_num_parameters"), "device": device}
    return results, model


def flat_metrics(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """{"harness/<task>/<metric>": value}: the form the run's metrics file and trackers take."""
    return {f"harness/{task}/{k}": float(v) for task, m in results.items() for k, v in m.items()
            if isinstance(v, (int, float))}
