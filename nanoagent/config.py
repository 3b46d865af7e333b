"""
Configuration: one dataclass tree with typed defaults, presets by name, `key=value` overrides.

    torchrun ... train.py --config=tiny algo=ppo rollout.max_turns=4 train.lr=1e-5

The frequently used knobs live at the top level (model, algo, steps, run_dir, seed); the rest sit
in groups. Every override is checked against the tree: an unknown key, a value of the wrong type or
a choice that does not exist is refused with a message that names the key and what is valid.
Presets are just lists of overrides, so they go through the same checks.
"""

import dataclasses
import difflib
import json
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Literal

TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")


def task_names():
    """The tasks in nanoagent/tasks/, one module each. Read from the folder rather than imported, so
    that the config stands below the tasks (which read it) and a bad data.task is refused before
    anything is built."""
    return sorted(name[:-3] for name in os.listdir(TASKS_DIR) if name.endswith(".py") and not name.startswith("_"))


def opt(default, help):
    """A config field: its default and one line of help (shown by --help and the README reference)."""
    return field(default=default, metadata={"help": help})


@dataclass
class DataConfig:
    task: str = opt("hotpotqa",
                    f"a task in nanoagent/tasks/ ({', '.join(task_names())}) or a path to a task file: "
                    "its prompts, tools, reward and demonstrations")
    train_path: str = opt("data/hotpotqa/train.parquet", "training prompts (parquet from prepare_data.py; synthetic: empty, made on the spot)")
    val_path: str = opt("data/hotpotqa/val.parquet", "held-out prompts for evaluation")
    index_dir: str = opt("data/hotpotqa/index", "search index from build_index.py (synthetic: empty, built on the spot)")
    max_prompt_tokens: int = opt(1024, "longest prompt (tokens, chat template and tool schemas included); checked when the data is loaded")
    bad_prompts: Literal["refuse", "drop"] = opt("refuse", "prompts that cannot be trained on (a malformed row, a non-string answer, a duplicate id, longer than data.max_prompt_tokens): refuse the file, or drop them and say how many")
    shuffle: bool = opt(True, "shuffle the training prompts every epoch (seeded)")
    num_train: int = opt(2048, "arithmetic: generated training prompts")
    num_val: int = opt(64, "arithmetic: generated held-out prompts")


@dataclass
class RolloutConfig:
    engine: Literal["auto", "vllm", "hf"] = opt("auto", "vllm: colocated vLLM engine; hf: the transformers fallback; auto: vllm where installed")
    prompts_per_step: int = opt(64, "distinct prompts rolled out per training step (over all ranks)")
    group_size: int = opt(5, "rollouts per prompt (GRPO groups; PPO may use 1)")
    temperature: float = opt(1.0, "sampling temperature (the trainer's logprobs use the same)")
    top_p: float = opt(1.0, "nucleus sampling")
    max_turns: int = opt(4, "assistant turns per trajectory before it is cut")
    max_new_tokens: int = opt(512, "tokens the model may sample in one turn")
    max_context_tokens: int = opt(4096, "prompt + response budget of one trajectory (of one step with context=last_k)")
    max_obs_tokens: int = opt(512, "a tool result is truncated to this many tokens")
    tool_timeout_s: float = opt(10.0, "time limit of one tool call")
    step_timeout_s: float = opt(120.0, "time limit of one environment step (a tool task's: its calls, queueing included); past it the step is abandoned and its trajectory ends (env_error)")
    search_top_k: int = opt(3, "passages returned by one search call")
    dtype: Literal["bfloat16", "float16", "float32"] = opt("bfloat16", "engine weights and activations")
    compile: bool = opt(True, "vLLM compiles the model (torch.compile; CUDA graphs on a GPU): faster decoding after a start-up cost (CPU, tiny model: ~5 s, ~15 s when nothing is cached); the CPU presets, short runs, leave it off")
    gpu_memory_utilization: float = opt(0.5, "share of GPU memory vLLM may take (weights + KV cache)")
    tensor_parallel_size: int = opt(1, "vLLM tensor parallelism for rollout.py and chat.py (one process, several GPUs); train.py takes 1 only")
    context: Literal["full", "last_k"] = opt("full", "what a turn sees: full: the whole trajectory, one growing token row; last_k: the system prompt, the question and the last rollout.keep_turns turns, rendered afresh each turn, each turn trained as a sequence of its own (Agent-R1 v0.1's step context)")
    keep_turns: int = opt(2, "context=last_k: earlier turns (an assistant turn with its tool results) a turn sees")
    tool_format: Literal["auto", "template", "hermes"] = opt("auto", "how tools and their results are shown: template: by the chat template (tools=, tool messages); hermes: nanoagent's fallback for templates without tools (Qwen2.5's Hermes block in the system turn, results as <tool_response> in a user turn; README: Tool calling); auto: template where it renders tools=, else hermes")


