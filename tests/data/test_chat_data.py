"""The chat task's data (lomo_ds/data/chat.py): formats, the assistant-only loss, the template
setting, truncation by whole turns, hub datasets through datasets.load_dataset, and bad records."""
from __future__ import annotations

import json

import pytest

from lomo_ds.config.errors import ConfigError
from lomo_ds.config.run import load_run_config
from lomo_ds.data import chat as C
from lomo_ds.data.errors import DataError
from lomo_ds.data.loading import build_datasets
from tests.helpers_data import CHATML, chatml_tokenizer, conversation, write_jsonl


def run_cfg(source, **over):
    data = {"task": "chat", "source": str(source), **over.pop("data", {})}
    return load_run_config({"model": {"path": "x"}, "lomo": {"lr": 0.03}, "data": data,
                            "tokenizer": {"max_length": over.pop("max_length", 128), **over.pop("tokenizer", {})},
                            **over})


def labelled_text(tok, ex) -> str:
    return tok.decode([i for i, lab in zip(ex["input_ids"], ex["labels"], strict=True) if lab != -100])


def test_loss_on_every_assistant_turn_and_its_end_of_turn_token_only():
    tok = chatml_tokenizer()
    chat = C.chat_format(tok)
    assert tok.convert_ids_to_tokens(chat.end_of_turn_id) == "<|im_end|>"
    msgs = conversation("the cat", "sat", "on the", "mat", system="Be brief.")["messages"]
    ex = C.encode_conversation(chat, msgs, 128)
    assert labelled_text(tok, ex) == "sat<|im_end|>mat<|im_end|>"
    assert tok.decode(ex["input_ids"]) == chat.render(msgs)
    # the default system message of the template is rendered but never labelled
    ex = C.encode_conversation(chat, conversation("the cat", "sat")["messages"], 128)
    assert "You help." in tok.decode(ex["input_ids"]) and labelled_text(tok, ex) == "sat<|im_end|>"


@pytest.mark.parametrize("record, messages", [
    ({"instruction": "Add", "input": "2 and 3", "output": "5"},
     [{"role": "user", "content": "Add\n\n2 and 3"}, {"role": "assistant", "content": "5"}]),
    ({"instruction": "Say hi", "input": "", "output": "hi"},
     [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}]),
    ({"prompt": "Q?", "response": "A."}, [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}]),
    ({"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                        {"from": "gpt", "value": "A"}]},
     [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]),
])
def test_formats_map_onto_conversations(record, messages):
    assert C.conversation_of(record, "f:1") == messages


