"""
TextWorld: an agent that plays text games, the engine under ALFWorld (Microsoft's TextWorld, games
generated offline, played through jericho). A task whose environment is not tool calls: each
trajectory plays one game (Game, an environment in env.py's sense), one command a turn.

    python prepare_data.py --task=textworld --out=data/textworld --train-size=64 --val-size=32
    torchrun --nproc_per_node=8 train.py --config=textworld    # GPU, Qwen2.5-1.5B-Instruct

prepare() generates the games (TextWorld's Coin Collector, Yuan et al. 2018: rooms in a chain, a
coin at the far end, an objective that says the way) into OUT/games and writes OUT/train.parquet and
OUT/val.parquet, one row per game, with its first observation, its walkthrough and its split:
- train: level 3, a chain of 3 rooms (two moves, then "take coin"; seeds 0..N-1 after the --seed offset);
- val, "easy": the same level, other seeds (games never trained on);
- val, "hard": level 103, the same quest with a dead-end room off each room of the chain (6 rooms):
  the exits no longer show the way, the objective's directions must be followed.
Every game tells its objective step by step ("First step, take a trip west. Once you accomplish
that, head north. Then, pick-up the coin..."), as TextWorld's games do by default.

Reward: on each turn's last token, the progress the step made along the quest: how much shorter
the game's own plan from here to the goal became (TextWorld recomputes it after every move), as a
fraction of the plan at the start. A step towards the goal earns 1/len(walkthrough), a step away
costs as much; over a game they add up to the fraction of the way done (potential-based shaping,
Ng et al. 1999: it does not change which policies are best). The game's own points would not do:
these games give theirs only when the quest is done. And the outcome, 1 for a game won, 0
otherwise. Logged: won, progress (the fraction of the way done), score (the fraction of max_score
reached) and moves (commands sent), overall and per split (eval/easy/won, ...).

The first non-empty line of a reply is sent, without a leading "> ", characters that do not print
and backslashes; a command the game does not know costs a turn, like any other. Commands that would
leave the game or write a file (quit, restart, restore, save, undo, transcript...) are not sent,
wherever they are in the line (the parser runs "look. transcript" as two commands). A game file
that jericho could not read (its interpreter would end the whole process) is refused when the
prompts load.

prepare() also writes pretraining text for a tiny model, from other games of the training level
(what a real model brings and a tiny one must learn: that "an exit to the west" means "go west",
that an objective's directions are the commands to send, how a game's text reads): exits.jsonl, a
room's paragraph that names one exit, then the command that takes it; walkthroughs.jsonl, a game's
objective, then its commands; transcripts.jsonl, plays as conversations (the game's own policy,
wandering now and then). Every document comes in the 8 symmetries of the compass, so that no
direction is likelier than another and only reading tells which to take.
"""

import glob
import json
import os
import random
import re
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import textworld
from textworld.challenges import coin_collector
from textworld.generator import compile_game

from nanoagent.data import load_prompts, write_prompts

SYSTEM_PROMPT = ("You are playing a text adventure game. Each turn, reply with one command and nothing else, "
                 "for example: look, open door, take key from box, put apple on table; to move, go and a "
                 "direction. The game answers with what happened.")
QUESTION = "{}"
INFOS = textworld.EnvInfos(won=True, lost=True, score=True, max_score=True, moves=True, objective=True,
                           policy_commands=True)
PLAY_INFOS = textworld.EnvInfos(won=True, lost=True, objective=True, policy_commands=True,
                                admissible_commands=True)
LEVELS = {"easy": 3, "hard": 103}  # Coin Collector's: a chain of 3 rooms; the same with a dead end off each
COMPASS = ["north", "east", "south", "west"]
SYMMETRIES = ([[COMPASS[(i + r) % 4] for i in range(4)] for r in range(4)]
              + [[COMPASS[(r - i) % 4] for i in range(4)] for r in range(4)])
DIRECTION = re.compile(r"\b(north|east|south|west)\b", re.IGNORECASE)
LETTER = re.compile(r"[A-Za-z]")
WORD = re.compile(r"[a-z]+")
META_COMMANDS = {"quit", "q", "restart", "restore", "save", "undo", "script", "unscript", "noscript",
                 "transcript"}
