"""Talking to a model: `lomo-ds generate` answers prompts, `lomo-ds chat` is a terminal conversation.
Both take a Hugging Face directory with a chat template, such as a run's export (output.dir/hf_model).

    lomo-ds generate --model runs/cpu_chat/hf_model --prompt "Extract item=count: Ada has 3 cups."
    lomo-ds generate --model DIR --file prompts.jsonl --temperature 0.7 --top-p 0.9 --seed 1
    lomo-ds chat --model DIR --system "Be brief."          # /reset starts over, /quit or EOF ends

--file: JSONL records, each a conversation ({"messages": [...]} ending with the user's turn) or
{"prompt": str}; any other file: one prompt per non-empty line. One JSON line is printed per prompt.
A conversation longer than --max-length (default: the model's max_position_embeddings) minus
--max-new-tokens loses whole earliest turns, the system message kept; the count is printed.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from lomo_ds.data.chat import chat_format, checked_turn, encode_prompt
from lomo_ds.data.collate import pad_id_of
from lomo_ds.data.errors import DataError
from lomo_ds.data.io import read_jsonl
from lomo_ds.evaluation.generation import generate_ids


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a Hugging Face model directory (e.g. a run's hf_model export)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy decoding")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (with --temperature > 0)")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed")
    p.add_argument("--max-length", type=int, default=None,
                   help="tokens of prompt + reply (default: the model's max_position_embeddings)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one, for a "
                                                         "model directory without one")
    p.add_argument("--system", default=None, help="a system message to start every conversation with")


class Talker:
    """A loaded model, its chat format and the decoding settings."""

    def __init__(self, args: argparse.Namespace):
        from transformers import AutoModelForCausalLM, AutoTokenizer  # loaded for a model only, not for --help

        if args.max_new_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1:
            raise ValueError("--max-new-tokens >= 1, --temperature >= 0 and 0 < --top-p <= 1 are needed")
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        self.chat = chat_format(tokenizer, args.chat_template)
        self.model = AutoModelForCausalLM.from_pretrained(args.model).eval()
        self.device = torch.device("cpu") if not torch.cuda.is_available() else torch.device("cuda")
        self.model.to(self.device)
        self.pad_id = pad_id_of(tokenizer)
        self.max_length = args.max_length or self.model.config.max_position_embeddings
        self.args = args
        self.seed = args.seed

    def reply(self, messages: list[dict]) -> tuple[str, int]:
        """(the model's reply to `messages`, earliest turns dropped to fit)."""
        budget = self.max_length - self.args.max_new_tokens
        ids, dropped = encode_prompt(self.chat, messages, budget)
        if ids is None:
            raise DataError(f"the last message alone is longer than --max-length {self.max_length} minus "
                            f"--max-new-tokens {self.args.max_new_tokens}")
        torch.manual_seed(self.seed)  # sampling draws from torch's generator: the same seed, the same reply
        self.seed += 1
        (out,) = generate_ids(self.model, [ids], stop_ids=self.chat.stop_ids, pad_id=self.pad_id,
                              max_new_tokens=self.args.max_new_tokens, device=self.device,
                              temperature=self.args.temperature, top_p=self.args.top_p)
        return self.chat.tokenizer.decode(out, skip_special_tokens=True), dropped

    def opening(self) -> list[dict]:
        return [{"role": "system", "content": self.args.system}] if self.args.system else []


def read_prompts(path: str) -> list[list[dict]]:
    """Conversations to answer, from --file (this module's docstring)."""
    if not path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            return [[{"role": "user", "content": line.strip()}] for line in f if line.strip()]
    out = []
    for record, where in read_jsonl(path):
        if isinstance(record, dict) and isinstance(record.get("messages"), list) and record["messages"]:
            messages = [checked_turn(t, k, where) for k, t in enumerate(record["messages"])]
            if messages[-1]["role"] != "user":
                raise DataError(f"{where}: the last turn is the {messages[-1]['role']}'s; "
                                f"a prompt ends with the user's")
            out.append(messages)
        elif isinstance(record, dict) and isinstance(record.get("prompt"), str):
            out.append([{"role": "user", "content": record["prompt"]}])
        else:
            raise DataError(f"{where}: expected {{\"messages\": [...]}} or {{\"prompt\": str}}")
    return out


def run_generate(args: argparse.Namespace) -> int:
    if (args.prompt is None) == (args.file is None):
        print("generate: give --prompt TEXT or --file PATH", file=sys.stderr)
        return 2
    try:
        conversations = [[{"role": "user", "content": args.prompt}]] if args.prompt is not None \
            else read_prompts(args.file)
        talker = Talker(args)
        for messages in conversations:
            reply, dropped = talker.reply(talker.opening() + messages)
            if args.prompt is not None:
                print(reply, flush=True)
            else:
                print(json.dumps({"messages": messages, "reply": reply, "turns_dropped": dropped},
                                 ensure_ascii=False), flush=True)
    except (DataError, ValueError, OSError) as e:
        print(f"generate: {e}", file=sys.stderr)
        return 2
    return 0


def run_chat(args: argparse.Namespace) -> int:
    try:
        talker = Talker(args)
    except (DataError, ValueError, OSError) as e:
        print(f"chat: {e}", file=sys.stderr)
        return 2
    interactive = sys.stdin.isatty()
    print(f"chatting with {args.model} (max {talker.max_length} tokens; /reset starts over, /quit ends)", flush=True)
    messages = talker.opening()
    while True:
        try:
            line = input("you> " if interactive else "")
        except EOFError:
            break
        if not interactive:
            print(f"you> {line}")
        text = line.strip()
        if not text:
            continue
        if text == "/quit":
            break
        if text == "/reset":
            messages = talker.opening()
            print("(conversation cleared)", flush=True)
            continue
        messages.append({"role": "user", "content": text})
        try:
            reply, dropped = talker.reply(messages)
        except DataError as e:
            print(f"({e}; message not sent)", flush=True)
            messages.pop()
            continue
        if dropped:
            kept_from = 1 if messages[0]["role"] == "system" else 0
            del messages[kept_from:kept_from + dropped]  # the model no longer sees them; neither does the history
            print(f"(dropped the {dropped} earliest turns to fit {talker.max_length} tokens)", flush=True)
        messages.append({"role": "assistant", "content": reply})
        print(f"model> {reply}", flush=True)
    return 0


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="answer prompts with a model directory (greedy or sampled)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(p)
    p.add_argument("--prompt", default=None, help="one user message")
    p.add_argument("--file", default=None, help="JSONL conversations/prompts, or a text file of one prompt a line")
    p.set_defaults(func=run_generate)


def add_chat(sub) -> None:
    p = sub.add_parser("chat", help="an interactive conversation with a model directory",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(p)
    p.set_defaults(func=run_chat)