@dataclass
class PPOConfig:
    gamma: float = opt(1.0, "discount per action token (GAE, and REINFORCE++'s returns)")
    lam: float = opt(1.0, "GAE lambda")
    clip_low: float = opt(0.2, "ratio clip below 1")
    clip_high: float = opt(0.2, "ratio clip above 1 (raise it for clip-higher)")
    clip_dual: float = opt(3.0, "dual clip for negative advantages")
    value_clip: float = opt(0.5, "clip range of the value loss around the old values")
    epochs: int = opt(1, "passes over the rollout batch per step")
    mini_batch_size: int = opt(64, "trajectories per optimizer step (over all ranks)")
    critic_lr: float = opt(1e-5, "critic learning rate")
    critic_warmup_steps: int = opt(0, "steps that train only the critic before the policy moves")
    whiten_advantages: bool = opt(True, "normalise GAE advantages over the whole batch (mean 0, std 1)")
    whiten_over: Literal["tokens", "steps"] = opt("tokens", "the statistics of that whitening: over action tokens, or (ppo.credit=step) over steps, each once however long (StepPO)")
    credit: Literal["token", "step"] = opt("token", "GAE over action tokens (token), or over turns (step: Agent-R1 v0.1's step MDP, one value per turn at the token before it, the turn's tokens share its advantage)")
    ratio: Literal["token", "sequence", "step"] = opt("token", "importance ratio of the clipped loss, every algo: per token (PPO), or per sequence (a row: a trajectory, or a turn with rollout.context=last_k) or per step (a turn), the geometric mean of its tokens' ratios clipped as a whole, without dual clip (GSPO)")


@dataclass
class GRPOConfig:
    scale_by_std: bool = opt(True, "divide by the group std (False: mean-centred only)")
    eps: float = opt(1e-6, "added to the group std")
    drop_uniform_groups: bool = opt(True, "algo=grpo or rloo: leave groups whose rewards are all equal out of the update (DAPO's dynamic sampling): they carry no signal, only dilute the loss; logged as dropped_uniform")


@dataclass
class TrainConfig:
    lr: float = opt(1e-6, "policy learning rate")
    weight_decay: float = opt(0.01, "AdamW weight decay")
    warmup_steps: int = opt(0, "linear learning-rate warm-up over the first N training steps")
    grad_clip: float = opt(1.0, "max gradient norm")
    micro_batch_tokens: int = opt(16384, "token budget of one forward/backward micro-batch per rank")
    balance_ranks: bool = opt(True, "before the update, move whole groups between ranks so that each trains on about as many tokens (every pass waits for the busiest rank); logged as rank_imbalance")
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "step_mean_token_mean"] = opt("token_mean", "how per-token losses become one scalar: a mean over all action tokens, or a mean over trajectories (seq) or turns (step) of each one's token mean")
    kl_mode: Literal["none", "reward", "loss"] = opt(
        "none", "KL to the reference (the policy RL starts from): none, k1 in the reward "
                "(ppo, reinforce_plus_plus, reinforce_plus_plus_baseline), or k3 in the loss (any algo)")
    kl_coef: float = opt(0.001, "KL coefficient")
    entropy_coef: float = opt(0.0, "entropy bonus coefficient")
    tis: bool = opt(False, "truncated importance sampling for engine-vs-trainer logprob mismatch")
    tis_cap: float = opt(2.0, "cap of the importance weights")
    overlong_filter: bool = opt(False, "leave trajectories cut by the token or context budget (finish reason truncated or context_budget) out of the update (DAPO's overlong filtering); logged as dropped_overlong")
    dtype: Literal["bfloat16", "float32"] = opt("bfloat16", "compute dtype of policy, critic and reference (fp32 master weights and gradient reduction); the same on CPU and GPU")
    activation_checkpointing: bool = opt(True, "recompute activations in the backward pass")
    save_every: int = opt(50, "checkpoint every N steps (0: only at the end and on SIGTERM)")
    keep_last: int = opt(2, "complete checkpoints kept in run_dir (0: all); older ones are deleted once a new one is complete")
    tool_call_reward: float = opt(0.0, "process reward on the last token of each turn whose tool calls all succeeded (grpo, rloo and reinforce add it unnormalised, from its turn on)")
    max_idle_steps: int = opt(5, "stop the run, saying why, after this many steps in a row that trained nothing (every trajectory left out: groups of equal rewards, budget cuts, failed environments); 0: never")
    warm_start_steps: int = opt(0, "imitation steps on the scripted demonstrations before RL (0: none), "
                                   "saved to run_dir/warm_start")
    warm_start_lr: float = opt(1e-3, "learning rate of the imitation warm start")
    warm_start_batch_size: int = opt(0, "demonstrations per imitation step, over all ranks "
                                        "(0: ppo.mini_batch_size)")


