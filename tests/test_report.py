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


def test_compare_puts_runs_side_by_side_with_their_question_types(tmp_path):
    """report.py --compare: each run's held-out metric at every evaluation (a run that skipped one leaves
    its cell empty), per question type in brackets, and one plot; a run without evaluations is refused in
    one line."""
    cfg = make_config("tiny", ["eval.every=2"])
    for name, ems in [("seed0", [0.0, 0.5, 0.75]), ("seed1", [0.25, 0.5])]:
        rows = [{"step": 2 * i, "eval/reward": em, "eval/em": em, "eval/1-hop/em": em, "eval/2-hop/em": em / 2}
                for i, em in enumerate(ems)]
        write_run(tmp_path / name, cfg, rows)
    out = tmp_path / "seeds.md"
    assert report.main(["--compare", str(tmp_path / "seed0"), str(tmp_path / "seed1"), "--metric=em",
                        f"--out={out}"]) == 0
    md = out.read_text()
    assert "| run | step 0 | step 2 | step 4 |" in md
    assert f"| {tmp_path / 'seed0'} | 0.00 (0.00 / 0.00) | 0.50 (0.50 / 0.25) | 0.75 (0.75 / 0.38) |" in md
    assert f"| {tmp_path / 'seed1'} | 0.25 (0.25 / 0.12) | 0.50 (0.50 / 0.25) |  |" in md
    assert "1-hop / 2-hop" in md and (tmp_path / "seeds.png").read_bytes()[:8] == PNG
    write_run(tmp_path / "no-eval", cfg, [step(1)])
    assert report.main(["--compare", str(tmp_path / "no-eval"), f"--out={out}"]) == 2
