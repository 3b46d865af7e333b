"""
A synthetic multi-hop world: the HotpotQA task in miniature, offline and deterministic, so the
whole pipeline (data, index, search tool, rollout, reward, training) runs in tests, the demo and
the tiny config without a download.

The world has people, companies, cities and countries with made-up names (so no model knows the
facts beforehand) and relations between them: a person was born in a city in some year and works
for a company; a company was founded by a person in some year and is headquartered in a city; a
city lies in a country and was founded in some year; a country has a capital. Each entity has one
passage, in the corpus format ({"id", "title", "text"}), that states only its own relations.

Questions are 1-hop ("Where was X born?": the answer is in X's passage) or 2-hop ("In which
country was X born?": X's passage names the city, the city's passage names the country, and X's
passage alone does not answer it). Every name word is unique in the world, so each answer is
unambiguous. The same seed and sizes give the same world, passages, questions and split.

The task is HotpotQA's (system prompt, question wording, search tool, scoring) on this world;
prepare() also writes the corpus (OUT/corpus.jsonl) for build_index.py, and there are scripted
demonstrations for a warm start.
"""

import json
import os
import random

from nanoagent.data import write_prompts
from nanoagent.tasks.hotpotqa import QUESTION, SYSTEM_PROMPT, prompts, qa_row, score, tools  # noqa: F401 (the task interface)

ONSETS = ["b", "br", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "tr", "v", "z"]
VOWELS = ["a", "e", "i", "o", "u", "a", "e", "o"]
CODAS = ["", "", "", "n", "r", "l", "s", "m"]
CITY_ENDS = ["by", "ford", "holm", "mere", "stad", "wick", "port", "burg"]
COUNTRY_ENDS = ["ia", "land", "ora", "istan", "mar"]
COMPANY_KINDS = ["Systems", "Works", "Labs", "Foods", "Motors", "Textiles", "Mining", "Pharma"]
INDUSTRIES = ["software", "steel", "shipping", "food", "textile", "mining", "chemicals", "publishing"]
PROFESSIONS = ["chemist", "painter", "engineer", "architect", "violinist", "surgeon", "poet", "astronomer", "lawyer", "baker"]


def _word(rng, used, syllables, end=""):
    """A new capitalised made-up word, unique in the world."""
    while True:
        w = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(syllables)) + end
        w = w.capitalize()
        if w not in used:
            used.add(w)
            return w