@dataclass
class RewardConfig:
    metric: Literal["em", "substring_em", "f1"] = opt("em", "answer score in the reward: strict EM, substring EM (Agent-R1's accuracy) or token F1; all three are logged")
    answer_weight: float = opt(1.0, "reward = answer_weight * answer score + format_weight * format check")
    format_weight: float = opt(0.0, "weight of the format check (1 when the tags and tool calls are well formed and the last turn answers)")
    require_think: bool = opt(False, "the format check also asks every turn to open with <think>...</think>")


@dataclass
class EvalConfig:
    every: int = opt(10, "evaluate every N steps (0: never)")
    num_prompts: int = opt(256, "held-out prompts per evaluation (greedy decoding)")


@dataclass
class LogConfig:
    wandb: bool = opt(False, "also log to Weights & Biases (when installed)")
    wandb_project: str = opt("nanoagent", "wandb project")


@dataclass
class Config:
    model: str = opt("Qwen/Qwen2.5-3B-Instruct", "hub id or local path; 'tiny' builds the tiny test model, 'smollm2-135m' converts the packaged SmolLM2-135M-Instruct (offline)")
    algo: Literal["ppo", "grpo", "rloo", "reinforce", "reinforce_plus_plus", "reinforce_plus_plus_baseline"] = opt("grpo", "the advantage: ppo: critic + masked GAE; grpo: outcome normalised in its group; rloo: outcome minus the mean of the group's others; reinforce: outcome minus the batch mean; reinforce_plus_plus: discounted token returns, whitened over the batch; reinforce_plus_plus_baseline: reward minus its group's mean, whitened over the batch")
    steps: int = opt(200, "training steps (one rollout batch each)")
    run_dir: str = opt("out/run", "checkpoints, metrics.jsonl, config.json, hf/ (the export), warm_start/")
    seed: int = opt(0, "seed of data order, sampling and initialisation")
    resume: str = opt("auto", "auto: continue from the latest complete checkpoint in run_dir; never: start fresh (a used run_dir is moved aside to <run_dir>.old-<time>)")
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)