WANDER = 1 / 3  # pretraining transcripts: the share of moves that are any command the game accepts
PLAYS = 4  # pretraining transcripts: plays of each game, each wandering its own way
tools = None


def clean(feedback):
    """The game's text without TextWorld's banner (lines of ASCII art: no letter in them), its
    prompt and status lines ("> ... -= Kitchen =-0/3"), trailing spaces and runs of blank lines."""
    lines = [line.rstrip() for line in feedback.split("\n")
             if not line.startswith(">") and (not line.strip() or LETTER.search(line))]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def command(action):
    """The command in a reply: its first non-empty line, without a leading "> ", characters that do not
    print or backslashes, at most 200 characters. jericho's interpreter (dumb-frotz) crashes on a NUL,
    and reads a line that starts with a backslash as a command of its own: one it does not know makes
    it ask again, forever."""
    line = next((ln.strip() for ln in action.split("\n") if ln.strip()), "")
    return "".join(ch for ch in line if ch.isprintable() and ch != "\\").removeprefix(">").strip()[:200]


def leaves_the_game(cmd):
    """Whether a command would leave the game or write a file: any of its words a meta command, since
    the parser runs "look. transcript" as two commands."""
    return bool(META_COMMANDS & set(WORD.findall(cmd.lower())))


class Game:
    """One game per trajectory: reset(row) starts the row's game, step(action) sends a command.
    games_dir: where the relative game paths of rows made in code (make_one's) start from; a row
    read from a prompt file names its game by an absolute path (nanoagent/data.py: FILE_FIELDS)."""

    def __init__(self, games_dir="."):
        self.games_dir = games_dir
        self.env = None

    def reset(self, row):
        self.env = textworld.start(game_path(row, self.games_dir), request_infos=INFOS)
        state = self.env.reset()
        self.score, self.max_score, self.won, self.moves = 0, max(state.max_score, 1), False, 0
        # the game's plan to the goal, from the start and from here
        self.length = self.remaining = max(len(state.policy_commands), 1)
        return [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": clean(state.feedback)}]

    def step(self, action):
        cmd = command(action)
        if not cmd:
            return "Write one command, for example: look.", 0.0, False, {}
        if leaves_the_game(cmd):
            return f"'{cmd}' is not available in this game.", 0.0, False, {}
        # nothing after the command's line (env.py: info)
        read_to_end = not action.strip().partition("\n")[2].strip()
        state, self.score, done = self.env.step(cmd)
        self.won, self.moves = bool(state.won), self.moves + 1
        # a lost game has no plan: no progress
        remaining = 0 if self.won else len(state.policy_commands) or self.remaining
        progress, self.remaining = (self.remaining - remaining) / self.length, remaining
        if done:
            self.env.close()
        return (clean(state.feedback), progress, done,
                {"score": self.score, "won": self.won, "read_to_end": read_to_end})


def game_path(row, games_dir="."):
    """A row's game file, checked: as written when absolute (a row read from a prompt file: the game
    beside that file, nanoagent/data.py: FILE_FIELDS), else relative to games_dir (a row made in code).
    jericho's interpreter ends the whole process on a story file it cannot read, so one that is
    missing, truncated or corrupt is refused here, with its row's id."""
    path = os.path.join(games_dir, row["game"])  # an absolute row["game"] stays as it is
    if not os.path.isfile(path):
        raise FileNotFoundError(f"game file {path!r} of {row.get('id')!r} does not exist "
                                "(generate the games with prepare_data.py --task=textworld)")
    problem = story_problem(path)
    if problem:
        raise ValueError(f"game file {path!r} of {row.get('id')!r} {problem}; "
                         "generate the games again with prepare_data.py --task=textworld")
    return path


def story_problem(path):
    """Why a game cannot be played, or None: its .json (TextWorld's description of the game: score,
    walkthrough) is not beside it, or it is not a Z-machine story whose length and checksum match its
    header (a truncated or corrupt file)."""
    if not os.path.isfile(os.path.splitext(path)[0] + ".json"):
        return "has no .json beside it (TextWorld's description of the game)"
    story = np.fromfile(path, dtype=np.uint8)
    version = int(story[0]) if len(story) >= 64 else 0
    if not 1 <= version <= 8:
        return "is not a Z-machine story file"
    length = (int(story[0x1A]) << 8 | int(story[0x1B])) * (2 if version <= 3 else 4 if version <= 5 else 8)
    if length > len(story) or (int(story[0x40:length].sum(dtype=np.int64)) % 65536
                               != int(story[0x1C]) << 8 | int(story[0x1D])):
        return "is truncated or corrupt (its length or checksum does not match its header)"
    return None


def environment(cfg):
    return Game


def prompts(cfg, split):
    rows = load_prompts(cfg.data.train_path if split == "train" else cfg.data.val_path,
                        bad_prompts=cfg.data.bad_prompts)
    for row in rows:
        game_path(row)  # a missing game is refused now, not mid-run
    return rows


def score(traj, cfg):
    """Outcome 1 for a won game, else 0 (the progress towards it is in the step rewards)."""
    game = traj.env
    traj.scores = {"won": float(game.won), "progress": 1 - game.remaining / game.length,
                   "score": game.score / game.max_score, "moves": float(game.moves)}
    traj.reward = float(game.won)
    return traj.reward


def demonstration(row, rng, cfg):
    """
    The walkthrough, played by a cautious demonstrator so that RL has room: it looks around ("look")
    before every step, a habit the warm start takes on and a tight turn budget has no room for (the
    demo's rollout.max_turns=5 for quests of 3 steps); and one game in three it stops a step or two
    short of the end.
    """
    steps = list(row["walkthrough"])
    if rng.random() < 1 / 3:
        steps = steps[:-rng.randint(1, 2)]
    return [command for step in steps for command in ("look", step)]


def transcript(env, state, rng):
    """
    A game played to its end as a conversation (the chat format), for the demo's pretraining: what a
    real model brings to a text game, how its commands read and what the game answers. The player
    sends the game's own next move towards the goal (the quest's commands from where it is now), and
    at most twice, one time in three (WANDER), any other command the game accepts, from which the
    policy then recovers.
    """
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": clean(state.feedback)}]
    wanders = 0
    for _ in range(3 * len(state.policy_commands) + 6):
        if state.won or state.lost or not state.policy_commands:
            break
        policy = state.policy_commands[0]
        others = [c for c in state.admissible_commands if c != policy and not leaves_the_game(c)]
        cmd = policy
        if others and wanders < 2 and rng.random() < WANDER:
            cmd, wanders = rng.choice(others), wanders + 1
        state, _, _ = env.step(cmd)
        messages += [{"role": "assistant", "content": cmd},
                     {"role": "user", "content": clean(state.feedback)}]
    return {"messages": messages}


def turned(text, symmetry):
    """text with its compass directions mapped by symmetry (the images of north, east, south, west),
    capitals kept."""
    def image(match):
        word = symmetry[COMPASS.index(match.group(1).lower())]
        return word.capitalize() if match.group(1)[0].isupper() else word
    return DIRECTION.sub(image, text)


def turned_play(play, symmetry):
    """A play with the game's text and the commands turned by symmetry, and the system prompt as the
    agent reads it in every game (a turned example command would be one no real prompt has)."""
    return {"messages": [m if m["role"] == "system" else {**m, "content": turned(m["content"], symmetry)}
                         for m in play["messages"]]}


def exit_documents(plays):
    """Every paragraph of a room (after its "-= Name =-" line) in the plays that names one direction,
    followed by the command that goes there ("There is an unguarded exit to the west.\n\ngo west"):
    the shortest texts in which what to send is a word just read, from which a tiny model learns
    to copy a direction. A command opens its line, as it opens an assistant turn (a "> " before it
    would make "go" another token than the one the model writes)."""
    documents = set()
    for play in plays:
        for message in play["messages"][1:]:
            paragraphs = message["content"].split("\n\n") if message["role"] == "user" else []
            room = next((i for i, p in enumerate(paragraphs) if p.startswith("-= ")), len(paragraphs))
            for paragraph in paragraphs[room + 1:]:
                named = [d.lower() for d in DIRECTION.findall(paragraph)]
                if len(named) == 1:
                    documents.add(f"{paragraph}\n\ngo {named[0]}")
    return sorted(documents)


def make_one(job):
    """Generate and compile one game; returns its row (first observation, walkthrough), or for a
    pretraining game (PLAYS transcripts, its objective followed by its commands), whose files are
    then deleted. Raises if TextWorld cannot make the game."""
    out, split, kind, index, seed = job
    options = textworld.GameOptions()
    options.seeds = seed
    options.path = os.path.join(out, "games", f"{split}-{index:05d}.z8")
    options.force_recompile = True
    path = compile_game(coin_collector.make({"level": LEVELS[kind]}, options), options)
    env = textworld.start(path, request_infos=PLAY_INFOS if split == "pretrain" else INFOS)
    state = env.reset()
    walkthrough = list(state.policy_commands)
    if split == "pretrain":
        played = [transcript(env, env.reset(), random.Random(f"textworld-transcript-{seed}-{play}"))
                  for play in range(PLAYS)]
        env.close()
        for name in glob.glob(os.path.splitext(path)[0] + ".*"):  # .z8, .ni, .json
            os.remove(name)
        return played, "\n".join([state.objective.strip(), ""] + walkthrough)
    env.close()
    return {"id": f"{split}-{index:05d}", "type": kind, "game": os.path.relpath(path, out),
            "walkthrough": walkthrough, "max_score": int(state.max_score), "answers": [],
            "messages": [{"role": "system", "content": SYSTEM_PROMPT},
                         {"role": "user", "content": clean(state.feedback)}]}


def prepare(out, train_size=0, val_size=None, seed=0, source=None):
    """OUT/games/*.z8 and OUT/{train,val}.parquet: train_size (default 64) easy games to train on;
    val_size (default 32) held-out games, half easy and half hard; and pretraining text for a tiny
    model from as many other easy games as train_size, each document in the compass's 8 symmetries:
    OUT/exits.jsonl, OUT/walkthroughs.jsonl (plain texts) and OUT/transcripts.jsonl (PLAYS plays of
    each game, as conversations). Seeds: train 0.., val 1,000,000.., pretraining 2,000,000..,
    offset by 10,000 x seed."""
    if source is not None:
        raise ValueError("textworld generates its games; it has no --source")
    train_size, val_size = train_size or 64, 32 if val_size is None else val_size
    base = 10_000 * seed
    jobs = [(out, "train", "easy", i, base + i) for i in range(train_size)]
    jobs += [(out, "val", "easy" if i < (val_size + 1) // 2 else "hard", i, base + 1_000_000 + i)
             for i in range(val_size)]
    jobs += [(out, "pretrain", "easy", i, base + 2_000_000 + i) for i in range(train_size)]
    os.makedirs(os.path.join(out, "games"), exist_ok=True)
    with ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        rows = list(pool.map(make_one, jobs))
    pretraining = [r for r in rows if isinstance(r, tuple)]
    plays = [play for played, _ in pretraining for play in played]
    documents = {
        "exits.jsonl": [{"text": text} for text in sorted({turned(d, m) for d in exit_documents(plays)
                                                           for m in SYMMETRIES})],
        "walkthroughs.jsonl": [{"text": turned(text, m)} for _, text in pretraining for m in SYMMETRIES],
        "transcripts.jsonl": [turned_play(play, m) for play in plays for m in SYMMETRIES],
    }
    for name, docs in documents.items():
        with open(os.path.join(out, name), "w") as f:
            f.writelines(json.dumps(d) + "\n" for d in docs)
        print(f"wrote {len(docs)} documents to {os.path.join(out, name)}")
    write_prompts(out, {split: [r for r in rows if isinstance(r, dict) and r["id"].startswith(split)]
                        for split in ("train", "val")})