def make_world(seed=0, people=200, companies=40, cities=50, countries=10):
    """The entities as dicts keyed by name; deterministic in the arguments."""
    if min(people, companies, cities, countries) < 1 or cities < countries:
        raise ValueError("the synthetic world needs at least one of each entity and at least as many cities as countries")
    rng = random.Random(f"synthetic-world-{seed}")
    used = set()
    first_names = [_word(rng, used, 2) for _ in range(max(8, people // 4))]  # shared by several people
    world = {"country": {}, "city": {}, "company": {}, "person": {}}
    country_names = [_word(rng, used, 2, rng.choice(COUNTRY_ENDS)) for _ in range(countries)]
    city_names = [_word(rng, used, 2, rng.choice(CITY_ENDS)) for _ in range(cities)]
    for i, city in enumerate(city_names):  # every country gets at least one city, its capital
        country = country_names[i] if i < countries else rng.choice(country_names)
        world["city"][city] = {"country": country, "year": rng.randint(800, 1800), "river": _word(rng, used, 2)}
    for country in country_names:
        own = [c for c in city_names if world["city"][c]["country"] == country]
        world["country"][country] = {"capital": rng.choice(own), "population": rng.randint(2, 90)}
    person_names = [f"{rng.choice(first_names)} {_word(rng, used, rng.choice([2, 3]))}" for _ in range(people)]
    company_names = [f"{_word(rng, used, 2)} {rng.choice(COMPANY_KINDS)}" for _ in range(companies)]
    for company in company_names:
        world["company"][company] = {"city": rng.choice(city_names), "year": rng.randint(1850, 2015),
                                     "founder": rng.choice(person_names), "industry": rng.choice(INDUSTRIES)}
    for person in person_names:
        world["person"][person] = {"city": rng.choice(city_names), "year": rng.randint(1900, 2000),
                                   "company": rng.choice(company_names), "profession": rng.choice(PROFESSIONS)}
    return world


def passages(world):
    """One passage per entity, corpus format, in a fixed order."""
    out = []
    for name, p in world["person"].items():
        out.append((name, f"{name} is a {p['profession']} who was born in {p['city']} in {p['year']}. {name} works for {p['company']}."))
    for name, c in world["company"].items():
        out.append((name, f"{name} is a {c['industry']} company headquartered in {c['city']}. It was founded in {c['year']} by {c['founder']}."))
    for name, c in world["city"].items():
        out.append((name, f"{name} is a city in {c['country']}, founded in {c['year']} on the {c['river']} river."))
    for name, c in world["country"].items():
        out.append((name, f"{name} is a country whose capital is {c['capital']}. It has {c['population']} million inhabitants."))
    return [{"id": str(i), "title": title, "text": text} for i, (title, text) in enumerate(out)]


def questions(world):
    """
    Every question the world supports: dicts with question, answer, type (1-hop / 2-hop), subject
    (the entity the question names) and evidence (the titles of the passages to read, in order).
    """
    P, Co, Ci, K = world["person"], world["company"], world["city"], world["country"]
    qs = []

    def add(question, answer, subject, evidence):
        qs.append({"question": question, "answer": str(answer), "type": f"{len(evidence)}-hop", "subject": subject, "evidence": evidence})

    for p, r in P.items():
        add(f"Where was {p} born?", r["city"], p, [p])
        add(f"Which company does {p} work for?", r["company"], p, [p])
        add(f"In which year was {p} born?", r["year"], p, [p])
        add(f"In which country was {p} born?", Ci[r["city"]]["country"], p, [p, r["city"]])
        add(f"In which year was the city where {p} was born founded?", Ci[r["city"]]["year"], p, [p, r["city"]])
        add(f"In which city is the company that {p} works for headquartered?", Co[r["company"]]["city"], p, [p, r["company"]])
        add(f"Who founded the company that {p} works for?", Co[r["company"]]["founder"], p, [p, r["company"]])
    for co, r in Co.items():
        add(f"Who founded {co}?", r["founder"], co, [co])
        add(f"In which city is {co} headquartered?", r["city"], co, [co])
        add(f"In which country is {co} headquartered?", Ci[r["city"]]["country"], co, [co, r["city"]])
    for ci, r in Ci.items():
        add(f"In which country is {ci}?", r["country"], ci, [ci])
        add(f"In which year was {ci} founded?", r["year"], ci, [ci])
        add(f"What is the capital of the country that {ci} lies in?", K[r["country"]]["capital"], ci, [ci, r["country"]])
    for k, r in K.items():
        add(f"What is the capital of {k}?", r["capital"], k, [k])
    return qs


def make_split(seed=0, val_size=100, train_size=0, **sizes):
    """
    (train rows, val rows, corpus passages). The split is by subject: no entity a validation
    question asks about is asked about in training, so validation needs search, not recall of
    facts seen in training. train_size 0: every remaining question.
    """
    world = make_world(seed, **sizes)
    qs = questions(world)
    rng = random.Random(f"synthetic-split-{seed}")
    subjects = list(dict.fromkeys(q["subject"] for q in qs))
    rng.shuffle(subjects)
    by_subject = {}
    for i, q in enumerate(qs):
        by_subject.setdefault(q["subject"], []).append(qa_row(f"synthetic-{i:05d}", q["question"], [q["answer"]], q["type"],
                                                              "synthetic", q["evidence"]))
    val, train = [], []
    for s in subjects:
        (val if len(val) < val_size else train).extend(by_subject[s])
    val = val[:val_size]
    rng.shuffle(train)
    rng.shuffle(val)
    return (train[:train_size] if train_size else train), val, passages(world)


def demonstration(row, rng):
    """
    Scripted assistant turns for a warm start by imitation: search the title of each evidence
    passage in turn, then answer. Deliberately imperfect so RL has room: on 2-hop questions the
    demonstrator stops after the first search 40% of the time and answers the bridge entity (wrong).
    """
    def search(query):
        return "<tool_call>\n" + json.dumps({"name": "search", "arguments": {"query": query}}) + "\n</tool_call>"

    evidence = list(row["evidence"])
    if len(evidence) > 1 and rng.random() < 0.4:
        return [search(evidence[0]), f"<answer>{evidence[1]}</answer>"]
    return [search(title) for title in evidence] + [f"<answer>{row['answers'][0]}</answer>"]


def prepare(out, train_size=0, val_size=None, seed=0, source=None):
    """OUT/train.parquet, OUT/val.parquet (default 100 questions) and OUT/corpus.jsonl, the world of `seed`."""
    if source is not None:
        raise ValueError("the synthetic task is generated: it takes no source")
    train, val, corpus = make_split(seed, 100 if val_size is None else val_size, train_size)
    with open(os.path.join(out, "corpus.jsonl"), "w") as f:
        f.writelines(json.dumps(p) + "\n" for p in corpus)
    print(f"wrote {len(corpus)} passages to {os.path.join(out, 'corpus.jsonl')}")
    write_prompts(out, {"train": train, "val": val})
