"""
The corridor: a long-horizon task where what a turn sees decides the outcome (rollout.context).

The agent stands by a sign at the west end of a corridor. It reads the sign (a code word, in that
observation only), walks east through task.rooms rooms, each described at length, and at the door at
the end enters the code. So the turn at the door needs the first observation, which the history
carries only so far:
- full: the whole history grows past rollout.max_context_tokens before the door (context_budget);
- last_k: the door's turn sees the prompt and the last rollout.keep_turns rooms, not the sign;
- summary: once the history passes rollout.summary_tokens, the model's summary of it (a turn that is
  trained like the others) is what carries the code on to the door.

    python prepare_data.py --task=corridor --out=data/corridor
    python -m nanoagent.tiny --out=out/corridor/model --text=data/corridor/texts.jsonl \
        --pretrain data/corridor/copies.jsonl 1500
    python train.py --config=corridor rollout.context=summary    # or full, last_k

Reward: 1 for the right code at the door, else 0. Logged: won and door (reached the door). The
demonstrations for a warm start read the sign, walk and enter the code, a wrong one a quarter of the
time (so RL has room); summarize(row, messages) writes the summary a summary turn asks for: the code.
Prompts are made on the spot from (seed, task.num_train, task.num_val, task.rooms), or read from the
files prepare() writes; held-out rows have codes and rooms of their own seeds.
"""

import json
import os
import random
from dataclasses import dataclass

from nanoagent.agent import SUMMARY_HEADER, SUMMARY_REQUEST
from nanoagent.data import load_prompts, write_prompts
from nanoagent.keys import opt

SYSTEM_PROMPT = ("You explore a corridor. Each turn, reply with one command: read sign, east, or enter and a "
                 "word.")
QUESTION = "{}"
DOOR = "You reach a door with a keypad at the end of the corridor. Enter the code."
START = ("You stand at the west end of a long corridor, next to a sign. Read the sign, walk east to the door "
         "at the far end, and enter the code the sign gives.")
CODES = ["amber", "birch", "cedar", "delta", "ember", "flint", "garnet", "harbor", "indigo", "juniper",
         "kestrel", "lantern", "marble", "nectar", "onyx", "pepper"]
COLORS = ["grey", "green", "yellow", "white", "blue", "brown", "red", "black"]
THINGS = ["a chair", "a broken lamp", "a pile of books", "a wooden crate", "a rug", "a clock", "a mirror",
          "a basket", "a bench", "a painting of a ship"]
SMELLS = ["dust", "rain", "smoke", "old paper", "soap", "pine"]
SOUNDS = ["a slow drip", "the wind", "a faint ticking", "distant steps", "nothing at all"]
tools = None


@dataclass
class Knobs:
    num_train: int = opt(1024, "generated training corridors", low=1, fixed=True)
    num_val: int = opt(64, "generated held-out corridors", low=1)
    rooms: int = opt(6, "rooms between the sign and the door", low=1)


def room_text(rng, k):
    """Room k's description: long on purpose (each costs the history ~70 tokens), nothing in it matters."""
    return (f"You are in room {k} of the corridor. The walls are painted {rng.choice(COLORS)} and the floor "
            f"is made of {rng.choice(['stone', 'wood', 'tiles'])}. In one corner there is "
            f"{rng.choice(THINGS)}, and against the far wall {rng.choice(THINGS)}. The air smells of "
            f"{rng.choice(SMELLS)} and you hear {rng.choice(SOUNDS)}. An opening leads east.")


def make_rows(n, seed, split, rooms):
    rng = random.Random(f"corridor-{seed}-{split}")
    return [{"id": f"{split}-{i}", "code": rng.choice(CODES), "seed": rng.randrange(2**31), "rooms": rooms,
             "answers": [],
             "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": START}]}
            for i in range(n)]


def prompts(cfg, split):
    path = cfg.data.train_path if split == "train" else cfg.data.val_path
    if path:
        return load_prompts(path, bad_prompts=cfg.data.bad_prompts)
    n = cfg.task.num_train if split == "train" else cfg.task.num_val
    return make_rows(n, cfg.seed, split, cfg.task.rooms)


