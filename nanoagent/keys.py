"""
Every config key, declared once by `opt`: its default, type, help, bounds, and whether a resume may change
it. The range checks (config.validate), the resume check (checkpoint.check_resume) and the reference
(--help, docs/config.md) are read from these declarations. A task's own keys (task.*) are declared in its task
file, as a dataclass `Knobs`, and exist when data.task names that task.
"""

import ast
import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Literal

TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")


def task_names():
    """The tasks in nanoagent/tasks/, one module each. Read from the folder rather than imported, so
    that a bad data.task is refused before anything is built."""
    names = os.listdir(TASKS_DIR)
    return sorted(name[:-3] for name in names if name.endswith(".py") and not name.startswith("_"))


def opt(default, help, low=None, above=None, high=None, fixed=False):
    """
    A config key: its default, one line of help, its bounds (low <= value, above < value, value <= high)
    and whether it is fixed for a run. A resume may change any other key (they steer what happens from
    the next step on), not a fixed one: the weights and optimizer state belong to the model and the
    algorithm, the data position and every seed to the task, prompts, order and batch shapes.
    """
    bounds = {"low": low, "above": above, "high": high}
    return field(default=default, metadata={"help": help, **bounds, "fixed": fixed})


@dataclass
class DataConfig:
    task: str = opt("hotpotqa",
                    f"a task in nanoagent/tasks/ ({', '.join(task_names())}) or a path to a task file: "
                    "its prompts, tools, reward and demonstrations", fixed=True)
    train_path: str = opt(
        "data/hotpotqa/train.parquet", "training prompts (parquet from prepare_data.py; synthetic: empty, "
        "made on the spot)", fixed=True)
    val_path: str = opt("data/hotpotqa/val.parquet", "held-out prompts for evaluation")
    max_prompt_tokens: int = opt(
        1024, "longest prompt (tokens, chat template and tool schemas included); checked when the data is "
        "loaded", low=1, fixed=True)
    bad_prompts: Literal["refuse", "drop"] = opt(
        "refuse", "prompts that cannot be trained on (a malformed row, a non-string answer, a duplicate id, "
        "longer than data.max_prompt_tokens): refuse the file, or drop them and say how many", fixed=True)
    shuffle: bool = opt(True, "shuffle the training prompts every epoch (seeded)", fixed=True)
    balance_by: str = opt(
        "", "a row field (e.g. type): every step's prompts take its values in turn, in equal numbers; empty: "
        "the plain order", fixed=True)


