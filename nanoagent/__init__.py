"""
nanoagent: train LLM agents that call tools over many turns with end-to-end RL (PPO with a critic
and mask-aware GAE, GRPO). train.py at the repository's root is the loop; this package holds its
parts, each module one job: rl.py (the math), batch.py (the step's batch), model.py (models,
sharding, forward passes), logprobs.py (logprobs from logits, shared with the engines), engine.py
(rollout engines), agent.py (the multi-turn loop), env.py, tools.py, tasks/ (one file per task),
reward.py, data.py, retriever.py, checkpoint.py, config.py, common.py, metrics.py, imitation.py,
hub.py (what a model name means), smollm2.py (the packaged real model); tiny.py and
tiny_pretrain.py are the kit for tests and demos (the tiny model, its tokenizers, pretraining),
which the trainer does not import.
"""
