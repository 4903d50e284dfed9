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

from recipe.flags import InputError

LOGS = ("metrics.jsonl", "samples.jsonl")  # cut back to the checkpoint's step on --resume
GSM8K_SCORE = "correctness_reward"  # the held-out score's reward whose mean is an accuracy


class RunLog:
    """Where each step of a run goes: metrics.jsonl (every metric, every step), samples.jsonl
    (a few completions every --sample-every steps), the progress bar and one line, --report-to,
    and the health warnings. `metrics` holds every step so far (a resumed run's too)."""

    def __init__(self, out: Path, fresh: bool, report_to: str, state: dict,
                 num_iterations: int = 1, score: str = GSM8K_SCORE):
        # WHY first: a missing tensorboard or wandb stops the run before any log is touched
        self.reporter = Reporter(report_to, out, {**state["train_config"], **state["grpo_config"]})
        self.out, self.health, self.score = out, Health(num_iterations), score
        if fresh:
            for name in LOGS:
                (out / name).write_text("")
        self.metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text()
                        .splitlines()]

    def step(self, bar, m: dict, samples: list[dict], steps: int, sample_every: int,
             group_size: int):
        step = m["step"]
        self.metrics.append(m)
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(m) + "\n")
        if step % sample_every == 0 or step == 1:
            with open(self.out / "samples.jsonl", "a") as f:
                for s in samples[:: group_size][:4]:
                    f.write(json.dumps({"step": step, **s}) + "\n")
        self.reporter.log(m, step)
        # NOTE: under process supervision `reward` is the final-answer step's reward (accuracy).
        acc = m.get(f"rewards/{self.score}", m["reward"])
        name = "acc" if self.score == GSM8K_SCORE else "score"  # the task's first reward
        bar.set_postfix({"reward": f"{m['reward']:.3f}", name: f"{acc:.3f}",
                         "kl": f"{m['kl']:.4f}"})
        bar.write(f"step {step:4d}/{steps}  reward {m['reward']:.3f}  {name} {acc:.3f}  "
                  f"zero-std {m['frac_reward_zero_std']:.2f}  kl {m['kl']:.4f}  "
                  f"len {m['completions/mean_length']:.1f}  entropy {m['entropy']:.3f}  "
                  f"{m['step_time']:.1f}s"
                  + ("  UPDATE SKIPPED (non-finite loss or gradient)" if m["skipped_updates"]
                     else ""))
        for line in self.health.check(m):
            bar.write(line)

    def evaluation(self, step: int, accuracy: float, wall_seconds: float):
        self.reporter.log({"eval/accuracy": accuracy}, step, wall_seconds)

    def close(self):
        self.reporter.close()


# ----------------------------------------------------------------------------------------------
# Health warnings: the failures GRPO users report most, each named with the flag that helps
# ----------------------------------------------------------------------------------------------
WINDOW = 5
"""Steps a condition must hold on average before it warns. Our choice: one noisy step is not a
trend, and five are still early in a 60-step run."""
ZERO_REWARD_STEPS = 20
"""Steps in a row of mean reward exactly 0 before that warning. Our choice: a third of the
quick start's run with nothing to learn from is a run to stop and look at."""
HEALTH = [  # (name, metric, holds(window mean, the first window's mean), message: value -> advice)
    ("truncation", "completions/clipped_ratio", lambda v, first: v > 0.5,
     "{:.0%} of completions hit --max-new-tokens before an EOS, so their answers are often cut "
     "off and earn no reward: raise --max-new-tokens"),
    ("no signal", "frac_reward_zero_std", lambda v, first: v > 0.8,
     "{:.0%} of groups have rewards that all agree, so their advantages are 0 and they teach "
     "nothing: use problems nearer the model's level, a larger --group-size, or "
     "--dynamic-sampling 2"),
    ("KL blow-up", "kl", lambda v, first: v > 1.0,
     "KL to the reference is {:.2f} (healthy runs stay well under 0.1): lower --lr, or raise "
     "--beta"),
    # WHY 2%: in fp32 the sampler and the trainer agree to 1e-5 (0% outside); bf16 logits put
    #     5-7% of SmolLM2-135M's tokens outside (docs/real_model.md)
    ("sampler mismatch", "sampling/ratio_outside_0.9_1.1", lambda v, first: v > 0.02,
     "{:.1%} of tokens are scored with a probability more than 10% away from the one they were "
     "sampled with, so the update trains on a policy that did not sample them: under --bf16 "
     "keep --fp32-logits on, or train in fp32 (--no-bf16); --sampler-is-cap 2 corrects for "
     "the rest"),
    # WHY relative: a formulaic task (the tiny world) is healthy at 0.04 nats a token
    ("entropy collapse", "entropy", lambda v, first: v < 0.1 * first,
     "entropy is {:.4f} nats a token, under a tenth of where the run started: the policy is "
     "close to deterministic and its groups stop differing; lower --lr or raise --beta"),
]


