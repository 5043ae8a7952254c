"""The training program on 8-bit weight shards (memory.int8_shards, bf16) end to end on 2 ranks, with
its 8-bit export on (output.export_int8): each step's metrics say how many block scales it
recomputed; the bf16 export loads in transformers and holds, bitwise, the 8-bit export's weights
dequantized (the gathers dequantize the shards as load_int8_export does); the 8-bit export's integers
and scales are the engine's own, as its final checkpoint saved them (another writer: the engine's
state, piece by piece); and the option is refused without 8-bit shards."""
import json
import math
import os
import pathlib

import pytest
import torch
from safetensors.torch import load_file

from lomo_ds.config.errors import ConfigError
from lomo_ds.config.run import load_run_config
from lomo_ds.storage import int8_export
from tests.helpers_data import byte_bpe_tokenizer
from tests.ranks import ROOT, multi_rank, ok, run_here, work_dir
from tests.tiny import save_tiny_model

STEPS = 3
BLOCK = 16  # several blocks a tensor, and blocks cut between the 2 ranks (tiny_llama_config's odd sizes)
PERSIST = 100  # the norms (40 elements) stay whole on every rank, in bf16: unquantized parameters


def _write_config(root: pathlib.Path) -> pathlib.Path:
    """tiny_cpu.json's run on the tiny model saved under `root`, in bf16 on 8-bit shards, both exports."""
    with open(os.path.join(ROOT, "ds_configs", "tiny_cpu.json")) as f:
        cfg = json.load(f)
    cfg["model"]["path"] = str(root / "model")
    cfg["bf16"] = {"enabled": True}
    cfg["memory"] = {"int8_shards": True, "int8_block": BLOCK}
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = PERSIST
    cfg["lomo"]["lr"] = 0.05
    cfg["train"].update({"max_steps": STEPS})
    cfg["data"].update({"train_samples": 12})  # 3 steps of 2 ranks x 2 rows
    cfg["eval"]["at_end"] = False
    cfg["output"].update({"export_hf": True, "export_int8": True})
    path = root / "run.json"
    path.write_text(json.dumps(cfg))
    return path


@multi_rank(worlds=[2])
def int8_run() -> dict:
    """launch/train.py's main on the 2-rank launch: 3 steps on 8-bit shards, both exports."""
    from lomo_ds.recipe.train import main

    root = pathlib.Path(work_dir()) / "int8_run"
    if torch.distributed.get_rank() == 0:
        save_tiny_model(root / "model", byte_bpe_tokenizer())
        _write_config(root)
    torch.distributed.barrier()
    run = run_here(main, ["--config", str(root / "run.json"), "--output-dir", str(root / "run")])
    return {"rc": run["rc"], "stdout": run["stdout"][-3000:], "out": str(root / "run")}


@pytest.fixture(scope="module")
def run_dir(rank_results) -> pathlib.Path:
    r = ok(rank_results(2), int8_run)
    assert r["rc"] == 0, r["stdout"]
    return pathlib.Path(r["out"])


def test_every_step_reports_its_recomputed_scales(run_dir):
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert all(isinstance(s["int8_rescaled_blocks"], int) and s["int8_rescaled_blocks"] >= 0 for s in steps), steps


def test_the_bf16_export_is_the_8bit_export_dequantized_bitwise(run_dir):
    """hf_model (gathered: the shards dequantized by the run's gathers) loads in transformers, and
    each of its tensors equals the 8-bit export's, dequantized by load_int8_export, bit for bit."""
    from transformers import AutoModelForCausalLM

    index = int8_export.read_index(run_dir / "hf_model_int8")
    params = index["parameters"]
    quantized = {n for n, e in params.items() if e["quantized"]}
    # Which tensors are 8-bit: every non-persistent one; the norms (whole on every rank) are not.
    assert quantized == {n for n in params if "norm" not in n} and len(quantized) < len(params)
    assert index["block"] == BLOCK and all(e["dtype"] == "bfloat16" for e in params.values())
    model = AutoModelForCausalLM.from_pretrained(run_dir / "hf_model")
    hf = dict(model.named_parameters())
    assert set(hf) == set(params)
    ours = int8_export.load_int8_export(run_dir / "hf_model_int8")
    for name, t in ours.items():
        assert t.dtype == hf[name].dtype == torch.bfloat16, name
        same = torch.equal(t.view(torch.int16), hf[name].detach().view(torch.int16))
        assert same, f"{name}: {(t.float() != hf[name].detach().float()).sum().item()} elements differ"
    # ...and the model built from the 8-bit export is the same model.
    built = dict(int8_export.load_int8_model(run_dir / "hf_model_int8").named_parameters())
    assert all(torch.equal(built[n].detach(), hf[n].detach()) for n in hf)