class Corridor:
    """One corridor (env.py's environment): the sign, the rooms, the door; a reply's first line is its
    command."""

    def reset(self, row):
        self.code, self.rooms, self.rng = row["code"], row["rooms"], random.Random(row["seed"])
        self.room, self.read, self.won, self.door = 0, False, False, False
        return row["messages"]

    def step(self, action):
        command = action.strip().split("\n")[0].strip().lower()
        info = {"read_to_end": False}
        if self.room == self.rooms:  # at the door
            if command.startswith("enter"):
                self.won = command[len("enter"):].strip() == self.code
                return "The door opens." if self.won else "The door stays shut.", 0.0, True, info
            return "The door has a keypad: enter the code.", 0.0, False, info
        if command == "read sign" and self.room == 0:
            self.read = True
            return f"The sign says: the code is {self.code}. The corridor leads east.", 0.0, False, info
        if command == "east":
            self.room += 1
            if self.room == self.rooms:
                self.door = True
                return DOOR, 0.0, False, info
            return room_text(self.rng, self.room), 0.0, False, info
        return "Nothing happens. The corridor goes on to the east.", 0.0, False, info


def environment(cfg):
    return Corridor


def score(traj, cfg):
    won = float(traj.env.won)
    traj.reward, traj.scores = won, {"won": won, "door": float(traj.env.door)}
    return won


def demonstration(row, rng, cfg):
    """Read the sign, walk east through every room, enter the code; a quarter of the time a wrong one."""
    code = row["code"] if rng.random() < 0.75 else rng.choice([c for c in CODES if c != row["code"]])
    return ["read sign"] + ["east"] * row["rooms"] + [f"enter {code}"]


def summarize(row, messages):
    """The demonstrator's summary of the corridor so far (rollout.context=summary): the code, which is all
    that matters."""
    return f"The code is {row['code']}."


def prepare(out, train_size=0, val_size=None, seed=0, source=None):
    """OUT/train.parquet and OUT/val.parquet (default 1024 and 64 corridors of 6 rooms), OUT/texts.jsonl: the
    task's words (every room text's and the codes) for a tiny model's tokenizer (nanoagent.tiny --text), and
    OUT/copies.jsonl, its pretraining text (copy_texts)."""
    if source is not None:
        raise ValueError("the corridor task is generated: it takes no source")
    rows = {"train": make_rows(train_size or 1024, seed, "train", 6),
            "val": make_rows(val_size or 64, seed, "val", 6)}
    write_prompts(out, rows)
    rng = random.Random(seed)
    texts = [START, SYSTEM_PROMPT, SUMMARY_REQUEST, SUMMARY_HEADER, DOOR, "read sign", "east",
             "The door opens.", "The door stays shut.", "Nothing happens. The corridor goes on to the east.",
             "The door has a keypad: enter the code."]
    texts += [f"The sign says: the code is {c}. The corridor leads east." for c in CODES]
    texts += [f"enter {c}" for c in CODES] + [f"The code is {c}." for c in CODES]
    texts += [room_text(rng, k % 9 + 1) for k in range(400)]
    with open(os.path.join(out, "texts.jsonl"), "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    print(f"wrote {len(texts)} texts to {os.path.join(out, 'texts.jsonl')}")
    with open(os.path.join(out, "copies.jsonl"), "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in copy_texts(rng, 4000))
    print(f"wrote 4000 texts to {os.path.join(out, 'copies.jsonl')}")


def copy_texts(rng, n):
    """Pretraining text for a tiny model: a word, rooms of the corridor's prose, and the word again. A real
    model can copy a word it read a while ago; a tiny one learns it here (none of it is a corridor's code at
    its door: the words are the rooms' and the codes', the sign and the door are not in it)."""
    words = CODES + COLORS + SMELLS + [t.split()[-1] for t in THINGS]
    out = []
    for _ in range(n):
        word = rng.choice(words)
        rooms = " ".join(room_text(rng, k + 1) for k in range(rng.randrange(5)))
        out.append(f"Remember the word {word}. {rooms} The word to remember was {word}.")
    return out