@dataclass
class RolloutConfig:
    engine: Literal["auto", "vllm", "hf"] = opt(
        "auto", "vllm: colocated vLLM engine; hf: the transformers fallback; auto: vllm where installed")
    prompts_per_step: int = opt(
        64, "distinct prompts rolled out per training step (over all ranks)", low=1, fixed=True)
    group_size: int = opt(5, "rollouts per prompt (GRPO groups; PPO may use 1)", low=1, fixed=True)
    temperature: float = opt(
        1.0, "sampling temperature (the trainer's logprobs use the same; greedy decoding is for evaluation)",
        above=0)
    top_p: float = opt(1.0, "nucleus sampling", above=0, high=1)
    max_turns: int = opt(4, "assistant turns per trajectory before it is cut", low=1)
    max_new_tokens: int = opt(512, "tokens the model may sample in one turn", low=1)
    max_context_tokens: int = opt(
        4096, "prompt + response budget of one trajectory (of one step with context=last_k or summary, or "
        "a flow's call)", low=1)
    max_obs_tokens: int = opt(512, "a tool result is truncated to this many tokens", low=1)
    tool_timeout_s: float = opt(10.0, "time limit of one tool call", above=0)
    step_timeout_s: float = opt(
        120.0, "time limit of one environment step (a tool task's: its calls, queueing included); past it "
        "the step is abandoned and its trajectory ends (env_error)", above=0)
    dtype: Literal["bfloat16", "float16", "float32"] = opt("bfloat16", "engine weights and activations")
    compile: bool = opt(
        True, "vLLM compiles the model (torch.compile; CUDA graphs on a GPU): faster decoding after a "
        "start-up cost (CPU, tiny model: ~5 s, ~15 s when nothing is cached); the CPU presets, short runs, "
        "leave it off")
    gpu_memory_utilization: float = opt(
        0.5, "share of GPU memory vLLM may take (weights + KV cache)", above=0, high=1)
    tensor_parallel_size: int = opt(
        1, "vLLM tensor parallelism for rollout.py and chat.py (one process, several GPUs); train.py takes "
        "1 only", low=1, fixed=True)
    max_staleness: int = opt(
        0, "partial rollouts: a step's rollout ends once rollout.prompts_per_step groups have ended; the "
        "others pause and go on in the next step under the new weights, no token trained more than this many "
        "steps after its policy sampled it (a group that would be waits for its end); 0: every step waits "
        "for its last trajectory. Needs rollout.extra_prompts and train.tis (docs/formulation.md: "
        "Partial rollouts)",
        low=0)
    extra_prompts: int = opt(
        0, "max_staleness > 0: groups in flight beyond rollout.prompts_per_step (over all ranks), drawn from "
        "spare prompts (seeded, apart from the data order); those still running when enough have ended "
        "carry over", low=0)
    context: Literal["full", "last_k", "summary"] = opt(
        "full", "what a turn sees: full: the whole trajectory, one growing token row; last_k: the system "
        "prompt, the question and the last rollout.keep_turns turns (Agent-R1 v0.1's step context); "
        "summary: the whole trajectory until its next prompt passes rollout.summary_tokens, then the model "
        "summarises it in a turn of its own (trained like any other) and the next turns see the system "
        "prompt, the question, the summary and the last turn. A turn whose context goes on from the one "
        "before keeps its ids and trains in the same row; one that leaves turns out is a row of its own")
    keep_turns: int = opt(
        2, "context=last_k: earlier turns (an assistant turn with its tool results) a turn sees", low=1)
    summary_tokens: int = opt(
        1024, "context=summary: a next prompt longer than this many tokens is summarised first (below "
        "rollout.max_context_tokens, with room for the summary turn)", low=1)
    tool_format: Literal["auto", "template", "hermes"] = opt(
        "auto", "how tools and their results are shown: template: by the chat template (tools=, tool "
        "messages); hermes: nanoagent's fallback for templates without tools (Qwen2.5's Hermes block in the "
        "system turn, results as <tool_response> in a user turn; docs/recipes.md: Models and chat "
        "templates); auto: template where it renders tools=, else hermes")


@dataclass
class PPOConfig:
    gamma: float = opt(1.0, "discount per action token (GAE, and REINFORCE++'s returns)", low=0, high=1)
    lam: float = opt(1.0, "GAE lambda", low=0, high=1)
    clip_low: float = opt(0.2, "ratio clip below 1", low=0)
    clip_high: float = opt(0.2, "ratio clip above 1 (raise it for clip-higher)", low=0)
    clip_dual: float = opt(3.0, "dual clip for negative advantages", above=1)
    value_clip: float = opt(0.5, "clip range of the value loss around the old values", above=0)
    epochs: int = opt(1, "passes over the rollout batch per step", low=1)
    mini_batch_size: int = opt(64, "trajectories per optimizer step (over all ranks)", low=1, fixed=True)
    critic_lr: float = opt(1e-5, "critic learning rate", low=0)
    critic_warmup_steps: int = opt(0, "steps that train only the critic before the policy moves", low=0)
    whiten_advantages: bool = opt(True, "normalise GAE advantages over the whole batch (mean 0, std 1)")
    whiten_over: Literal["tokens", "steps"] = opt(
        "tokens", "the statistics of that whitening: over action tokens, or (ppo.credit=step) over steps, "
        "each once however long (StepPO)")
    credit: Literal["token", "step"] = opt(
        "token", "GAE over action tokens (token), or over turns (step: Agent-R1 v0.1's step MDP, one value "
        "per turn at the token before it, the turn's tokens share its advantage)", fixed=True)
    ratio: Literal["token", "sequence", "step"] = opt(
        "token", "importance ratio of the clipped loss, every algo: per token (PPO), or per sequence (a "
        "row: a trajectory, or a turn with rollout.context=last_k) or per step (a turn), the geometric mean "
        "of its tokens' ratios clipped as a whole, without dual clip (GSPO)")


