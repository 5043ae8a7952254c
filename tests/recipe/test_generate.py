"""Generation (lomo_ds/evaluation/generation.py) and the `lomo-ds generate` / `lomo-ds chat`
commands on a tiny LLaMA saved with a ChatML tokenizer, as a run's export is."""
from __future__ import annotations

import io
import json

import pytest
import torch
from transformers import LlamaForCausalLM

from lomo_ds import cli
from lomo_ds.evaluation.generation import cut_at_stop, generate_ids, left_padded, score
from tests.helpers_data import chatml_tokenizer
from tests.tiny import tiny_llama_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_model")
    tok = chatml_tokenizer()
    torch.manual_seed(0)
    cfg = tiny_llama_config(vocab=len(tok))
    cfg.max_position_embeddings = 256
    LlamaForCausalLM(cfg).save_pretrained(root)
    tok.save_pretrained(root)
    return root


def test_greedy_stops_at_a_stop_token_and_left_padding_changes_nothing():
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).eval()
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12]]
    cpu = torch.device("cpu")
    alone = [generate_ids(model, [p], stop_ids=[], pad_id=0, max_new_tokens=6, device=cpu)[0] for p in prompts]
    assert all(len(a) == 6 for a in alone)
    assert generate_ids(model, prompts, stop_ids=[], pad_id=0, max_new_tokens=6, device=cpu) == alone
    stop = alone[0][3]
    stopped = generate_ids(model, prompts, stop_ids=[stop], pad_id=0, max_new_tokens=6, device=cpu)
    assert stopped[0] == alone[0][:alone[0].index(stop)] and stopped[1] == cut_at_stop(alone[1], [stop])
    assert left_padded(prompts, 0, cpu)["attention_mask"].tolist()[1] == [0, 0, 0, 0, 1, 1]


def test_sampling_is_seeded():
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).eval()
    cpu = torch.device("cpu")

    def sample(seed):
        torch.manual_seed(seed)
        return generate_ids(model, [[5, 6, 7]], stop_ids=[], pad_id=0, max_new_tokens=12, device=cpu,
                            temperature=1.5, top_p=0.95)[0]

    assert sample(1) == sample(1) and sample(1) != sample(2)


def test_score():
    assert score(" spoons=3 ", "spoons=3") == {"exact_match": True, "contains": True}
    assert score("It is spoons=3.", "spoons=3") == {"exact_match": False, "contains": True}


def test_generate_command_prompt_and_file(model_dir, tmp_path, capsys):
    args = ["generate", "--model", str(model_dir), "--max-new-tokens", "5"]
    assert cli.main(args + ["--prompt", "the cat sat"]) == 0
    first = capsys.readouterr().out
    assert cli.main(args + ["--prompt", "the cat sat"]) == 0
    assert capsys.readouterr().out == first  # greedy: the same reply every time
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "the cat sat"}) + "\n" + json.dumps(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                      {"role": "user", "content": "the cat sat"}]}) + "\n")
    assert cli.main(args + ["--file", str(prompts), "--temperature", "0.8", "--top-p", "0.9", "--seed", "3"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert len(lines) == 2 and lines[1]["messages"][-1]["content"] == "the cat sat" and lines[1]["turns_dropped"] == 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}\n')
    assert cli.main(args + ["--file", str(bad)]) == 2
    assert "bad.jsonl:1: the last turn is the assistant's" in capsys.readouterr().err


def test_chat_command_over_stdin_drops_earliest_turns(model_dir, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("the cat sat on the mat\nthe dog\n/reset\nhello there\n"))
    assert cli.main(["chat", "--model", str(model_dir), "--max-new-tokens", "6", "--max-length", "60",
                     "--system", "Be brief."]) == 0
    out = capsys.readouterr().out
    assert out.count("model> ") == 3 and "(conversation cleared)" in out
    # the second message does not fit beside the first exchange in 60 - 6 tokens: that exchange goes
    assert "(dropped the 2 earliest turns to fit 60 tokens)" in out


def test_a_model_without_a_chat_template_is_refused(tmp_path, capsys):
    tok = chatml_tokenizer(template=False)
    LlamaForCausalLM(tiny_llama_config(vocab=len(tok))).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    assert cli.main(["generate", "--model", str(tmp_path), "--prompt", "hi"]) == 2
    assert "has no chat template; set tokenizer.chat_template" in capsys.readouterr().err


def test_a_models_chunked_prefill_is_turned_off():
    """A generation_config with prefill_chunk_size runs one prefill forward per chunk of the prompt:
    ranks with prompts of other lengths would run other numbers of forwards, each a ZeRO-3 gather
    (a hang). generate_ids prefills in one forward whatever the model's config says."""
    from lomo_ds.evaluation.generation import generate_ids
    from tests.tiny import tiny_llama

    model = tiny_llama(0)
    model.generation_config.prefill_chunk_size = 2
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    replies = generate_ids(model, [list(range(3, 12))], stop_ids=[], pad_id=0, max_new_tokens=2,
                           device=torch.device("cpu"))
    assert len(replies[0]) == 2 and len(forwards) == 2, "one prefill forward and one decoding forward"