PRESETS = {
    # CPU, offline: the tiny random model on arithmetic with the calculator, no data files
    # (tests, the README's CPU runs)
    "tiny": [
        "model=tiny", "steps=20", "run_dir=out/tiny",
        "data.task=arithmetic", "data.max_prompt_tokens=768", "data.num_val=32",
        "rollout.prompts_per_step=8", "rollout.group_size=4", "rollout.max_turns=3",
        "rollout.max_new_tokens=48", "rollout.max_context_tokens=1536", "rollout.max_obs_tokens=128",
        "rollout.dtype=float32", "rollout.compile=false", "rollout.tool_timeout_s=5",
        "ppo.mini_batch_size=16", "ppo.critic_lr=1e-4",
        "train.lr=1e-4", "train.micro_batch_tokens=4096", "train.dtype=float32",
        "train.activation_checkpointing=false", "train.save_every=0", "train.warm_start_steps=0",
        "eval.every=0", "eval.num_prompts=32",
    ],
    # make demo (CPU, minutes): a tiny model whose tokenizer knows the synthetic world's words, pretrained on scrambled
    # copies of the world (make demo builds it into out/demo/model), warm-started by imitation of a demonstrator that
    # mostly guesses, then GRPO on EM alone
    "demo": [
        "model=out/demo/model", "algo=grpo", "steps=10", "run_dir=out/demo/run", "resume=never",
        "data.task=synthetic", "data.train_path=out/demo/data/train.parquet", "data.val_path=out/demo/data/val.parquet",
        "data.index_dir=out/demo/data/index", "data.max_prompt_tokens=512",
        "rollout.prompts_per_step=16", "rollout.group_size=4", "rollout.max_turns=4", "rollout.max_new_tokens=48",
        "rollout.max_context_tokens=1024", "rollout.max_obs_tokens=128", "rollout.search_top_k=1", "rollout.dtype=float32", "rollout.compile=false",
        "rollout.tool_timeout_s=10",
        "ppo.mini_batch_size=16", "train.lr=3e-4", "train.micro_batch_tokens=8192", "train.dtype=float32",
        "train.activation_checkpointing=false", "train.save_every=0", "train.warm_start_steps=60", "train.warm_start_lr=1e-3",
        "reward.format_weight=0.0", "eval.every=5", "eval.num_prompts=100",
    ],
    # make demo-textworld (CPU, minutes): a tiny model whose tokenizer knows the games' words, pretrained on the texts
    # prepare_data.py writes from other games (make demo-textworld builds it into out/demo-textworld/model),
    # warm-started by imitation of a player who looks around before every move, then GRPO on the progress along the way
    # and the win, with 5 turns for quests of 3 steps
    "demo-textworld": [
        "model=out/demo-textworld/model", "algo=grpo", "steps=20", "run_dir=out/demo-textworld/run", "resume=never",
        "data.task=textworld", "data.train_path=out/demo-textworld/data/train.parquet", "data.val_path=out/demo-textworld/data/val.parquet",
        "data.max_prompt_tokens=512", "rollout.prompts_per_step=16", "rollout.group_size=4", "rollout.max_turns=5",
        "rollout.max_new_tokens=16", "rollout.max_context_tokens=2048", "rollout.max_obs_tokens=128", "rollout.dtype=float32", "rollout.compile=false",
        "ppo.mini_batch_size=64", "train.lr=5e-4", "train.micro_batch_tokens=8192", "train.dtype=float32",
        "train.activation_checkpointing=false", "train.save_every=0", "train.warm_start_steps=60", "train.warm_start_lr=1e-3",
        "eval.every=5", "eval.num_prompts=32",
    ],
    # make demo-smollm2 (CPU, ~33 minutes): the real SmolLM2-135M-Instruct on make demo's synthetic world, its prompts and
    # index made on the spot, its tools in nanoagent's Hermes fallback; a warm start imitating the same demonstrator (it
    # mostly guesses: RL must find that searching, and searching twice, pays), then GRPO at a small learning rate
    "demo-smollm2": [
        "model=smollm2-135m", "algo=grpo", "steps=15", "run_dir=out/demo-smollm2/run", "resume=never",
        "data.task=synthetic", "data.train_path=", "data.val_path=", "data.index_dir=", "data.max_prompt_tokens=512",
        "rollout.prompts_per_step=8", "rollout.group_size=4", "rollout.max_turns=4", "rollout.max_new_tokens=48",
        "rollout.max_context_tokens=1024", "rollout.max_obs_tokens=128", "rollout.search_top_k=1", "rollout.dtype=float32",
        "rollout.compile=false", "rollout.tool_timeout_s=10",
        "ppo.mini_batch_size=8", "train.lr=2e-5", "train.micro_batch_tokens=1024", "train.dtype=float32",
        "train.activation_checkpointing=false", "train.save_every=0", "train.warm_start_steps=12", "train.warm_start_lr=1e-4",
        "train.warm_start_batch_size=8", "reward.format_weight=0.0", "eval.every=5", "eval.num_prompts=64",
    ],
    # one GPU node: Qwen2.5-3B-Instruct on HotpotQA with search over Wikipedia (make speedrun)
    "hotpotqa": [
        "model=Qwen/Qwen2.5-3B-Instruct", "algo=grpo", "steps=200", "run_dir=out/hotpotqa",
        "data.task=hotpotqa", "data.train_path=data/hotpotqa/train.parquet", "data.val_path=data/hotpotqa/val.parquet",
        "data.index_dir=data/hotpotqa/index", "reward.metric=em", "reward.format_weight=0.1", "rollout.prompts_per_step=128", "rollout.group_size=5",
        "rollout.max_turns=4", "rollout.max_new_tokens=512", "rollout.max_context_tokens=6144",
        "train.lr=1e-6", "eval.every=20", "eval.num_prompts=500",
    ],
    # one GPU node: Qwen2.5-1.5B-Instruct playing TextWorld games, one command a turn (prepare_data.py --task=textworld)
    "textworld": [
        "model=Qwen/Qwen2.5-1.5B-Instruct", "algo=grpo", "steps=100", "run_dir=out/textworld",
        "data.task=textworld", "data.train_path=data/textworld/train.parquet", "data.val_path=data/textworld/val.parquet",
        "data.max_prompt_tokens=1024", "rollout.prompts_per_step=64", "rollout.group_size=8", "rollout.max_turns=12",
        "rollout.max_new_tokens=32", "rollout.max_context_tokens=4096", "rollout.max_obs_tokens=256",
        "train.lr=1e-6", "eval.every=10", "eval.num_prompts=64",
    ],
    # one GPU: GSM8K with the calculator, Agent-R1 v0's tool example (its reward asks for <think> in every turn)
    "gsm8k": [
        "model=Qwen/Qwen2.5-3B-Instruct", "algo=grpo", "steps=200", "run_dir=out/gsm8k",
        "data.task=gsm8k", "data.train_path=data/gsm8k/train.parquet", "data.val_path=data/gsm8k/val.parquet",
        "reward.require_think=true", "rollout.prompts_per_step=128", "rollout.group_size=5",
        "rollout.max_turns=8", "rollout.max_new_tokens=512", "rollout.max_context_tokens=4096",
        "train.lr=1e-6", "train.kl_mode=loss", "train.kl_coef=0.001", "eval.every=20", "eval.num_prompts=1319",
    ],
}


