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
passage alone does not answer it). A person's name is a first and a last name from two pools,
each word shared by several people as in any real corpus, so the words of a held-out person's
name are seen in training too, in other names; full names and all other name words are unique,
so each answer is unambiguous. The same seed and sizes give the same world, passages, questions
and split.

The task is HotpotQA's (question wording, search tool, scoring) on this world, with a shorter
system prompt. Its prompts and search index come from the files prepare_data.py and build_index.py
write, or, with data.train_path, data.val_path and task.index_dir empty, are made on the spot (the
same world, split and MiniLM encoder: nothing to prepare by hand). prepare() also writes the corpus
(OUT/corpus.jsonl) for build_index.py and the demo tiny model's pretraining text: passages and
search conversations from scrambled copies of the world, which teach how the world is written and
searched but none of its facts.
"""

import json
import os
import random
from dataclasses import dataclass

from nanoagent.data import load_prompts, write_prompts
from nanoagent.keys import opt
from nanoagent.retriever import InMemoryRetriever, load_encoder, packaged_minilm_path
from nanoagent.tasks.hotpotqa import QUESTION, qa_row, score  # noqa: F401 (the task interface)
from nanoagent.tools import format_passages, make_tools, parse_tool_calls, search_tool

# HotpotQA's instructions in a few words: a tiny model learning from scratch must find the question in its
# prompt
SYSTEM_PROMPT = ("Search for the entities in the question, as often as you need, "
                 "then reply <answer>the answer</answer>.")


@dataclass
class Knobs:
    index_dir: str = opt("", "search index from build_index.py "
                             "(empty: the world's passages, indexed on the spot)")
    search_top_k: int = opt(3, "passages returned by one search call", low=1)
    # the warm start's demonstrator (demonstration): deliberately imperfect, so that RL has room
    demo_guess: float = opt(0.6, "share of the warm start's demonstrations that answer without searching",
                            low=0.0, high=1.0, fixed=True)
    demo_skip_second_hop: float = opt(0.25, "share of the searching 2-hop demonstrations that answer after "
                                      "one search", low=0.0, high=1.0, fixed=True)
    demo_extra_hop: float = opt(0.0, "share of the searching 1-hop demonstrations that also search the "
                                "entity the subject's passage names", low=0.0, high=1.0, fixed=True)


ONSETS = ["b", "br", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "tr", "v", "z"]
VOWELS = ["a", "e", "i", "o", "u", "a", "e", "o"]
CODAS = ["", "", "", "n", "r", "l", "s", "m"]
CITY_ENDS = ["by", "ford", "holm", "mere", "stad", "wick", "port", "burg"]
COUNTRY_ENDS = ["ia", "land", "ora", "istan", "mar"]
COMPANY_KINDS = ["Systems", "Works", "Labs", "Foods", "Motors", "Textiles", "Mining", "Pharma"]
INDUSTRIES = ["software", "steel", "shipping", "food", "textile", "mining", "chemicals", "publishing"]
PROFESSIONS = ["chemist", "painter", "engineer", "architect", "violinist", "surgeon", "poet", "astronomer",
               "lawyer", "baker"]


def _word(rng, used, syllables, end=""):
    """A new capitalised made-up word, unique in the world."""
    while True:
        w = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS)
                    for _ in range(syllables)) + end
        w = w.capitalize()
        if w not in used:
            used.add(w)
            return w


def make_world(seed=0, people=200, companies=40, cities=50, countries=10):
    """The entities as dicts keyed by name; deterministic in the arguments."""
    if min(people, companies, cities, countries) < 1 or cities < countries:
        raise ValueError("the synthetic world needs at least one of each entity "
                         "and at least as many cities as countries")
    rng = random.Random(f"synthetic-world-{seed}")
    used = set()
    first_names = [_word(rng, used, 2) for _ in range(max(8, people // 4))]  # each shared by several people
    last_names = [_word(rng, used, rng.choice([2, 3])) for _ in range(max(8, people // 4))]
    world = {"country": {}, "city": {}, "company": {}, "person": {}}
    country_names = [_word(rng, used, 2, rng.choice(COUNTRY_ENDS)) for _ in range(countries)]
    city_names = [_word(rng, used, 2, rng.choice(CITY_ENDS)) for _ in range(cities)]
    for i, city in enumerate(city_names):  # every country gets at least one city, its capital
        country = country_names[i] if i < countries else rng.choice(country_names)
        world["city"][city] = {"country": country, "year": rng.randint(800, 1800),
                               "river": _word(rng, used, 2)}
    for country in country_names:
        own = [c for c in city_names if world["city"][c]["country"] == country]
        world["country"][country] = {"capital": rng.choice(own), "population": rng.randint(2, 90)}
    person_names = [" ".join(name)
                    for name in rng.sample([(f, l) for f in first_names for l in last_names], people)]
    company_names = [f"{_word(rng, used, 2)} {rng.choice(COMPANY_KINDS)}" for _ in range(companies)]
    for company in company_names:
        world["company"][company] = {"city": rng.choice(city_names), "year": rng.randint(1850, 2015),
                                     "founder": rng.choice(person_names), "industry": rng.choice(INDUSTRIES)}
    for person in person_names:
        world["person"][person] = {"city": rng.choice(city_names), "year": rng.randint(1900, 2000),
                                   "company": rng.choice(company_names),
                                   "profession": rng.choice(PROFESSIONS)}
    return world


def passages(world):
    """One passage per entity, corpus format, in a fixed order."""
    out = []
    for name, p in world["person"].items():
        out.append((name, f"{name} is a {p['profession']} who was born in {p['city']} in {p['year']}. "
                          f"{name} works for {p['company']}."))
    for name, c in world["company"].items():
        out.append((name, f"{name} is a {c['industry']} company headquartered in {c['city']}. "
                          f"It was founded in {c['year']} by {c['founder']}."))
    for name, c in world["city"].items():
        out.append((name, f"{name} is a city in {c['country']}, "
                          f"founded in {c['year']} on the {c['river']} river."))
    for name, c in world["country"].items():
        out.append((name, f"{name} is a country whose capital is {c['capital']}. "
                          f"It has {c['population']} million inhabitants."))
    return [{"id": str(i), "title": title, "text": text} for i, (title, text) in enumerate(out)]


def scrambled_world(world, seed=0):
    """
    The world with each entity's facts handed to another entity of its kind (a random cycle): the
    same names and values, and none of the facts but for a value two entities share. Its text is for
    the demo's tiny model to pretrain on: how the world's text is written, that a passage repeats
    the name in its title, and how a search is done and read, which a real base model knows before
    RL, with nothing in it that answers a question.
    """
    rng = random.Random(f"synthetic-scrambled-{seed}")
    scrambled = {}
    for kind, entities in world.items():
        order = list(entities)
        rng.shuffle(order)
        donor = {name: order[i - 1] for i, name in enumerate(order)}
        scrambled[kind] = {name: dict(entities[donor[name]]) for name in entities}
    return scrambled


def questions(world):
    """
    Every question the world supports: dicts with question, answer, type (1-hop / 2-hop), subject
    (the entity the question names), evidence (the titles of the passages to read, in order) and
    linked (the first entity the subject's passage names: a person's or a company's city, a city's
    country, a country's capital). A 2-hop question whose answer the subject's passage happens to
    state too is left out.
    """
    P, Co, Ci, K = world["person"], world["company"], world["city"], world["country"]
    text = {p["title"]: p["text"] for p in passages(world)}
    linked = {**{name: r["city"] for name, r in {**P, **Co}.items()},
              **{name: r["country"] for name, r in Ci.items()},
              **{name: r["capital"] for name, r in K.items()}}
    qs = []

    def add(question, answer, subject, evidence):
        # e.g. born in the city where the company is: 1 hop would do
        if len(evidence) > 1 and str(answer) in text[subject]:
            return
        qs.append({"question": question, "answer": str(answer), "type": f"{len(evidence)}-hop",
                   "subject": subject, "evidence": evidence, "linked": linked[subject]})

    for p, r in P.items():
        add(f"Where was {p} born?", r["city"], p, [p])
        add(f"Which company does {p} work for?", r["company"], p, [p])
        add(f"In which year was {p} born?", r["year"], p, [p])
        add(f"In which country was {p} born?", Ci[r["city"]]["country"], p, [p, r["city"]])
        add(f"In which year was the city where {p} was born founded?", Ci[r["city"]]["year"], p,
            [p, r["city"]])
        add(f"In which city is the company that {p} works for headquartered?", Co[r["company"]]["city"], p,
            [p, r["company"]])
        add(f"Who founded the company that {p} works for?", Co[r["company"]]["founder"], p, [p, r["company"]])
    for co, r in Co.items():
        add(f"Who founded {co}?", r["founder"], co, [co])
        add(f"In which city is {co} headquartered?", r["city"], co, [co])
        add(f"In which country is {co} headquartered?", Ci[r["city"]]["country"], co, [co, r["city"]])
    for ci, r in Ci.items():
        add(f"In which country is {ci}?", r["country"], ci, [ci])
        add(f"In which year was {ci} founded?", r["year"], ci, [ci])
        add(f"What is the capital of the country that {ci} lies in?", K[r["country"]]["capital"], ci,
            [ci, r["country"]])
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
        row = qa_row(f"synthetic-{i:05d}", q["question"], [q["answer"]], q["type"], "synthetic",
                     q["evidence"], SYSTEM_PROMPT)
        by_subject.setdefault(q["subject"], []).append({**row, "linked": q["linked"]})
    val, train = [], []
    for s in subjects:
        (val if len(val) < val_size else train).extend(by_subject[s])
    val = val[:val_size]
    rng.shuffle(train)
    rng.shuffle(val)
    return (train[:train_size] if train_size else train), val, passages(world)


def prompts(cfg, split):
    """The rows of the file prepare() wrote, or, for an empty data.train_path / data.val_path, the world's
    split made here (prepare()'s defaults: the world of seed 0, 100 held-out questions)."""
    path = cfg.data.train_path if split == "train" else cfg.data.val_path
    if path:
        return load_prompts(path, bad_prompts=cfg.data.bad_prompts)
    train, val, _ = make_split()
    return train if split == "train" else val


def tools(cfg):
    """Search over the index build_index.py wrote into task.index_dir, or, for an empty task.index_dir,
    over the world's passages indexed here with the packaged MiniLM (build_index.py's encoder)."""
    if cfg.task.index_dir:
        return make_tools(["search"], cfg.task.index_dir, top_k=cfg.task.search_top_k)
    encoder = load_encoder(packaged_minilm_path())
    return [search_tool(InMemoryRetriever(passages(make_world()), encoder), cfg.task.search_top_k)]


SCRAMBLED_COPIES, DIALOGUES_PER_COPY = 20, 400


def demonstration(row, rng, cfg):
    """The warm start's demonstration of a row, at the rates of task.demo_guess, task.demo_skip_second_hop
    and task.demo_extra_hop (scripted_turns; what SmolLM2's demo did with other rates: docs/results.md)."""
    knobs = cfg.task
    return scripted_turns(row, rng, knobs.demo_guess, knobs.demo_skip_second_hop, knobs.demo_extra_hop)


def scripted_turns(row, rng, guess, skip_second_hop, extra_hop):
    """
    Scripted assistant turns for a warm start by imitation: search the title of each evidence
    passage in turn, then answer. Names are written after a space, as they stand in questions and
    passages, so that a name is the same tokens wherever it is copied to. Deliberately imperfect so
    that RL has room: `guess` of the time the demonstrator does not search and answers with the name
    in the question (wrong, but for the odd capital city asked about itself), and on 2-hop questions
    it stops after the first search `skip_second_hop` of the time and answers the bridge entity (wrong).
    A greedy policy imitating it guesses; searching, and searching twice, is what RL must find pays.
    On 1-hop questions it also searches the entity the subject's passage names `extra_hop` of the time
    (row["linked"]), then answers from the first passage: it shows a policy that searches twice where
    the answer is when the second passage does not hold it.
    """
    def search(query):
        return ("<tool_call>\n" + json.dumps({"name": "search", "arguments": {"query": " " + query}})
                + "\n</tool_call>")

    evidence = list(row["evidence"])
    if rng.random() < guess:
        return [f"<answer> {evidence[0]}</answer>"]
    if len(evidence) > 1 and rng.random() < skip_second_hop:
        return [search(evidence[0]), f"<answer> {evidence[1]}</answer>"]
    # no draw at a rate of 0: scrambled_dialogues' questions are the same whatever task.demo_extra_hop is
    if len(evidence) == 1 and extra_hop and rng.random() < extra_hop:
        evidence.append(row["linked"])
    return [search(title) for title in evidence] + [f"<answer> {row['answers'][0]}</answer>"]


def scrambled_dialogues(world, copies=SCRAMBLED_COPIES, per_copy=DIALOGUES_PER_COPY, seed=0):
    """
    Conversations in the chat format ({"messages", "tools"}), pretraining text for the demo's tiny
    model: questions about scrambled copies of the world (scrambled_world), each answered by the
    demonstrator searching right every time, the search results as the search tool shows its top
    passage for a name. A base model has read how a search is done and read; this is that text, and
    as the facts change from copy to copy, the answer can only be read from the result, never recalled.
    """
    rng = random.Random(f"synthetic-dialogues-{seed}")
    schema = search_tool(retriever=None).schema()
    out = []
    for copy in range(copies):
        fake = scrambled_world(world, copy)
        by_title = {p["title"]: p for p in passages(fake)}
        qs = questions(fake)
        for q in rng.sample(qs, min(per_copy, len(qs))):
            row = qa_row("", q["question"], [q["answer"]], q["type"], "synthetic", q["evidence"],
                         SYSTEM_PROMPT)
            messages = list(row["messages"])
            for turn in scripted_turns(row, rng, guess=0.0, skip_second_hop=0.0, extra_hop=0.0):
                messages.append({"role": "assistant", "content": turn})
                for call in parse_tool_calls(turn):
                    messages.append({"role": "tool",
                                     "content": format_passages([by_title[call.arguments["query"].strip()]])})
            out.append({"messages": messages, "tools": [schema]})
    return out


def prepare(out, train_size=0, val_size=None, seed=0, source=None):
    """OUT/train.parquet, OUT/val.parquet (default 100 questions), OUT/corpus.jsonl, and the demo tiny model's
    pretraining text (none of it facts of the world of `seed`): OUT/scrambled.jsonl, the passages of
    SCRAMBLED_COPIES scrambled copies of the world, and OUT/dialogues.jsonl, scrambled_dialogues."""
    if source is not None:
        raise ValueError("the synthetic task is generated: it takes no source")
    train, val, corpus = make_split(seed, 100 if val_size is None else val_size, train_size)
    world = make_world(seed)
    scrambled = [p for copy in range(SCRAMBLED_COPIES) for p in passages(scrambled_world(world, copy))]
    for name, rows, what in (("corpus.jsonl", corpus, "passages"), ("scrambled.jsonl", scrambled, "passages"),
                             ("dialogues.jsonl", scrambled_dialogues(world), "conversations")):
        with open(os.path.join(out, name), "w") as f:
            f.writelines(json.dumps(p) + "\n" for p in rows)
        print(f"wrote {len(rows)} {what} to {os.path.join(out, name)}")
    write_prompts(out, {"train": train, "val": val})
