"""
Write report.md for a training run: the config, held-out metrics before and after RL, the training
curves as PNG (the reward; loss, KL, entropy and gradient norm; turns and response length), and (for
make speedrun) the wall time of each stage and the GPU-hours; and beside it trajectories.html, the
trajectory viewer (nanoagent/viewer.py): what the agent did in the first, middle and last step, turn
by turn and token by token. One static page, to open in a browser, offline.

    python report.py --run=out/demo/run                                  # -> out/demo/run/report.md
    python report.py --run=out/speedrun/run --eval=out/speedrun/val.jsonl --stages=out/speedrun/stages.tsv \
        --gpus=8 --out=out/speedrun/report.md
    python report.py --trajectories=out/rollouts.jsonl                   # -> out/rollouts.html (viewer only)
    python report.py --compare out/seed0 out/seed1 out/seed2 --metric=em --out=out/seeds.md   # runs side by side

Inputs are what train.py writes: <run>/config.json, <run>/metrics.jsonl (one JSON object per
step; step 0 is the evaluation before RL, when eval.every > 0) and <run>/trajectories.jsonl (a few
groups of each step: log.trajectories_per_step). --eval is the trajectories JSONL of rollout.py on
the whole validation set (its first --limit go into the viewer too). --stages is a TSV of
`stage<TAB>seconds` lines, one per pipeline stage. --trajectories writes the viewer alone, of
rollout.py's output or of a run's trajectories.jsonl. --compare writes a table of several runs'
held-out metric at every evaluation (per question type in brackets) and their curves in one plot:
seeds, or recipes, side by side.
"""

import argparse
import json
import os
import sys

from nanoagent.viewer import chosen_steps, page_entries, read_trajectories, write_viewer

QA_LEGEND = ("em = strict exact match; substring_em = a gold answer occurs in the prediction "
             "(Agent-R1's accuracy); f1 = token F1 (SQuAD); ")


def read_metrics(path):
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist: is {os.path.dirname(path)} a run folder written by "
                                "train.py?")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        raise ValueError(f"{path} is empty: the run logged no step")
    return rows


def read_stages(path):
    stages = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                name, _, seconds = line.rstrip("\n").partition("\t")
                try:
                    stages.append((name, float(seconds)))
                except ValueError:
                    raise ValueError(f"{path}:{n}: expected `stage<TAB>seconds`, "
                                     f"got {line.strip()!r}") from None
    return stages


def eval_summary(path):
    """Means over rollout.py's trajectories: reward, the task's scores, turns, tool calls."""
    with open(path) as f:
        trajs = [json.loads(line) for line in f if line.strip()]
    if not trajs:
        raise ValueError(f"{path} holds no trajectories")
    summary = {"reward": sum(t["reward"] for t in trajs) / len(trajs)}
    summary |= {k: sum(t["scores"][k] for t in trajs) / len(trajs) for k in trajs[0]["scores"]}
    summary["turns"] = sum(t["turns"] for t in trajs) / len(trajs)
    summary["tool_calls"] = sum(len(t["tool_calls"]) for t in trajs) / len(trajs)
    return summary, len(trajs)


# what the update did, beside the reward (what TRL and verl users look at first): panel title ->
# (metric, label) of each curve; a curve the run did not log (no critic, no reference) is left out
TRAINING_PANELS = {
    "Loss": [("pg_loss", "policy"), ("vf_loss", "value (critic)")],
    "KL": [("kl", "to the reference (k1)"), ("approx_kl", "to the policy that sampled (approx.)")],
    "Entropy": [("entropy", "policy, action tokens")],
    "Gradient norm": [("grad_norm", "policy"), ("vf_grad_norm", "critic")],
}