# the algos whose advantage compares a trajectory's outcome with a baseline (rl.outcome_token_advantages), and those
# whose baseline is the trajectory's group (rollout.group_size >= 2)
OUTCOME_ALGOS = ("grpo", "rloo", "reinforce")
GROUP_ALGOS = ("grpo", "rloo", "reinforce_plus_plus_baseline")


class ConfigError(ValueError):
    pass


def _fields(cls):
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], f) for f in dataclasses.fields(cls)}


def _parse_value(key, text, typ):
    """Turn the command-line text of one override into a value of the field's type, or refuse."""
    if typing.get_origin(typ) is Literal:
        choices = typing.get_args(typ)
        if text not in choices:
            raise ConfigError(f"{key}={text!r} is not a valid choice; valid: {', '.join(choices)}")
        return text
    if typ is bool:
        lowered = text.lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}={text!r}: expected a bool (true/false)")
    if typ in (int, float):
        try:
            return typ(text)
        except ValueError:
            raise ConfigError(f"{key}={text!r}: expected {typ.__name__}") from None
    if typ is str:
        return text
    raise ConfigError(f"{key}: fields of type {typ} cannot be set from the command line")


def all_keys(cls=Config, prefix=""):
    """Every settable dotted key with (type, default, help), in declaration order."""
    out = {}
    for name, (typ, f) in _fields(cls).items():
        if dataclasses.is_dataclass(typ):
            out.update(all_keys(typ, prefix + name + "."))
        else:
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            out[prefix + name] = (typ, default, f.metadata.get("help", ""))
    return out


def set_key(cfg, key, text):
    """Apply one `dotted.key=value` override to cfg in place."""
    *groups, leaf = key.split(".")
    node = cfg
    for g in groups:
        sub = _fields(type(node)).get(g)
        if sub is None or not dataclasses.is_dataclass(sub[0]):
            raise ConfigError(_unknown(key))
        node = getattr(node, g)
    entry = _fields(type(node)).get(leaf)
    if entry is None or dataclasses.is_dataclass(entry[0]):
        raise ConfigError(_unknown(key))
    setattr(node, leaf, _parse_value(key, text, entry[0]))


def _unknown(key):
    """The refusal of an unknown key, with the keys it may have meant: those with its leaf name (lr:
    train.lr, a key given without its group or in another), else those close to it, whole or by leaf
    name. --help lists them all."""
    keys = list(all_keys())
    leaves = {}
    for k in keys:
        leaves.setdefault(k.rsplit(".", 1)[-1], []).append(k)
    leaf = key.rsplit(".", 1)[-1]
    close = leaves.get(leaf) or list(dict.fromkeys([
        *difflib.get_close_matches(key, keys, n=3),
        *(k for near in difflib.get_close_matches(leaf, leaves, n=3) for k in leaves[near]),
    ]))[:3]
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    return f"unknown config key {key!r}.{hint} --help lists every key."


