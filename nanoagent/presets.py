"""
Presets: named lists of config overrides (--config=NAME), applied before the command line's and checked
the same way (nanoagent/config.py).
"""

PRESETS = {
    # CPU, offline: the tiny random model on arithmetic with the calculator, no data files (tests, the
    # CPU runs of README.md and docs/)
    "tiny": [
        "model=tiny", "steps=20", "run_dir=out/tiny", "data.task=arithmetic", "data.max_prompt_tokens=768",
        "task.num_val=32", "rollout.prompts_per_step=8", "rollout.group_size=4", "rollout.max_turns=3",
        "rollout.max_new_tokens=48", "rollout.max_context_tokens=1536", "rollout.max_obs_tokens=128",
        "rollout.dtype=float32", "rollout.compile=false", "rollout.tool_timeout_s=5",
        "ppo.mini_batch_size=16", "ppo.critic_lr=1e-4", "train.lr=1e-4", "train.micro_batch_tokens=4096",
        "train.dtype=float32", "train.activation_checkpointing=false", "train.save_every=0",
        "train.warm_start_steps=0", "eval.every=0", "eval.num_prompts=32",
    ],
    # make demo (CPU, minutes): a tiny model whose tokenizer knows the synthetic world's words, pretrained on
    # scrambled copies of the world (make demo builds it into out/demo/model), warm-started by imitation of a
    # demonstrator that mostly guesses, then GRPO on EM alone
    "demo": [
        "model=out/demo/model", "algo=grpo", "steps=10", "run_dir=out/demo/run", "resume=never",
        "data.task=synthetic", "data.train_path=out/demo/data/train.parquet",
        "data.val_path=out/demo/data/val.parquet", "task.index_dir=out/demo/data/index",
        "data.max_prompt_tokens=512", "rollout.prompts_per_step=16", "rollout.group_size=4",
        "rollout.max_turns=4", "rollout.max_new_tokens=48", "rollout.max_context_tokens=1024",
        "rollout.max_obs_tokens=128", "task.search_top_k=1", "rollout.dtype=float32", "rollout.compile=false",
        "rollout.tool_timeout_s=10", "ppo.mini_batch_size=16", "train.lr=3e-4",
        "train.micro_batch_tokens=8192", "train.dtype=float32", "train.activation_checkpointing=false",
        "train.save_every=0", "train.warm_start_steps=60", "train.warm_start_lr=1e-3",
        "reward.format_weight=0.0", "eval.every=5", "eval.num_prompts=100",
    ],
    # make demo-textworld (CPU, minutes): a tiny model whose tokenizer knows the games' words, pretrained on
    # the texts prepare_data.py writes from other games (make demo-textworld builds it into
    # out/demo-textworld/model), warm-started by imitation of a player who looks around before every move,
    # then GRPO on the progress along the way and the win, with 5 turns for quests of 3 steps, its learning
    # rate down in a line to the last step (a policy that wins every training game moves less late)
    "demo-textworld": [
        "model=out/demo-textworld/model", "algo=grpo", "steps=20", "run_dir=out/demo-textworld/run",
        "resume=never", "data.task=textworld", "data.train_path=out/demo-textworld/data/train.parquet",
        "data.val_path=out/demo-textworld/data/val.parquet", "data.max_prompt_tokens=512",
        "rollout.prompts_per_step=16", "rollout.group_size=4", "rollout.max_turns=5",
        "rollout.max_new_tokens=16", "rollout.max_context_tokens=2048", "rollout.max_obs_tokens=128",
        "rollout.dtype=float32", "rollout.compile=false", "ppo.mini_batch_size=64", "train.lr=5e-4",
        "train.lr_schedule=linear", "train.micro_batch_tokens=8192", "train.dtype=float32",
        "train.activation_checkpointing=false", "train.save_every=0", "train.warm_start_steps=60",
        "train.warm_start_lr=1e-3", "eval.every=5", "eval.num_prompts=32",
    ],
    # make demo-smollm2's first stage: the real SmolLM2-135M-Instruct imitating a demonstrator that always
    # searches, as often as the question needs (80 x 8 demonstrations: SmolLM2 learns late, after the format,
    # which questions need a second search), written to out/demo-smollm2/imitation/warm_start; no RL
    "demo-smollm2-imitation": [
        "model=smollm2-135m", "algo=grpo", "steps=0", "run_dir=out/demo-smollm2/imitation", "resume=never",
        "data.task=synthetic", "data.train_path=", "data.val_path=", "task.index_dir=",
        "data.max_prompt_tokens=512", "rollout.max_turns=4", "rollout.max_context_tokens=1024",
        "rollout.max_obs_tokens=128", "task.search_top_k=1", "rollout.dtype=float32", "rollout.compile=false",
        "train.micro_batch_tokens=2048", "train.dtype=float32", "train.activation_checkpointing=false",
        "train.save_every=0", "train.warm_start_steps=80", "train.warm_start_lr=1e-4",
        "train.warm_start_batch_size=8", "task.demo_guess=0.0", "task.demo_skip_second_hop=0.0",
        "eval.every=0",
    ],
    # make demo-smollm2 (CPU, ~38 minutes with the first stage): the real SmolLM2-135M-Instruct on make demo's
    # synthetic world, its prompts and index made on the spot, its tools in nanoagent's Hermes fallback
    # (make demo-smollm2 starts it from the first stage's model); a warm start imitating a demonstrator that
    # mostly guesses (RL must find again that searching pays), then GRPO at a small learning rate
    "demo-smollm2": [
        "model=smollm2-135m", "algo=grpo", "steps=15", "run_dir=out/demo-smollm2/run", "resume=never",
        "data.task=synthetic", "data.train_path=", "data.val_path=", "task.index_dir=",
        "data.max_prompt_tokens=512", "rollout.prompts_per_step=8", "rollout.group_size=4",
        "rollout.max_turns=4", "rollout.max_new_tokens=48", "rollout.max_context_tokens=1024",
        "rollout.max_obs_tokens=128", "task.search_top_k=1", "rollout.dtype=float32", "rollout.compile=false",
        "rollout.tool_timeout_s=10", "ppo.mini_batch_size=8", "train.lr=2e-5",
        "train.micro_batch_tokens=1024", "train.dtype=float32", "train.activation_checkpointing=false",
        "train.save_every=0", "train.warm_start_steps=12", "train.warm_start_lr=1e-4",
        "train.warm_start_batch_size=8", "task.demo_guess=0.8", "task.demo_skip_second_hop=0.0",
        "reward.format_weight=0.0", "eval.every=5", "eval.num_prompts=64",
    ],
    # CPU, minutes: the corridor, where what a turn sees decides the outcome (nanoagent/tasks/corridor.py):
    # the full history passes the context budget before the door, last_k's window leaves the sign out, a
    # summary can carry its code; a tiny model whose tokenizer knows the corridor's words, pretrained to
    # copy, a warm start by imitation under the same context, then GRPO (bench/bench_corridor.py runs the
    # three); a context that cannot win trains nothing, and the run goes on (train.max_idle_steps=0)
    "corridor": [
        "model=out/corridor/model", "algo=grpo", "steps=10", "run_dir=out/corridor/run", "resume=never",
        "data.task=corridor", "data.train_path=out/corridor/data/train.parquet",
        "data.val_path=out/corridor/data/val.parquet", "data.max_prompt_tokens=256",
        "rollout.prompts_per_step=16", "rollout.group_size=4", "rollout.max_turns=10",
        "rollout.max_new_tokens=8", "rollout.max_context_tokens=384", "rollout.summary_tokens=250",
        "rollout.keep_turns=2",
        "rollout.dtype=float32", "rollout.compile=false", "ppo.mini_batch_size=64", "train.lr=3e-4",
        "train.micro_batch_tokens=8192", "train.dtype=float32", "train.activation_checkpointing=false",
        "train.save_every=0", "train.warm_start_steps=1000", "train.warm_start_lr=1e-3",
        "train.warm_start_batch_size=16", "train.max_idle_steps=0", "eval.every=5", "eval.num_prompts=64",
    ],
    # one GPU node: Qwen2.5-3B-Instruct on HotpotQA with search over Wikipedia (make speedrun)
    "hotpotqa": [
        "model=Qwen/Qwen2.5-3B-Instruct", "algo=grpo", "steps=200", "run_dir=out/hotpotqa",
        "data.task=hotpotqa", "data.train_path=data/hotpotqa/train.parquet",
        "data.val_path=data/hotpotqa/val.parquet", "task.index_dir=data/hotpotqa/index", "reward.metric=em",
        "reward.format_weight=0.1", "rollout.prompts_per_step=128", "rollout.group_size=5",
        "rollout.max_turns=4", "rollout.max_new_tokens=512", "rollout.max_context_tokens=6144",
        "train.lr=1e-6", "eval.every=20", "eval.num_prompts=500",
    ],
    # one 80 GB GPU: Qwen2.5-7B-Instruct on HotpotQA with LoRA adapters of rank 32 on every linear layer of
    # attention and MLP, at LoRA's learning rate (~10x full fine-tuning's), the KL reference its base for free;
    # the trainer's state is ~16 GB where full fine-tuning's would be ~122 GB (bench/bench_lora.py --estimate)
    "hotpotqa-7b-lora": [
        "model=Qwen/Qwen2.5-7B-Instruct", "algo=grpo", "steps=200", "run_dir=out/hotpotqa-7b-lora",
        "data.task=hotpotqa", "data.train_path=data/hotpotqa/train.parquet",
        "data.val_path=data/hotpotqa/val.parquet", "task.index_dir=data/hotpotqa/index", "reward.metric=em",
        "reward.format_weight=0.1", "rollout.prompts_per_step=32", "rollout.group_size=5",
        "rollout.max_turns=4", "rollout.max_new_tokens=512", "rollout.max_context_tokens=6144",
        "rollout.gpu_memory_utilization=0.45", "ppo.mini_batch_size=32", "train.lora_rank=32",
        "train.lora_alpha=32", "train.lr=1e-5", "train.micro_batch_tokens=16384", "train.kl_mode=loss",
        "eval.every=20", "eval.num_prompts=500",
    ],
    # one GPU node: Qwen2.5-1.5B-Instruct playing TextWorld games, one command a turn (prepare_data.py
    # --task=textworld)
    "textworld": [
        "model=Qwen/Qwen2.5-1.5B-Instruct", "algo=grpo", "steps=100", "run_dir=out/textworld",
        "data.task=textworld", "data.train_path=data/textworld/train.parquet",
        "data.val_path=data/textworld/val.parquet", "data.max_prompt_tokens=1024",
        "rollout.prompts_per_step=64", "rollout.group_size=8", "rollout.max_turns=12",
        "rollout.max_new_tokens=32", "rollout.max_context_tokens=4096", "rollout.max_obs_tokens=256",
        "train.lr=1e-6", "eval.every=10", "eval.num_prompts=64",
    ],
    # one GPU: GSM8K with the calculator, Agent-R1 v0's tool example (its reward asks for <think> in every
    # turn)
    "gsm8k": [
        "model=Qwen/Qwen2.5-3B-Instruct", "algo=grpo", "steps=200", "run_dir=out/gsm8k", "data.task=gsm8k",
        "data.train_path=data/gsm8k/train.parquet", "data.val_path=data/gsm8k/val.parquet",
        "reward.require_think=true", "rollout.prompts_per_step=128", "rollout.group_size=5",
        "rollout.max_turns=8", "rollout.max_new_tokens=512", "rollout.max_context_tokens=4096",
        "train.lr=1e-6", "train.kl_mode=loss", "train.kl_coef=0.001", "eval.every=20",
        "eval.num_prompts=1319",
    ],
}