class Health:
    """Checks each step's metrics and returns each warning once, the first step its condition
    holds over the last WINDOW steps (mean reward: ZERO_REWARD_STEPS in a row at exactly 0)."""

    def __init__(self, num_iterations: int = 1):
        self.history: list[dict] = []
        self.said: set[str] = set()
        self.num_iterations = num_iterations

    def check(self, m: dict) -> list[str]:
        self.history.append(m)
        out = []
        if len(self.history) == 1 and self.num_iterations == 1:
            out.append("NOTE: with --num-iterations 1 the loss reads about 0 at every step: the "
                       "ratio π/π_old is exactly 1 and a group's advantages sum to 0, but the "
                       "gradient is not 0 (grpo.py, grpo_loss's NOTE). Watch reward, not loss.")
        last, first = self.history[-WINDOW:], self.history[:WINDOW]
        for name, key, holds, message in HEALTH:
            values = [h[key] for h in last if key in h]
            start = sum(h.get(key, 0) for h in first) / len(first)
            if (name not in self.said and len(values) == WINDOW
                    and holds(sum(values) / WINDOW, start)):
                self.said.add(name)
                out.append(f"WARNING ({name}, {key}): " + message.format(sum(values) / WINDOW))
        streak = self.history[-ZERO_REWARD_STEPS:]
        if ("zero reward" not in self.said and len(streak) == ZERO_REWARD_STEPS
                and all(h["reward"] == 0 for h in streak)):
            self.said.add("zero reward")
            out.append(f"WARNING (zero reward, reward): the mean reward has been exactly 0 for "
                       f"{ZERO_REWARD_STEPS} steps, so every advantage is 0 and nothing is "
                       f"learned. Read samples.jsonl: are answers cut off (raise "
                       f"--max-new-tokens), in the layout the reward expects (--system-prompt), "
                       f"or is the task too hard for the model?")
        return out


# ----------------------------------------------------------------------------------------------
# --report-to: TensorBoard or Weights & Biases, beside metrics.jsonl
# ----------------------------------------------------------------------------------------------
REPORT_TO = ("none", "tensorboard", "wandb")


class Reporter:
    """Every step's metrics (and each evaluation) to TensorBoard (out/tensorboard, read it with
    `tensorboard --logdir runs`) or W&B (project "grpo"; WANDB_MODE=offline keeps it local).
    Metric names are ours, which follow TRL's where it has one (reward, reward_std,
    frac_reward_zero_std, kl, entropy, completions/mean_length, clip_ratio/...). Both packages are
    optional: a missing one is a one-line error before the run starts."""

    def __init__(self, kind: str, out: Path, config: dict):
        self.kind, self.writer = kind, None
        if kind == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise InputError("--report-to tensorboard needs the tensorboard package: "
                                 "pip install tensorboard") from None
            self.writer = SummaryWriter(str(out / "tensorboard"))
            self.writer.add_text("config", f"```\n{json.dumps(config, indent=1)}\n```")
        elif kind == "wandb":
            try:
                import wandb
            except ImportError:
                raise InputError("--report-to wandb needs the wandb package: pip install wandb "
                                 "(WANDB_MODE=offline needs no account)") from None
            self.writer = wandb.init(project="grpo", name=out.name, dir=str(out), config=config)
        elif kind != "none":
            raise InputError(f"--report-to must be one of {', '.join(REPORT_TO)}, got {kind!r}")

    def log(self, metrics: dict, step: int, wall_seconds: float | None = None):
        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float))
                   and not isinstance(v, bool) and k != "step"}
        if self.kind == "tensorboard":
            for k, v in numbers.items():
                self.writer.add_scalar(k, v, step)
                if wall_seconds is not None:  # WHY: accuracy against wall time, a fair axis
                    self.writer.add_scalar(k + "_by_seconds", v, round(wall_seconds))
        elif self.kind == "wandb":
            self.writer.log({**numbers, **({"wall_seconds": wall_seconds}
                                           if wall_seconds is not None else {})}, step=step)

    def close(self):
        if self.writer is not None:
            (self.writer.close if self.kind == "tensorboard" else self.writer.finish)()