def apply_overrides(cfg, overrides):
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"expected key=value, got {item!r}")
        set_key(cfg, key.strip(), text.strip())
    validate(cfg)
    return cfg


def make_config(preset=None, overrides=()):
    """Defaults, then the preset's overrides, then the caller's (command line) overrides."""
    cfg = Config()
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; valid: {', '.join(PRESETS)}")
        apply_overrides(cfg, PRESETS[preset])
    return apply_overrides(cfg, overrides)


def validate(cfg):
    """
    Every numeric value in its range and every float finite (a nan or inf anywhere would poison the
    run where it is used, often many steps later), then the checks across fields; each message
    names the key, its value and what is valid.
    """
    values = flatten(to_dict(cfg))

    def need(ok, msg):
        if not ok:
            raise ConfigError(msg)

    def at_least(low, *keys):
        for key in keys:
            need(values[key] >= low, f"{key}={values[key]}: must be >= {low}")

    def above(low, *keys):
        for key in keys:
            need(values[key] > low, f"{key}={values[key]}: must be > {low}")

    for key, (typ, _, _) in all_keys().items():
        need(typ is not float or math.isfinite(values[key]), f"{key}={values[key]}: must be a finite number")
    at_least(1, "data.max_prompt_tokens", "data.num_train", "data.num_val", "rollout.prompts_per_step", "rollout.group_size",
             "rollout.max_turns", "rollout.max_new_tokens", "rollout.max_context_tokens", "rollout.max_obs_tokens", "rollout.search_top_k",
             "rollout.tensor_parallel_size", "rollout.keep_turns", "ppo.epochs", "ppo.mini_batch_size", "train.micro_batch_tokens", "train.tis_cap",
             "eval.num_prompts")
    at_least(0, "steps", "seed", "ppo.clip_low", "ppo.clip_high", "ppo.critic_lr", "ppo.critic_warmup_steps", "grpo.eps", "train.lr",
             "train.weight_decay", "train.warmup_steps", "train.kl_coef", "train.save_every", "train.keep_last", "train.warm_start_steps",
             "train.warm_start_lr", "train.warm_start_batch_size", "train.max_idle_steps",
             "reward.answer_weight", "reward.format_weight", "eval.every")
    above(0, "rollout.tool_timeout_s", "ppo.value_clip", "train.grad_clip")
    need(cfg.rollout.step_timeout_s > cfg.rollout.tool_timeout_s, f"rollout.step_timeout_s={cfg.rollout.step_timeout_s}: must be > "
         f"rollout.tool_timeout_s ({cfg.rollout.tool_timeout_s}): a step runs its tool calls")
    above(1, "ppo.clip_dual")
    # train.entropy_coef and train.tool_call_reward may be negative: an entropy penalty, a cost per tool call
    for key in ("ppo.gamma", "ppo.lam"):
        need(0 <= values[key] <= 1, f"{key}={values[key]}: must be in [0, 1]")
    for key in ("rollout.top_p", "rollout.gpu_memory_utilization"):
        need(0 < values[key] <= 1, f"{key}={values[key]}: must be in (0, 1]")
    need(cfg.rollout.temperature > 0, f"rollout.temperature={cfg.rollout.temperature}: must be > 0 (greedy decoding is for evaluation)")
    need(cfg.seed < 2 ** 31, f"seed={cfg.seed}: must be < 2**31 (numpy takes 32-bit seeds, and each rank adds its rank)")
    need(cfg.data.task in task_names() or cfg.data.task.endswith(".py"),
         f"data.task={cfg.data.task!r}: not a task; valid: {', '.join(task_names())}, or a path to a task file (.py)")
    need(cfg.resume in ("auto", "never"), f"resume={cfg.resume!r}: valid: auto, never")
    need(cfg.algo not in GROUP_ALGOS or cfg.rollout.group_size >= 2,
         f"algo={cfg.algo} needs rollout.group_size >= 2 (got {cfg.rollout.group_size}): a group of one has no baseline")
    need(cfg.rollout.max_context_tokens > cfg.data.max_prompt_tokens,
         f"rollout.max_context_tokens ({cfg.rollout.max_context_tokens}) must exceed data.max_prompt_tokens ({cfg.data.max_prompt_tokens})")
    need(not (cfg.algo in OUTCOME_ALGOS and cfg.train.kl_mode == "reward"),
         f"algo={cfg.algo} with train.kl_mode=reward: its advantage compares outcomes, and a per-token KL penalty in the reward "
         "has no place in it (GRPO, dividing each group's scores by their std, would blow the penalty's noise up to advantages "
         "of order 1 in a group of equal outcomes); use train.kl_mode=loss (k3 in the loss, as GRPO does) or none")
    need(cfg.algo == "ppo" or cfg.ppo.credit == "token",
         f"ppo.credit=step needs algo=ppo: it is how GAE assigns the critic's values, and algo={cfg.algo} has no critic")
    need(cfg.ppo.whiten_over == "tokens" or (cfg.algo == "ppo" and cfg.ppo.credit == "step" and cfg.ppo.whiten_advantages),
         "ppo.whiten_over=steps whitens step-level GAE advantages: it needs algo=ppo, ppo.credit=step and ppo.whiten_advantages=true")
    need(not (cfg.algo == "ppo" and cfg.rollout.context == "last_k" and cfg.ppo.credit == "token"),
         "rollout.context=last_k with algo=ppo needs ppo.credit=step: each turn is then a sequence of its own, and token-level "
         "GAE cannot carry a turn's value across to the next turn's sequence; step-level GAE links the turns")
    need(cfg.ppo.ratio == "token" or cfg.train.loss_agg != "token_mean",
         f"ppo.ratio={cfg.ppo.ratio} with train.loss_agg=token_mean: GSPO's objective is a mean over "
         "sequences (or steps) of each one's clipped ratio times its advantage, every one weighed the same; "
         "a token mean weighs each by its length. Use train.loss_agg="
         f"{'step_mean_token_mean' if cfg.ppo.ratio == 'step' else 'seq_mean_token_mean'} "
         "(verl's fix for GSPO)")
    need((cfg.rollout.prompts_per_step * cfg.rollout.group_size) % cfg.ppo.mini_batch_size == 0,
         f"rollout.prompts_per_step x rollout.group_size ({cfg.rollout.prompts_per_step * cfg.rollout.group_size}) "
         f"must be a multiple of ppo.mini_batch_size ({cfg.ppo.mini_batch_size})")


