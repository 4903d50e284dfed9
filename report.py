"""
report.py -- what a finished run shows: its curves, and a results table over several runs.

    plot_curves(metrics, evals, "runs/x/curves.png")           # reward, accuracy, KL, clip, length
    print(summarize(["runs/a", "runs/b", "runs/c"]))           # mean ± std over runs' summary.json

`python train_gsm8k.py summarize DIR...` prints the table; the README's quick-start table is one.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from flags import InputError


def log_step(
    out: Path, bar, m: dict, samples: list[dict], steps: int, sample_every: int, group_size: int
):
    """metrics.jsonl every step; samples.jsonl every --sample-every steps; the bar and one line."""
    step = m["step"]
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps(m) + "\n")
    if step % sample_every == 0 or step == 1:
        with open(out / "samples.jsonl", "a") as f:
            for s in samples[:: group_size][:4]:
                f.write(json.dumps({"step": step, **s}) + "\n")
    # NOTE: under process supervision `reward` is the final-answer step's reward, i.e. the accuracy.
    acc = m.get("rewards/correctness_reward", m["reward"])
    bar.set_postfix(reward=f"{m['reward']:.3f}", acc=f"{acc:.3f}", kl=f"{m['kl']:.4f}")
    bar.write(f"step {step:4d}/{steps}  reward {m['reward']:.3f}  acc {acc:.3f}  "
              f"zero-std {m['frac_reward_zero_std']:.2f}  kl {m['kl']:.4f}  "
              f"len {m['completions/mean_length']:.1f}  entropy {m['entropy']:.3f}  "
              f"{m['step_time']:.1f}s"
              + ("  UPDATE SKIPPED (non-finite loss or gradient)" if m["skipped_updates"] else ""))


def results_table(summary: dict, out: Path) -> str:
    """The run's before/after table (also written to out/results.md)."""
    s = summary
    table = (f"| held-out greedy accuracy ({s['eval_size']} problems) | before | after | change |\n"
             f"|---|---|---|---|\n| {s['model']} | {s['accuracy_before']:.3f} | "
             f"{s['accuracy_after']:.3f} | {s['accuracy_gain']:+.3f} |\n\n{s['steps']} GRPO steps, "
             f"{s['wall_seconds'] / 60:.1f} min on {s['device']}; results in {out}/")
    (out / "results.md").write_text(table + "\n")
    return "\n" + table


def plot_curves(metrics: list[dict], evals: list[tuple[int, float]], path: Path):
    """One PNG: reward, accuracy (training samples, and held-out greedy at each evaluation), KL to
    the reference, clip ratio and completion length, against step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [m["step"] for m in metrics]
    panels = [("reward", ["reward"]), ("accuracy", ["rewards/correctness_reward"]),
              ("KL to reference", ["kl"]), ("clip ratio", ["clip_ratio/low", "clip_ratio/high"]),
              ("completion length", ["completions/mean_length"])]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (title, keys) in zip(axes, panels):
        for k in keys:
            # NOTE: under process supervision there is no rewards/correctness_reward; `reward` is
            #       the final answer's step reward, i.e. the accuracy.
            ys = [m.get(k, m["reward"] if k == "rewards/correctness_reward" else math.nan)
                  for m in metrics]
            ax.plot(steps, ys, label=k if len(keys) > 1 else "train samples")
        if title == "accuracy" and evals:
            ax.plot(*zip(*evals), "o-", color="black", label="held-out, greedy")
        ax.set_title(title)
        ax.set_xlabel("step")
        if len(keys) > 1 or title == "accuracy":
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarize(run_dirs: list[str]) -> str:
    """A markdown table, mean ± std over runs, from each run's summary.json (the README's results).
    Raises InputError naming the first run that has no summary.json."""
    runs = []
    for d in run_dirs:
        path = Path(d) / "summary.json"
        if not path.is_file():
            raise InputError(f"{path} does not exist (did that run finish?)")
        runs.append(json.loads(path.read_text()))

    def ms(key, scale=1.0, fmt="{:.1f}"):
        xs = [r[key] * scale for r in runs]
        sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
        return f"{fmt.format(statistics.mean(xs))} ± {fmt.format(sd)}"

    seeds = ", ".join(str(r["train_config"]["seed"]) for r in runs)
    each = ", ".join(f"{100 * r['accuracy_gain']:+.1f}" for r in runs)
    command = (ms("command_seconds", 1 / 60) if all("command_seconds" in r for r in runs)
               else "not recorded")
    rows = [
        f"| runs (seeds) | {len(runs)} ({seeds}) |",
        "|---|---|",
        f"| model | {runs[0]['model']} |",
        f"| held-out problems | {runs[0]['eval_size']} |",
        f"| GRPO steps | {runs[0]['steps']} |",
        f"| accuracy before GRPO (%) | {ms('accuracy_before', 100)} |",
        f"| accuracy after GRPO (%) | {ms('accuracy_after', 100)} |",
        f"| change (points) | {ms('accuracy_gain', 100)} (each run: {each}) |",
        f"| GRPO wall time per run, evaluations included (min) | {ms('wall_seconds', 1 / 60)} |",
        f"| whole command per run, model load or warm-start build included (min) | {command} |",
        f"| device, torch threads | {runs[0]['device']}, {runs[0]['torch_threads']} |",
    ]
    return "\n".join(rows)
