"""report.py on a run folder as train.py writes it: report.md shows the held-out metrics before and
after RL when the run evaluated, says there was no held-out evaluation when it did not, and plots
the update's loss, KL, entropy and gradient norm beside the reward."""

import json

import pytest

import report
from nanoagent.config import make_config, save_config

PNG = b"\x89PNG\r\n\x1a\n"


def step(n, **extra):
    """A step's metrics as train.py logs them (nanoagent/metrics.py: step_metrics): GRPO, no reference."""
    return {"step": n, "reward": 0.1 * n, "em": 0.1 * n, "turns": 1.5, "response_tokens": 40.0,
            "pg_loss": 0.01, "clipfrac": 0.0, "approx_kl": 0.001 * n, "entropy": 1.0 - 0.1 * n,
            "kl_loss": 0.0, "grad_norm": 0.5, "skipped": 0.0,
            "time/rollout": 1.0, "time/forward": 0.2, "time/update": 0.5, "time/push": 0.1, "time/step": 1.8,
            "tokens_per_s": 900.0, "action_tokens_per_s": 200.0,
            **extra}


def write_run(run, cfg, rows):
    run.mkdir()
    save_config(cfg, run / "config.json")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


# GRPO that evaluated held-out prompts; PPO with a reference that did not (its critic's value loss and
# gradient norm, and the KL to the reference, are plotted with the rest)
RUNS = {"grpo-evaluated": (["eval.every=2"], {}),
        "ppo-reference-no-eval": (["algo=ppo", "train.kl_mode=loss"],
                                  {"vf_loss": 0.3, "vf_clipfrac": 0.1, "vf_grad_norm": 2.0, "vf_skipped": 0.0,
                                   "kl": 0.002})}


@pytest.mark.parametrize("run", RUNS)
def test_report_plots_the_update_beside_the_reward_and_says_when_nothing_was_held_out(tmp_path, run):
    overrides, extra = RUNS[run]
    cfg = make_config("tiny", overrides)
    evaluated = cfg.eval.every > 0
    held_out = [{"step": 0, "eval/reward": 0.0, "eval/em": 0.0}] if evaluated else []
    evaluation = {"eval/reward": 0.5, "eval/em": 0.5} if evaluated else {}
    rows = held_out + [step(1, **extra), step(2, **extra, **evaluation)]
    write_run(tmp_path / "run", cfg, rows)
    assert report.main([f"--run={tmp_path / 'run'}"]) == 0
    md = (tmp_path / "run" / "report.md").read_text()
    for png in ("reward.png", "training.png", "turns_length.png"):
        assert f"![{png}]({png})" in md and (tmp_path / "run" / png).read_bytes()[:8] == PNG
    assert "losses, KL" in md and "entropy" in md and "gradient norms" in md
    if evaluated:
        assert "| em | 0.000 | 0.500 | +0.500 |" in md and "no held-out evaluation" not in md.lower()
    else:
        assert "no held-out evaluation" in md.lower() and "before RL" not in md