def to_dict(cfg):
    return dataclasses.asdict(cfg)


def from_dict(d):
    """Rebuild a Config from to_dict's output (e.g. a run's config.json), checking every key."""
    overrides = [f"{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in flatten(d).items()]
    return apply_overrides(Config(), overrides)


def flatten(d, prefix=""):
    """A nested config dict -> {"group.key": value}."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, prefix + k + "."))
        else:
            out[prefix + k] = v
    return out


def format_config(cfg):
    return "\n".join(f"{k} = {v}" for k, v in flatten(to_dict(cfg)).items())


def save_config(cfg, path):
    with open(path, "w") as f:
        json.dump(to_dict(cfg), f, indent=2)


def load_run_config(model, preset=None, overrides=()):
    """
    (config, where it came from) for a script that runs a trained model (rollout.py, chat.py): the
    named preset, else the config.json a training run saved next to its <run_dir>/hf export (the
    task, tools, budgets and sampling the model was trained with: the defaults would evaluate it
    under other ones, silently), else the defaults; then the command line's overrides.
    """
    if preset is not None:
        return make_config(preset, overrides), f"preset {preset}"
    run_config = os.path.join(os.path.dirname(os.path.normpath(model)), "config.json")
    if os.path.isdir(model) and os.path.isfile(run_config):
        with open(run_config) as f:
            try:
                saved = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{run_config}: not JSON ({e}); "
                                  "pass --config NAME to use a preset instead") from None
        # a nanoagent run's, not any config.json
        if isinstance(saved, dict) and "data" in saved and "rollout" in saved:
            try:
                cfg = from_dict(saved)
            except ConfigError as e:
                raise ConfigError(f"{run_config}: {e}") from None
            return apply_overrides(cfg, overrides), run_config
    return make_config(None, overrides), "defaults"


def reference():
    """The config reference as text: every key, its type, default and help (for --help)."""
    lines = []
    for key, (typ, default, help) in all_keys().items():
        kind = "|".join(typing.get_args(typ)) if typing.get_origin(typ) is Literal else typ.__name__
        lines.append(f"  {key:<34} {kind:<22} {default!s:<28} {help}")
    presets = ", ".join(PRESETS)
    return "config keys (key=value):\n" + "\n".join(lines) + f"\npresets (--config=NAME): {presets}"