BAD = {
    "unknown_role": ('{"messages": [{"role": "bot", "content": "x"}, {"role": "assistant", "content": "y"}]}',
                     r"bad\.jsonl:2: turn 0: unknown role 'bot'; expected one of system, user, assistant"),
    "no_assistant": ('{"messages": [{"role": "user", "content": "x"}]}',
                     r"bad\.jsonl:2: no assistant turn"),
    "empty_content": ('{"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "y"}]}',
                      r"bad\.jsonl:2: turn 0 \(user\) content: empty content"),
    "non_string_content": ('{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]}',
                           r"bad\.jsonl:2: turn 0 \(user\) content: expected a string, got int 3"),
    "malformed_json": ('{"messages": [{"role": "user", "content": "x"}', r"bad\.jsonl:2: not valid JSON"),
    "sharegpt_role": ('{"conversations": [{"from": "robot", "value": "x"}]}',
                      r"bad\.jsonl:2: turn 0: unknown role 'robot'"),
    "ends_with_user": ('{"messages": [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]}',
                       r"bad\.jsonl:2: the last turn is the user's"),
    "not_a_conversation": ('{"text": "x"}', r"bad\.jsonl:2: not a conversation: expected 'messages'"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_records_are_named_with_file_and_line(tmp_path, case, capsys):
    line, message = BAD[case]
    path = write_jsonl(str(tmp_path / "bad.jsonl"), [conversation("q", "a"), line, conversation("q", "b")])
    with pytest.raises(DataError, match=message) as err:
        build_datasets(run_cfg(path), chatml_tokenizer())
    with capsys.disabled():
        print(f"\n  {case}: DataError: {err.value}")


def test_a_tokenizer_without_a_template_is_an_error_and_the_config_supplies_one(tmp_path):
    path = write_jsonl(str(tmp_path / "t.jsonl"), [conversation("q", "a")])
    with pytest.raises(DataError, match=r"has no chat template; set tokenizer.chat_template"):
        build_datasets(run_cfg(path), chatml_tokenizer(template=False))
    inline = build_datasets(run_cfg(path, tokenizer={"chat_template": CHATML}), chatml_tokenizer(template=False))
    (tmp_path / "chatml.jinja").write_text(CHATML)
    tok = chatml_tokenizer(template=False)
    from_file = build_datasets(run_cfg(path, tokenizer={"chat_template": str(tmp_path / "chatml.jinja")}), tok)
    assert inline.train == from_file.train and tok.chat_template == CHATML  # the export saves this tokenizer
    with pytest.raises(ConfigError, match=r"tokenizer\.chat_template: 'nope\.jinja' is neither a Jinja template"):
        run_cfg(path, tokenizer={"chat_template": "nope.jinja"})


def test_long_conversations_lose_whole_earliest_turns_and_are_counted(tmp_path):
    long = conversation(*[w for i in range(6) for w in (f"question {i} the cat sat", f"answer {i}")], system="Sys.")
    records = [long, conversation("the cat", "sat"), conversation("the cat " * 40, "sat")]
    write_jsonl(str(tmp_path / "train.jsonl"), records)
    data = build_datasets(run_cfg(tmp_path, max_length=60), chatml_tokenizer())
    assert data.stats["train"] == {"read": 3, "sampled": 3, "kept": 2, "truncated": 1, "dropped_too_long": 1,
                                   "turns_dropped": data.stats["train"]["turns_dropped"]}
    tok = chatml_tokenizer()
    (cut,) = [e for e in data.train if e["turns_dropped"]]
    text = tok.decode(cut["input_ids"])
    assert text.startswith("<|im_start|>system\nSys.<|im_end|>") and "answer 5<|im_end|>" in text
    assert "question 0" not in text and len(cut["input_ids"]) <= 60 and cut["turns_dropped"] % 2 == 0
    assert labelled_text(tok, cut).endswith("answer 5<|im_end|>")
    reject = build_datasets(run_cfg(tmp_path, max_length=60, tokenizer={"overlong": "reject"}), chatml_tokenizer())
    assert reject.stats["train"]["kept"] == 1 and reject.stats["train"]["dropped_too_long"] == 2


def test_every_record_by_default_for_chat_and_instruction(tmp_path):
    write_jsonl(str(tmp_path / "train.jsonl"), [conversation(f"q{i}", "a") for i in range(1200)])
    assert run_cfg(tmp_path).data.train_samples is None
    data = build_datasets(run_cfg(tmp_path), chatml_tokenizer())
    assert data.stats["train"]["read"] == data.stats["train"]["kept"] == 1200 and data.group_by_length
    inst = load_run_config({"model": {"path": "x"}, "lomo": {"lr": 0.03},
                            "data": {"task": "instruction", "source": str(tmp_path / "train.jsonl")}})
    assert inst.data.train_samples is None
    assert load_run_config({"model": {"path": "x"}, "lomo": {"lr": 0.03}}).data.train_samples == 1000


def test_packing_and_generation_prompts(tmp_path):
    write_jsonl(str(tmp_path / "train.jsonl"), [conversation(f"q{i}", f"a{i}") for i in range(9)])
    write_jsonl(str(tmp_path / "validation.jsonl"),
                [conversation("the cat", "sat", "on the", f"mat {i}", system="S.") for i in range(5)])
    tok = chatml_tokenizer()
    data = build_datasets(run_cfg(tmp_path, data={"packing": True}, eval={"generate_samples": 3}), tok)
    assert data.packed and sum(len(r["lengths"]) for r in data.train) == 9 and len(data.train) < 9
    assert len(data.eval_lm) == 5 and len(data.eval_prompts) == 3
    p = data.eval_prompts[0]
    assert p["reference"].startswith("mat ") and p["messages"][-1] == {"role": "user", "content": "on the"}
    assert tok.decode(p["prompt_ids"]).endswith("on the<|im_end|>\n<|im_start|>assistant\n")


def test_hub_dataset_through_load_dataset_with_a_column_mapping(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    rows = {"question": ["2+2?", "3+3?", "4+4?"], "answer": ["4", "6", "8"]}
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows),
                               "test": datasets.Dataset.from_dict({k: v[:1] for k, v in rows.items()})})
    dd.save_to_disk(str(tmp_path / "saved"))  # a dataset directory as save_to_disk writes it
    for split, ds in dd.items():  # and as the hub lays out its Parquet export
        ds.to_parquet(str(tmp_path / "hub" / "data" / f"{split}-00000-of-00001.parquet"))
    tok = chatml_tokenizer()
    for where in ("saved", "hub"):
        cfg = run_cfg(f"hub:{tmp_path / where}", data={"columns": {"prompt": "question", "response": "answer"},
                                                        "hub_eval_split": "test"})
        data = build_datasets(cfg, tok)
        assert data.stats["train"]["kept"] == 3 and data.stats["eval"]["kept"] == 1
        assert sorted(labelled_text(tok, e) for e in data.train) == ["4<|im_end|>", "6<|im_end|>", "8<|im_end|>"]
    with pytest.raises(DataError, match=r"x: data.columns names \['answer'\] but the record has only \['question'\]"):
        C.conversation_of({"question": "q"}, "x", {"prompt": "question", "response": "answer"})


def test_config_checks_for_chat(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.source: the 'chat' task needs conversations"):
        load_run_config({"model": {"path": "x"}, "lomo": {"lr": 0.03}, "data": {"task": "chat"}})
    with pytest.raises(ConfigError, match=r"data\.packing: task 'builtin' is scored by candidates"):
        load_run_config({"model": {"path": "x"}, "lomo": {"lr": 0.03}, "data": {"packing": True}})
    with pytest.raises(ConfigError, match=r"eval\.generate_samples: generation is evaluated on conversations"):
        load_run_config({"model": {"path": "x"}, "lomo": {"lr": 0.03}, "eval": {"generate_samples": 4}})


def test_builtin_chat_task_reads_the_shipped_files():
    cfg = load_run_config({"model": {"path": "x"}, "lomo": {"lr": 0.03}, "data": {"task": "builtin_chat"}})
    data = build_datasets(cfg, chatml_tokenizer())
    assert data.stats["train"]["kept"] == data.stats["train"]["read"] > 0 and data.stats["eval"]["read"] > 0
    assert json.dumps(data.stats)  # printable as the run's data line
