"""
benchmarks/learning_curves.py -- several runs' training curves in one figure, one colour a run.

    python benchmarks/learning_curves.py runs/smollm2-seed0 runs/smollm2-seed1 runs/smollm2-seed2 \
        --out docs/smollm2_curves.png

Each run folder needs its metrics.jsonl and summary.json (what train_gsm8k.py writes). Four
panels against the step: the sampled reward, the share of groups with no signal
(frac_reward_zero_std), the mean completion length with the share cut off at the cap, and the
KL to π_ref; the legend gives each run's held-out greedy score before and after (GSM8K's: its
accuracy, in %; another task's: the mean of its first reward, named in the legend).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("runs", nargs="+", help="run folders (train_gsm8k.py --out)")
    p.add_argument("--out", required=True, help="the figure's path (.png)")
    a = p.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [("reward", "sampled reward (share right)"),
              ("frac_reward_zero_std", "groups with no signal"),
              ("completions/mean_length", "mean completion length (tokens)"),
              ("kl", "KL to the reference")]
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.4))
    for run in a.runs:
        summary_path, metrics_path = Path(run) / "summary.json", Path(run) / "metrics.jsonl"
        for path in (summary_path, metrics_path):
            if not path.is_file():
                p.error(f"{path} does not exist (did that run finish?)")
        s = json.loads(summary_path.read_text())
        rows = [json.loads(line) for line in metrics_path.read_text().splitlines()]
        score = s.get("score", "correctness_reward")
        if score == "correctness_reward":
            label = (f"seed {s['train_config']['seed']}: {100 * s['accuracy_before']:.1f}% → "
                     f"{100 * s['accuracy_after']:.1f}%")
        else:
            label = (f"seed {s['train_config']['seed']}: {s['accuracy_before']:.3f} → "
                     f"{s['accuracy_after']:.3f}")
            panels[0] = ("reward", "sampled reward")
        steps = [r["step"] for r in rows]
        for ax, (key, title) in zip(axes, panels):
            line, = ax.plot(steps, [r[key] for r in rows], "o-", ms=3, label=label)
            if key == "completions/mean_length":
                ax.plot(steps, [100 * r["completions/clipped_ratio"] for r in rows], ":",
                        color=line.get_color())
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("step")
    axes[2].text(0.02, 0.02, "dotted: % cut off at the cap", transform=axes[2].transAxes,
                 fontsize=8)
    held_out = ("held-out greedy accuracy" if score == "correctness_reward"
                else f"held-out greedy {score}")
    axes[0].legend(fontsize=8, title=held_out, title_fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out, dpi=90)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