def results_table(summary: dict, out: Path) -> str:
    """The run's before/after table (also written to out/results.md)."""
    s, score = summary, summary.get("score", GSM8K_SCORE)
    what = (f"accuracy ({s['eval_size']} problems)" if score == GSM8K_SCORE
            else f"score (mean {score}, {s['eval_size']} rows)")
    table = (f"| held-out greedy {what} | before | after | change |\n"
             f"|---|---|---|---|\n| {s['model']} | {s['accuracy_before']:.3f} | "
             f"{s['accuracy_after']:.3f} | {s['accuracy_gain']:+.3f} |\n\n{s['steps']} GRPO steps, "
             f"{s['wall_seconds'] / 60:.1f} min on {s['device']}; results in {out}/")
    (out / "results.md").write_text(table + "\n")
    return "\n" + table


def moving_average(ys: list[float], window: int = WINDOW) -> list[float]:
    """The mean of each point and the (up to) window-1 before it: [1, 3, 5], 2 -> [1, 2, 4]."""
    return [sum(w) / len(w) for w in (ys[max(0, k - window + 1):k + 1] for k in range(len(ys)))]


def plot_curves(metrics: list[dict], evals: list[tuple[int, float]], path: Path,
                eval_size: int = 0, subset_size: int = 0, score: str = GSM8K_SCORE) -> list[str]:
    """One PNG of reward, accuracy, KL to the reference, clip ratio and completion length against
    step; returns its panels' titles. The accuracy panel has the training samples' and held-out
    greedy accuracy at each evaluation: the first and last on all eval_size problems, those
    between on the first subset_size. Each per-step line is drawn faint with its moving average
    over WINDOW steps on top; a panel whose values are all 0 (the clip ratio at μ = 1, where the
    ratio is exactly 1) is left out. score: the reward whose mean is the held-out score (GSM8K's:
    accuracy; another task's panel is titled by its name)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [m["step"] for m in metrics]
    key, scored = f"rewards/{score}", "accuracy" if score == GSM8K_SCORE else f"score: {score}"
    panels = [("reward", ["reward"]), (scored, [key]),
              ("KL to reference", ["kl"]), ("clip ratio", ["clip_ratio/low", "clip_ratio/high"]),
              ("completion length", ["completions/mean_length"])]
    # NOTE: under process supervision there is no rewards/correctness_reward; `reward` is the
    #       final answer's step reward, i.e. the accuracy.
    values = {k: [m.get(k, m["reward"] if k == key else math.nan)
                  for m in metrics] for _, keys in panels for k in keys}
    panels = [(t, keys) for t, keys in panels
              if t == scored or any(v != 0 for k in keys for v in values[k])]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (title, keys) in zip(axes, panels):
        for k in keys:
            label = k if len(keys) > 1 else "train samples"
            line, = ax.plot(steps, values[k], alpha=0.3, linewidth=1)
            ax.plot(steps, moving_average(values[k]), color=line.get_color(),
                    label=f"{label}, mean of {WINDOW}")
        if title == scored and evals:
            ax.plot(*zip(*evals), "o-", color="black", markersize=4,
                    label=(f"held-out greedy ({eval_size} first and last, {subset_size} between)"
                           if len(evals) > 2 and subset_size else "held-out, greedy"))
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [title for title, _ in panels]


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
    score = runs[0].get("score", GSM8K_SCORE)
    what = "accuracy" if score == GSM8K_SCORE else f"score (mean {score})"
    held_out = "problems" if score == GSM8K_SCORE else "rows"
    each = ", ".join(f"{100 * r['accuracy_gain']:+.1f}" for r in runs)
    command = (ms("command_seconds", 1 / 60) if all("command_seconds" in r for r in runs)
               else "not recorded")
    rows = [
        f"| runs (seeds) | {len(runs)} ({seeds}) |",
        "|---|---|",
        f"| model | {runs[0]['model']} |",
        f"| held-out {held_out} | {runs[0]['eval_size']} |",
        f"| GRPO steps | {runs[0]['steps']} |",
        f"| {what} before GRPO (%) | {ms('accuracy_before', 100)} |",
        f"| {what} after GRPO (%) | {ms('accuracy_after', 100)} |",
        f"| change (points) | {ms('accuracy_gain', 100)} (each run: {each}) |",
        f"| GRPO wall time per run, evaluations included (min) | {ms('wall_seconds', 1 / 60)} |",
        f"| whole command per run, model load or warm-start build included (min) | {command} |",
        f"| device, torch threads | {runs[0]['device']}, {runs[0]['torch_threads']} |",
    ]
    return "\n".join(rows)