@dataclass
class GRPOConfig:
    scale_by_std: bool = opt(True, "divide by the group std (False: mean-centred only)")
    eps: float = opt(1e-6, "added to the group std", low=0)
    drop_uniform_groups: bool = opt(
        True, "algo=grpo or rloo: leave groups whose rewards are all equal out of the update (DAPO's "
        "dynamic sampling): they carry no signal, only dilute the loss; logged as dropped_uniform")
    refill: bool = opt(
        False, "DAPO's dynamic sampling: a group that ends with nothing to train on (uniform rewards, or all "
        "left out) is replaced within the step by a group of a spare prompt, until rollout.prompts_per_step "
        "groups train or grpo.max_refill is spent; logged as sampled_per_kept")
    max_refill: float = opt(
        1.0, "grpo.refill: spare prompts a step may add, as a multiple of rollout.prompts_per_step", low=0)


@dataclass
class TrainConfig:
    lr: float = opt(1e-6, "policy learning rate", low=0)
    weight_decay: float = opt(0.01, "AdamW weight decay", low=0)
    warmup_steps: int = opt(0, "linear learning-rate warm-up over the first N training steps", low=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = opt(
        "constant", "after the warm-up: constant, or down towards 0 at the last step in a line or a cosine")
    grad_clip: float = opt(1.0, "max gradient norm", above=0)
    micro_batch_tokens: int = opt(16384, "token budget of one forward/backward micro-batch per rank", low=1)
    balance_ranks: bool = opt(
        True, "before the update, move whole groups between ranks so that each trains on about as many "
        "tokens (every pass waits for the busiest rank); logged as rank_imbalance")
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "step_mean_token_mean"] = opt(
        "token_mean", "how per-token losses become one scalar: a mean over all action tokens, or a mean "
        "over trajectories (seq) or turns (step) of each one's token mean")
    kl_mode: Literal["none", "reward", "loss"] = opt(
        "none", "KL to the reference (the policy RL starts from): none, k1 in the reward (ppo, "
        "reinforce_plus_plus, reinforce_plus_plus_baseline), or k3 in the loss (any algo)")
    kl_coef: float = opt(0.001, "KL coefficient", low=0)
    entropy_coef: float = opt(0.0, "entropy bonus coefficient (negative: an entropy penalty)")
    tis: bool = opt(False, "truncated importance sampling for engine-vs-trainer logprob mismatch")
    tis_cap: float = opt(2.0, "cap of the importance weights: a larger weight is truncated to it (verl's "
                         "TIS; AReaL's decoupled PPO drops such a token instead)", low=1)
    overlong_filter: bool = opt(
        False, "leave trajectories cut by the token or context budget (finish reason truncated or "
        "context_budget) out of the update (DAPO's overlong filtering); logged as dropped_overlong")
    dtype: Literal["bfloat16", "float32"] = opt(
        "bfloat16", "compute dtype of policy, critic and reference (fp32 master weights and gradient "
        "reduction); the same on CPU and GPU")
    activation_checkpointing: bool = opt(True, "recompute activations in the backward pass")
    checkpoint_every: int = opt(
        1, "with activation_checkpointing: recompute every k-th decoder layer only (1: all; 2: every other "
        "one, half the recompute for half the memory saved)", low=1)
    compile: bool = opt(
        False, "torch.compile each decoder layer's norms and MLP (policy and critic; dynamic shapes, the "
        "attention eager); the same on CPU and GPU, where it fuses their element-wise kernels")
    lora_rank: int = opt(
        0, "rank of the LoRA adapters trained in place of the whole model (0: full fine-tuning); the base "
        "weights stay frozen, the KL reference is the base with the adapters off, checkpoints hold the "
        "adapters only", low=0, fixed=True)
    lora_alpha: float = opt(
        32.0, "LoRA's alpha: the adapters' update is scaled by lora_alpha / lora_rank", above=0, fixed=True)
    lora_targets: str = opt(
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        "the linear layers given adapters, by name, comma-separated (default: all of attention and MLP)",
        fixed=True)
    save_every: int = opt(50, "checkpoint every N steps (0: only at the end and on SIGTERM)", low=0)
    keep_last: int = opt(
        2, "complete checkpoints kept in run_dir (0: all); older ones are deleted once a new one is complete",
        low=0)
    tool_call_reward: float = opt(
        0.0, "process reward on the last token of each turn whose tool calls all succeeded (grpo, rloo and "
        "reinforce add it unnormalised, from its turn on; negative: a cost per tool call)")
    max_idle_steps: int = opt(
        5, "stop the run, saying why, after this many steps in a row that trained nothing (every trajectory "
        "left out: groups of equal rewards, budget cuts, failed environments); 0: never", low=0)
    warm_start_steps: int = opt(
        0, "imitation steps on the scripted demonstrations before RL (0: none), saved to run_dir/warm_start",
        low=0)
    warm_start_lr: float = opt(1e-3, "learning rate of the imitation warm start", low=0)
    warm_start_batch_size: int = opt(
        0, "demonstrations per imitation step, over all ranks (0: ppo.mini_batch_size)", low=0)