def plot(rows, out_dir):
    """Three PNGs: the reward curve (training samples, and the held-out greedy evaluation when the run
    had one); the loss, KL, entropy and gradient norm per step; turns and response length per step.
    Returns their file names."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in rows if "reward" in r]
    evals = [r for r in rows if "eval/reward" in r]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in train], [r["reward"] for r in train], label="training rollouts (sampled)",
            alpha=0.8)
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval/reward"] for r in evals], "o-",
                label="held-out (greedy)")
        ax.legend()
    ax.set(xlabel="step", ylabel="reward",
           title="Reward" if evals else "Reward of the training rollouts (no held-out evaluation)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "reward.png"), dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(2, 2, figsize=(9, 6))
    for ax, (title, curves) in zip(axes.flat, TRAINING_PANELS.items()):
        for key, label in curves:
            logged = [r for r in train if key in r]
            if logged:
                ax.plot([r["step"] for r in logged], [r[key] for r in logged], label=label)
        ax.set(xlabel="step", title=title)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "training.png"), dpi=120)
    plt.close(fig)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax1.plot([r["step"] for r in train], [r["turns"] for r in train])
    ax1.set(xlabel="step", ylabel="assistant turns", title="Turns per trajectory")
    ax2.plot([r["step"] for r in train], [r["response_tokens"] for r in train])
    ax2.set(xlabel="step", ylabel="tokens", title="Response length")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "turns_length.png"), dpi=120)
    plt.close(fig)
    return ["reward.png", "training.png", "turns_length.png"]


def write_comparison(runs, out_path, metric):
    """out_path (markdown) and a PNG beside it: each run's held-out `metric` (eval/<metric>) at every
    evaluation, per question type in brackets where the run has types (eval/<type>/<metric>), and the
    curves in one plot. Returns out_path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key, evals = f"eval/{metric}", {}
    for run in runs:
        evals[run] = [r for r in read_metrics(os.path.join(run, "metrics.jsonl")) if key in r]
        if not evals[run]:
            raise ValueError(f"{run} logged no held-out {key} (eval.every=0, or no such metric)")
    steps = sorted({r["step"] for rows in evals.values() for r in rows})
    lines = [f"# Held-out {metric} (greedy) at each evaluation", "",
             "| run | " + " | ".join(f"step {s}" for s in steps) + " |", "|---|" + "---|" * len(steps)]
    typed = set()
    for run, rows in evals.items():
        types = sorted({k.split("/")[1] for k in rows[-1] if k.count("/") == 2 and k.endswith(f"/{metric}")})
        typed.add(" / ".join(types))
        by_step = {r["step"]: r for r in rows}
        cells = [f"{by_step[s][key]:.2f}" + (" (" + " / ".join(f"{by_step[s][f'eval/{t}/{metric}']:.2f}"
                                                             for t in types) + ")" if types else "")
                 if s in by_step else "" for s in steps]
        lines.append(f"| {run} | " + " | ".join(cells) + " |")
    if typed - {""}:
        lines += ["", f"In brackets: the question types, {' and '.join(sorted(typed - {''}))}."]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for run, rows in evals.items():
        ax.plot([r["step"] for r in rows], [r[key] for r in rows], "o-", label=run)
    ax.set(xlabel="step", ylabel=metric, title=f"Held-out {metric} (greedy)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    image = os.path.splitext(out_path)[0] + ".png"
    fig.savefig(image, dpi=120)
    plt.close(fig)
    lines += ["", f"![{os.path.basename(image)}]({os.path.basename(image)})", ""]
    with open(out_path, "w") as f:
        f.write("\n".join(lines))
    return out_path


def viewer_entries(path, steps=None, limit=200):
    """The viewer's entries of a trajectories file and a line that says which they are: of train.py's
    trajectories.jsonl the chosen steps' (chosen_steps), of rollout.py's output the first `limit`."""
    records = read_trajectories(path)
    if not records:
        raise ValueError(f"{path} holds no trajectories")
    if "step" in records[0]:
        chosen = chosen_steps(records, steps)
        kept = [r for r in records if r["step"] in chosen]
        last = max(r["step"] for r in records)
        note = (f"{len(kept)} trajectories of steps {', '.join(map(str, chosen))} (of {last}), "
                "rank 0's first groups")
        return page_entries(kept, "training"), note
    if steps:
        raise ValueError(f"{path} is rollout.py's output, which has no steps: leave --steps out")
    return page_entries(records[:limit], "rollout.py"), (f"rollout.py: the first {min(limit, len(records))} "
                                                         f"of {len(records)} trajectories of {path}")


def write_run_viewer(run_dir, out_dir, eval_path=None, steps=None, limit=200):
    """trajectories.html in out_dir, of the run's trajectories.jsonl and (eval_path) rollout.py's
    trajectories. Returns the lines report.md says of it."""
    kept = os.path.join(run_dir, "trajectories.jsonl")
    entries, notes = [], []
    if os.path.exists(kept) and os.path.getsize(kept):  # empty: log.trajectories_per_step=0
        entries, note = viewer_entries(kept, steps)
        notes.append(note)
    if eval_path:
        evaluated, note = viewer_entries(eval_path, limit=limit)
        entries, notes = entries + evaluated, notes + [note]
    if not entries:
        return ["No trajectories were kept (log.trajectories_per_step=0, or a run from before "
                "trajectories.jsonl): no trajectory viewer.", ""]
    path = write_viewer(entries, os.path.join(out_dir, "trajectories.html"), f"Trajectories of {run_dir}",
                        "; ".join(notes))
    name = os.path.basename(path)
    return ["## Trajectories", "",
            f"[{name}]({name}): what the agent did, turn by turn and token by token, each trained token "
            f"coloured by its advantage ({'; '.join(notes)}). A static page: open it in a browser.", ""]


def write_report(run_dir, out_path, eval_path=None, stages=(), gpus=0, steps=None, limit=200):
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    with open(os.path.join(run_dir, "config.json")) as f:
        config = json.load(f)
    out_dir = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(out_dir, exist_ok=True)
    images = plot(rows, out_dir)
    evals = [r for r in rows if "eval/reward" in r]
    train = [r for r in rows if "reward" in r]

    lines = [f"# nanoagent report: {config['algo']} on {config['data']['task']}", "",
             f"Run folder `{run_dir}`, model `{config['model']}`, {len(train)} RL steps.", ""]
    lines += ["## Held-out metrics (greedy decoding)", ""]
    if evals:
        before, after = evals[0], evals[-1]
        lines += [f"| metric | before RL (step {before['step']}) "
                  f"| after RL (step {after['step']}) | change |",
                  "|---|---|---|---|"]
        keys = sorted((k for k in after if k.startswith("eval/") and k in before),
                      key=lambda k: k.count("/"))  # overall, then per type
        lines += [f"| {k[len('eval/'):]} | {before[k]:.3f} | {after[k]:.3f} | {after[k] - before[k]:+.3f} |"
                  for k in keys]
        lines += ["", f"reward = the task's reward recipe; {QA_LEGEND if 'eval/em' in keys else ''}"
                  "the other scores are the task's (its score()); turns and tool_calls per prompt; "
                  "TYPE/...: the prompts of one type.", ""]
    else:
        lines += [f"No held-out evaluation was logged (eval.every={config['eval']['every']}): "
                  "the curves below are of the sampled training rollouts.", ""]

    if eval_path:
        summary, n = eval_summary(eval_path)
        lines += [f"## Validation set: {n} questions (rollout.py, greedy)", "",
                  "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v:.3f} |" for k, v in summary.items()] + [""]
    lines += (["## Training curves", "",
               "Per step: the reward; the update's losses, KL (to the reference model when the run has one, "
               "train.kl_mode; and the update's approximate KL to the policy that sampled), the policy's "
               "entropy and the gradient norms before clipping; turns and response tokens per "
               "trajectory.", ""]
              + [f"![{name}]({name})" for name in images] + [""])
    if train:
        last = train[-1]
        step_times = sorted(r["time/step"] for r in train)
        lines += ["## Throughput", "",
                  f"- median step time {step_times[len(step_times) // 2]:.2f} s; "
                  f"last step: rollout {last['time/rollout']:.2f} s, "
                  f"logprob/value passes {last['time/forward']:.2f} s, update {last['time/update']:.2f} s, "
                  f"weight push {last['time/push']:.2f} s",
                  f"- {last['tokens_per_s']:.0f} tokens/s "
                  f"({last['action_tokens_per_s']:.0f} action tokens/s) at the last step", ""]
    if stages:
        total = sum(s for _, s in stages)
        lines += ["## Stages", "", "| stage | wall time |", "|---|---|"]
        lines += [f"| {name} | {seconds / 60:.1f} min |" for name, seconds in stages]
        lines += [f"| total | {total / 60:.1f} min |", ""]
        if gpus:
            lines += [f"GPU-hours: {total / 3600 * gpus:.2f} ({gpus} GPUs x {total / 3600:.2f} h)", ""]
    lines += write_run_viewer(run_dir, out_dir, eval_path, steps, limit)
    lines += ["## Config", "", "```json", json.dumps(config, indent=2), "```", ""]
    with open(out_path, "w") as f:
        f.write("\n".join(lines))
    return out_path


def steps_list(text):
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected step numbers separated by commas") from None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run",
                        help="run folder of train.py (config.json, metrics.jsonl, trajectories.jsonl)")
    source.add_argument("--trajectories", default=None,
                        help="write only the trajectory viewer of this JSONL (rollout.py's, or a run's "
                             "trajectories.jsonl), next to it as .html unless --out")
    source.add_argument("--compare", nargs="+", metavar="RUN",
                        help="run folders of train.py to compare: their held-out --metric at every "
                             "evaluation, as a table and one plot (--out, default compare.md)")
    parser.add_argument("--out", default=None,
                        help="report path (default: <run>/report.md); the PNGs and trajectories.html go next "
                             "to it. With --trajectories: the page's path")
    parser.add_argument("--metric", default="reward",
                        help="--compare: the held-out metric, eval/<metric> (e.g. em; default: reward)")
    parser.add_argument("--eval", default=None, help="trajectories JSONL of rollout.py on the validation set")
    parser.add_argument("--stages", default=None, help="TSV of stage<TAB>seconds (make speedrun writes it)")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs used, for GPU-hours")
    parser.add_argument("--steps", type=steps_list, default=None,
                        help="training steps the viewer shows, e.g. 1,50,100 (default: first, middle, last)")
    parser.add_argument("--limit", type=int, default=200,
                        help="rollout.py's trajectories the viewer shows: the first N (default: 200)")
    args = parser.parse_args(argv)
    try:
        if args.compare:
            path = write_comparison(args.compare, args.out or "compare.md", args.metric)
        elif args.trajectories:
            entries, note = viewer_entries(args.trajectories, args.steps, args.limit)
            path = write_viewer(entries, args.out or os.path.splitext(args.trajectories)[0] + ".html",
                                f"Trajectories of {args.trajectories}", note)
        else:
            stages = read_stages(args.stages) if args.stages else []
            path = write_report(args.run, args.out or os.path.join(args.run, "report.md"), args.eval, stages,
                                args.gpus, args.steps, args.limit)
    except (FileNotFoundError, ValueError) as e:
        print(f"report.py: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