def _checkpoint(run_dir: pathlib.Path) -> tuple[dict, dict]:
    """The final checkpoint's weight shards (whole flat tensors: the 2 ranks' pieces put together by
    torch.distributed.checkpoint) and its 8-bit scales."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    state = run_dir / "checkpoints" / f"step_{STEPS:08d}" / "engine_state"
    merged = run_dir / "engine_state_merged.pt"
    if not merged.exists():
        dcp_to_torch_save(state, merged)
    flat = torch.load(merged, weights_only=True)
    shards = {k.split("/", 1)[1]: v for k, v in flat.items() if k.startswith("shards/")}
    rest = torch.load(state / "replicated.pt", weights_only=True)
    scales = next(v for k, v in _walk(rest) if k.endswith("int8_scales"))
    return shards, scales


def _walk(node, prefix=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield f"{prefix}/{k}", v
            yield from _walk(v, f"{prefix}/{k}")


def test_the_8bit_export_holds_the_engines_integers_and_scales(run_dir):
    """The integers and scales written by the export's gather (the int8 pieces over the group and a
    MAX over the scales) are those the engine's checkpoint saved, element for element."""
    shards, scales = _checkpoint(run_dir)
    index = int8_export.read_index(run_dir / "hf_model_int8")
    files = {f: load_file(run_dir / "hf_model_int8" / f) for f in set(index["weight_map"].values())}
    stored = {k: files[f][k] for k, f in index["weight_map"].items()}
    quantized = [n for n, e in index["parameters"].items() if e["quantized"]]
    assert set(quantized) == set(scales)
    cut = 0
    for name in quantized:
        q, s = stored[name], stored[name + int8_export.SCALES]
        same_q = q.dtype == torch.int8 and torch.equal(q.reshape(-1), shards[name].reshape(-1)[:q.numel()])
        assert same_q, f"{name}: integers differ from the checkpoint's"
        same_s = s.shape == (math.ceil(q.numel() / BLOCK),) and torch.equal(s, scales[name])
        assert same_s, f"{name}: scales differ from the checkpoint's"
        assert (s > 0).all(), name  # no block left at the grid's zero: each rank's pieces are in
        part = math.ceil(q.numel() / 2)
        cut += part % BLOCK != 0
    assert cut > 0  # a block cut between the ranks is among them: its scale came from both
    for name, e in index["parameters"].items():
        if not e["quantized"]:
            assert stored[name].dtype == torch.bfloat16 and name + int8_export.SCALES not in stored


@pytest.mark.parametrize("change, expected", [
    ({"memory": {"int8_shards": False}}, r"output\.export_int8: expected memory\.int8_shards true"),
    ({"output": {"export_hf": False}}, r"output\.export_int8: expected output\.export_hf true"),
    ({"train": {"method": "lora_lomo"}}, r"output\.export_int8: expected train\.method 'lomo', got 'lora_lomo'"),
], ids=["without_int8_shards", "without_export_hf", "lora"])
def test_the_8bit_export_is_refused_where_there_is_no_8bit_model_to_write(change, expected):
    raw = {"model": {"path": "m"}, "lomo": {"lr": 0.03}, "bf16": {"enabled": True},
           "memory": {"int8_shards": True}, "output": {"export_int8": True}, "train": {}}
    for section, values in change.items():
        raw[section] = {**raw[section], **values}
    with pytest.raises(ConfigError, match=expected):
        load_run_config(raw, check_files=False)
    raw["output"]["export_int8"] = False
    load_run_config(raw, check_files=False)  # the same config without the 8-bit export loads