@dataclass
class RewardConfig:
    metric: Literal["em", "substring_em", "f1"] = opt(
        "em", "answer score in the reward: strict EM, substring EM (Agent-R1's accuracy) or token F1; all "
        "three are logged")
    answer_weight: float = opt(
        1.0, "reward = answer_weight * answer score + format_weight * format check", low=0)
    format_weight: float = opt(
        0.0, "weight of the format check (1 when the tags and tool calls are well formed and the last turn "
        "answers)", low=0)
    require_think: bool = opt(False, "the format check also asks every turn to open with <think>...</think>")


@dataclass
class EvalConfig:
    every: int = opt(10, "evaluate every N steps (0: never)", low=0)
    num_prompts: int = opt(256, "held-out prompts per evaluation (greedy decoding)", low=1)


@dataclass
class LogConfig:
    wandb: bool = opt(False, "also log to Weights & Biases (pip install wandb: make install leaves it out)")
    tensorboard: bool = opt(False, "also write TensorBoard's event files, offline, to run_dir/tensorboard")
    wandb_project: str = opt("nanoagent", "wandb project")
    trajectories_per_step: int = opt(
        2, "groups of each step kept for report.py's trajectory viewer (trajectories.jsonl); 0: none", low=0)


@dataclass
class NoKnobs:
    """The task.* keys of a task that declares none."""


@dataclass
class Config:
    model: str = opt(
        "Qwen/Qwen2.5-3B-Instruct", "hub id or local path; 'tiny' builds the tiny test model, "
        "'smollm2-135m' converts the packaged SmolLM2-135M-Instruct (offline)", fixed=True)
    algo: Literal["ppo", "grpo", "rloo", "reinforce", "reinforce_plus_plus",
                  "reinforce_plus_plus_baseline"] = opt(
        "grpo", "the advantage: ppo: critic + masked GAE; grpo: outcome normalised in its group; rloo: "
        "outcome minus the mean of the group's others; reinforce: outcome minus the batch mean; "
        "reinforce_plus_plus: discounted token returns, whitened over the batch; "
        "reinforce_plus_plus_baseline: reward minus its group's mean, whitened over the batch", fixed=True)
    steps: int = opt(200, "training steps (one rollout batch each)", low=0)
    run_dir: str = opt(
        "out/run", "checkpoints, metrics.jsonl, trajectories.jsonl, config.json, hf/ (the export), "
        "warm_start/")
    seed: int = opt(
        0, "seed of data order, sampling and initialisation (numpy takes 32-bit seeds, and each rank adds "
        "its rank)", low=0, high=2 ** 31 - 1, fixed=True)
    resume: Literal["auto", "never"] = opt(
        "auto", "auto: continue from the latest complete checkpoint in run_dir; never: start fresh (a used "
        "run_dir is moved aside to <run_dir>.old-<time>)")
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    # the task's own keys: the Knobs of data.task's file, set with data.task (set_key)
    task: typing.Any = None

    def __post_init__(self):
        if self.task is None:
            self.task = task_knobs(self.data.task)()


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Key:
    """One settable key, as `opt` declared it."""
    type: typing.Any
    default: typing.Any
    help: str
    low: typing.Any
    above: typing.Any
    high: typing.Any
    fixed: bool


def task_knobs(task):
    """
    The dataclass of a task's own keys (task.*): the class `Knobs` of its file, one it takes from a task
    in nanoagent/tasks/ (`from nanoagent.tasks.arithmetic import Knobs`, or `Knobs = arithmetic.Knobs`
    after `from nanoagent.tasks import arithmetic`), or NoKnobs. It is read from the file without
    importing it (a task imports torch and its own libraries; the config is read first, by --help too),
    so Knobs may use only opt, Literal, dataclass and the builtins.
    """
    path = os.path.join(TASKS_DIR, f"{task}.py") if task in task_names() else task
    if not (task.endswith(".py") or task in task_names()):
        raise ConfigError(f"data.task={task!r}: not a task; valid: {', '.join(task_names())}, "
                          "or a path to a task file (.py)")
    try:
        with open(path) as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError) as e:
        raise ConfigError(f"data.task={task!r}: {e}") from None
    knobs = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Knobs"]
    if not knobs:
        return borrowed_knobs(tree)
    namespace = {"opt": opt, "Literal": Literal, "dataclass": dataclass}
    try:
        exec(compile(ast.Module(knobs, type_ignores=[]), path, "exec"), namespace)
    except Exception as e:
        raise ConfigError(f"{path}: its Knobs may use only opt, Literal, dataclass and the builtins "
                          f"(nanoagent/keys.py: task_knobs): {type(e).__name__}: {e}") from None
    return namespace["Knobs"]


def borrowed_knobs(tree):
    """The Knobs a task file takes from a task in nanoagent/tasks/ (task_knobs), or NoKnobs."""
    tasks = {}  # a name bound to a task module -> the task's name
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "nanoagent.tasks":
            tasks.update({alias.asname or alias.name: alias.name for alias in node.names})
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nanoagent.tasks."):
            if any(alias.name == "Knobs" and alias.asname in (None, "Knobs") for alias in node.names):
                return task_knobs(node.module.rsplit(".", 1)[1])
        elif (isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["Knobs"]
              and isinstance(node.value, ast.Attribute) and node.value.attr == "Knobs"
              and ast.unparse(node.value.value) in tasks):
            return task_knobs(tasks[ast.unparse(node.value.value)])
    return NoKnobs


def node_keys(node, prefix=""):
    """The keys of one dataclass node of the tree (a group, a task's Knobs) -> Key, prefixed."""
    out = {}
    hints = typing.get_type_hints(type(node))
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            out.update(node_keys(value, prefix + f.name + "."))
        else:
            m = f.metadata
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            out[prefix + f.name] = Key(hints[f.name], default, m.get("help", ""), m.get("low"),
                                       m.get("above"), m.get("high"), m.get("fixed", False))
    return out


def all_keys(cfg=None):
    """Every settable dotted key of cfg (default: the defaults, whose task is hotpotqa) -> Key, in
    declaration order; the task.* keys are those of cfg's task."""
    return node_keys(Config() if cfg is None else cfg, "")


def fixed_keys(cfg):
    """The keys a resume may not change (opt's fixed)."""
    return {key for key, k in all_keys(cfg).items() if k.fixed}


