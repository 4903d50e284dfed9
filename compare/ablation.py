"""
ablation.py -- what each GRPO variant changes, measured on the tiny world over several seeds.

    python ablation.py                            # every variant, seeds 0 1 2 (~1 hour, 2-core CPU)
    python ablation.py --variants grpo dr_grpo --seeds 0 1
    python ablation.py --out runs/ablation        # rerun: finished runs are kept, missing ones run

Every variant is train_gsm8k.py with a few flags changed (VARIANTS below), from the same cached warm
start, with the same steps, prompts per step and G: the same number of sampled completions per
step. The exceptions say so: dynamic sampling samples extra prompts to replace groups whose rewards
all agree (the table reports completions sampled), and μ = 2 does two updates per batch (the table
reports wall time).

The control, sft_control, spends the same wall time as the paper's GRPO (its mean time in
grpo_step, per seed) on more supervised steps of the warm start's own text instead, so the table
shows what RL adds beyond imitation. Its settings are read from the GRPO run's summary.json.

Writes, under --out: one ordinary run directory per (variant, seed), ablation.md (the table) and
ablation.png (final held-out accuracy, mean ± std over seeds). Columns: final held-out greedy
accuracy; its change from the warm start; steps until the training samples' accuracy (5-step moving
mean) first rises 10 points above its first 5 steps; mean completion length; completions sampled;
wall time. "vs grpo" says whether a variant's difference from the paper's GRPO is larger than the
seed-to-seed spread (|Δ| > 2 standard errors) or not.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # WHY: run as a script, the repository root is not on the path

# name: (flags for train_gsm8k.py, what it is)
VARIANTS = {
    "grpo": ([], "the paper: outcome reward, std-scaled advantages, per-sequence mean, "
                 "β = 0.04, μ = 1"),
    "dr_grpo": (["--loss-type", "dr_grpo", "--no-scale-rewards"],
                "Dr. GRPO (arXiv 2503.20783): no std scaling, constant length normaliser"),
    "dapo": (["--loss-type", "token", "--clip-eps-high", "0.28", "--dynamic-sampling", "2"],
             "DAPO (arXiv 2503.14476): token-level mean, clip-higher 0.28, dynamic sampling"),
    "gspo_mu2": (["--importance-sampling-level", "sequence", "--clip-eps", "3e-4",
                  "--clip-eps-high", "4e-4", "--num-iterations", "2"],
                 "GSPO (arXiv 2507.18071): sequence-level ratio and clip, at μ = 2 "
                 "(at μ = 1 its gradient is GRPO's)"),
    "process": (["--supervision", "process"],
                "process supervision (paper §4.1.3): calculator steps + final answer"),
    "beta0": (["--beta", "0"], "β = 0: no KL penalty, no reference model"),
    "mu2": (["--num-iterations", "2"], "μ = 2: two updates per batch of samples"),
    "cispo_mu2": (["--surrogate", "cispo", "--loss-type", "token", "--clip-eps-high", "0.28",
                   "--num-iterations", "2"],
                  "CISPO (arXiv 2506.13585): clipped, detached IS weight x log π, token mean, "
                  "ε_high 0.28, at μ = 2 (at μ = 1 its gradient is GRPO's token-level one)"),
    "sft_control": (None,
                    "control: the same wall time as grpo spent on more supervised steps, no RL"),
    # The baselines GRPO is measured against (baselines.py, ppo.py): --compare runs these four
    "ppo": (["--baseline", "critic"],
            "PPO with a learned critic (ppo.py): a value model the policy's size, GAE γ = 1, "
            "λ = 0.95, the KL in the reward"),
    "ppo_critic_lr": (["--baseline", "critic", "--value-lr", "1e-3"],
                      "the same PPO, its critic at 10x the policy's learning rate (1e-3), so it "
                      "learns within 30 steps"),
    "rloo": (["--baseline", "leave_one_out"],
             "RLOO (arXiv 2402.14740): the mean of the other G-1 rewards as the baseline"),
    "reinforce": (["--baseline", "none"], "REINFORCE: the reward itself, no baseline"),
}
# --compare: GRPO against the critic and the two critic-free baselines, with a learning curve
COMPARE = ["grpo", "ppo", "ppo_critic_lr", "rloo", "reinforce"]
COMPARE_FLAGS = ["--eval-every", "5", "--eval-batch-size", "300"]  # every 5 steps, all problems


def run_dir(out: Path, variant: str, seed: int) -> Path:
    return out / f"{variant}-seed{seed}"


def train_run(out: Path, variant: str, seed: int, common: list[str], threads: int) -> Path:
    """One train_gsm8k.py run in its own process; kept if its summary.json already exists."""
    d = run_dir(out, variant, seed)
    if (d / "summary.json").exists():
        return d
    cmd = [sys.executable, str(ROOT / "train_gsm8k.py"), *common, *VARIANTS[variant][0],
           "--seed", str(seed), "--threads", str(threads), "--out", str(d), "--save-every", "0"]
    with open(out / f"{variant}-seed{seed}.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"error: {variant} seed {seed} failed; "
                         f"see {out / f'{variant}-seed{seed}.log'}")
    return d


def settings_of(d: Path) -> tuple:
    """(train settings, GRPOConfig, model name) a finished train_gsm8k.py run recorded in its
    summary.json."""
    import grpo
    summary = json.loads((d / "summary.json").read_text())
    # NOTE: a run saved before GRPOConfig shed its machinery fields keeps only the ones it has now
    fields = grpo.GRPOConfig.__dataclass_fields__
    gcfg = grpo.GRPOConfig(**{k: v for k, v in summary["grpo_config"].items() if k in fields})
    return summary["train_config"], gcfg, summary["model"]


def sft_control_run(out: Path, seed: int, seconds: float, settings, threads: int) -> Path:
    """The warm start, trained `seconds` longer on its own slipped text, evaluated like a GRPO run
    (the same held-out problems, batch size and cap: `settings`, a GRPO run's settings_of)."""
    d = run_dir(out, "sft_control", seed)
    if (d / "summary.json").exists():
        return d
    import torch

    from recipe import checkpoint
    import rewards
    from recipe import evaluation
    from recipe import gsm8k
    from recipe import tasks
    from recipe import tiny_world
    t, gcfg, name = settings  # WHY the run's own model name: the control starts from that model
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    ws = tiny_world.WarmStartConfig(steps=t["warm_start_steps"], seed=t["warm_start_seed"],
                                    slip=t.get("warm_start_slip", "answer"))
    model, tok = checkpoint.load_pretrained(str(tiny_world.warm_start(ws, log=lambda *a: None)))
    eval_rows = tasks.gsm8k_rows(gsm8k.load_data("tiny", t["eval_size"], n_train=1)[1])

    import grpo
    from machinery import engine  # WHY: the sampler a GRPO run's own evaluation uses
    sample = engine.apply(engine.EngineConfig(), grpo.Seams(), grpo.eos_token_ids(model, tok),
                          grpo.pad_token_id(model, tok)).sample

    def evaluate(desc):
        return evaluation.evaluate(model, tok, rewards.correctness_reward, eval_rows, gcfg,
                                   t["system_prompt"], t["eval_batch_size"], desc=desc,
                                   sample=sample)

    before, start = evaluate("eval before"), time.perf_counter()
    steps = tiny_world.more_supervised_steps(model, tok, seconds, ws, seed=seed)
    spent = time.perf_counter() - start
    after = evaluate("eval after")
    d.mkdir(parents=True, exist_ok=True)
    (d / "metrics.jsonl").write_text("")
    checkpoint.write_json_atomic(d / "summary.json", {
        "accuracy_before": before, "accuracy_after": after, "accuracy_gain": after - before,
        "steps": steps, "wall_seconds": spent, "train_seconds": spent, "model": name,
        "data": "tiny", "eval_size": len(eval_rows), "torch_threads": threads,
        "supervised_steps": steps, "budget_seconds": seconds,  # grpo's train_seconds, this seed
        "train_config": {"seed": seed}})
    return d


# ----------------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------------
def run_stats(d: Path, group_size: int, prompts_per_step: int) -> dict:
    s = json.loads((d / "summary.json").read_text())
    metrics = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    acc = [m.get("rewards/correctness_reward", m["reward"]) for m in metrics]
    moving = [statistics.mean(acc[max(0, i - 4):i + 1]) for i in range(len(acc))]
    start = statistics.mean(acc[:5]) if acc else math.nan
    reached = next((i + 1 for i, a in enumerate(moving) if i >= 4 and a >= start + 0.10), None)
    sampled = sum(group_size * prompts_per_step * (1 + m.get("dynamic_sampling/rounds", 0))
                  for m in metrics)
    lengths = [m["completions/mean_length"] for m in metrics]
    return {"after": 100 * s["accuracy_after"], "gain": 100 * s["accuracy_gain"],
            "reached": reached, "length": statistics.mean(lengths) if lengths else math.nan,
            "sampled": sampled, "minutes": s["wall_seconds"] / 60,
            "train_seconds": s.get("train_seconds", sum(m["step_time"] for m in metrics))}


def mean_sd(xs, fmt="{:.1f}"):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    if not xs:
        return "—"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{fmt.format(statistics.mean(xs))} ± {fmt.format(sd)}"


def verdict(xs: list[float], base: list[float]) -> str:
    """Is mean(xs) - mean(base) larger than 2 standard errors of that difference?"""
    if len(xs) < 2 or len(base) < 2:
        return "too few seeds"
    diff = statistics.mean(xs) - statistics.mean(base)
    se = math.sqrt(statistics.variance(xs) / len(xs) + statistics.variance(base) / len(base))
    word = "larger than" if abs(diff) > 2 * se else "within"
    return f"{diff:+.1f} ({word} the spread)"


def table(out: Path, stats: dict[str, list[dict]], seeds: list[int], common_desc: str) -> str:
    base = [s["after"] for s in stats.get("grpo", [])]
    lines = [f"Tiny world, {common_desc}, seeds {', '.join(map(str, seeds))}.", "",
             "| variant | final accuracy (%) | change (points) | vs grpo (points) "
             "| steps to +10 (train) | mean length | completions sampled | minutes per run |",
             "|---|---|---|---|---|---|---|---|"]
    for name, runs in stats.items():
        reached = [r["reached"] for r in runs if r["reached"]]
        reached_txt = (f"{mean_sd(reached, '{:.0f}')} ({len(reached)}/{len(runs)})" if reached
                       else f"— (0/{len(runs)})")
        col = {k: mean_sd([r[k] for r in runs]) for k in ("after", "gain", "length", "minutes")}
        vs = "—" if name == "grpo" else verdict([r["after"] for r in runs], base)
        sampled = mean_sd([r["sampled"] for r in runs], "{:.0f}")
        lines.append(f"| {name} | {col['after']} | {col['gain']} | {vs} | {reached_txt} | "
                     f"{col['length']} | {sampled} | {col['minutes']} |")
    lines += ["", "| variant | what it is |", "|---|---|"]
    lines += [f"| {name} | {VARIANTS[name][1]} |" for name in stats]
    return "\n".join(lines)


def plot(out: Path, stats: dict[str, list[dict]], before: float):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(stats)
    means = [statistics.mean(r["after"] for r in stats[n]) for n in names]
    sds = [statistics.stdev([r["after"] for r in stats[n]]) if len(stats[n]) > 1 else 0
           for n in names]
    fig, ax = plt.subplots(figsize=(1.2 * len(names) + 2, 3.6))
    ax.bar(names, means, yerr=sds, capsize=4,
           color=["#444" if n == "grpo" else "#8aa" for n in names])
    ax.axhline(before, color="red", ls="--", lw=1, label=f"warm start ({before:.1f}%)")
    for i, n in enumerate(names):
        ax.plot([i] * len(stats[n]), [r["after"] for r in stats[n]], "k.", ms=4)
    ax.set_ylabel("held-out greedy accuracy (%)")
    ax.set_ylim(max(0, min(means) - 15), min(100, max(means) + 10))
    ax.legend(fontsize=8)
    ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(out / "ablation.png", dpi=110)
    plt.close(fig)


def curve(d: Path) -> list[tuple[int, float, float]]:
    """(step, training seconds so far, held-out accuracy %) at each evaluation of a run: before
    (step 0), every --eval-every steps, and after. Seconds are the summed step_time (sampling,
    scoring and updates; the evaluations' own time is left out)."""
    s = json.loads((d / "summary.json").read_text())
    metrics = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    spent = [0.0]
    for m in metrics:
        spent.append(spent[-1] + m["step_time"])
    points = [*map(tuple, s["evals"]), (s["steps"], s["accuracy_after"])]
    return [(step, spent[min(step, len(metrics))], 100 * acc) for step, acc in points]


def compare_table(stats: dict[str, list[dict]], runs: dict[str, list[Path]], desc: str) -> str:
    """GRPO against its baselines: accuracy ± over seeds, and what a step costs in time."""
    base = [r["after"] for r in stats["grpo"]]
    lines = [desc, "", "| method | final accuracy (%) | change (points) | vs grpo (points) | "
             "seconds per step | minutes per run |", "|---|---|---|---|---|---|"]
    for name, rs in stats.items():
        per_step = [r["train_seconds"] / max(1, curve(d)[-1][0]) for r, d in zip(rs, runs[name])]
        vs = "—" if name == "grpo" else verdict([r["after"] for r in rs], base)
        lines.append(f"| {name} | {mean_sd([r['after'] for r in rs])} | "
                     f"{mean_sd([r['gain'] for r in rs])} | {vs} | {mean_sd(per_step, '{:.2f}')} "
                     f"| {mean_sd([r['minutes'] for r in rs])} |")
    lines += ["", "| method | what it is |", "|---|---|"]
    lines += [f"| {name} | {VARIANTS[name][1]} |" for name in stats]
    return "\n".join(lines)


def compare_plot(runs: dict[str, list[Path]], path: Path):
    """Held-out accuracy against steps (left) and against training seconds (right): the mean
    over seeds as a line, each seed as a faint one."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for (name, dirs), color in zip(runs.items(), ["#222", "#c44", "#e9a", "#48a", "#8a4"]):
        curves = [curve(d) for d in dirs]
        for ax, x in zip(axes, (0, 1)):
            for c in curves:
                ax.plot([p[x] for p in c], [p[2] for p in c], color=color, alpha=0.25, lw=0.8)
            n = min(len(c) for c in curves)
            xs = [statistics.mean(c[i][x] for c in curves) for i in range(n)]
            ys = [statistics.mean(c[i][2] for c in curves) for i in range(n)]
            ax.plot(xs, ys, color=color, lw=2, marker="o", ms=3,
                    label=f"{name} ({len(curves)} seeds)")
    axes[0].set_xlabel("step (the same completions sampled per step by every method)")
    axes[1].set_xlabel("training seconds (sampling, scoring, updates)")
    axes[0].set_ylabel("held-out greedy accuracy (%)")
    axes[0].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description="GRPO variants on the tiny world over seeds "
                                "(see the module docstring).",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=[v for v in VARIANTS if v not in COMPARE[1:]],
                   choices=list(VARIANTS), metavar="NAME",
                   help=f"which to run (default: all but {', '.join(COMPARE[1:])}; known: "
                        f"{', '.join(VARIANTS)})")
    p.add_argument("--compare", action="store_true",
                   help=f"GRPO against its baselines: runs {', '.join(COMPARE)} with an "
                        f"evaluation every 5 steps, and writes compare.md and compare.png "
                        f"(default --out runs/compare)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds (default 0 1 2)")
    p.add_argument("--steps", type=int, default=30, help="GRPO steps per run (default 30)")
    p.add_argument("--eval-size", type=int, default=300, help="held-out problems (default 300)")
    p.add_argument("--jobs", type=int, default=2,
                   help="runs side by side (default 2; threads split among them)")
    p.add_argument("--out", help="output directory (default runs/ablation)")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --, flags passed to every "
                   "train_gsm8k.py run (e.g. -- --warm-start-steps 5)")
    a = p.parse_args(argv)
    extra = a.extra[1:] if a.extra[:1] == ["--"] else a.extra
    if a.compare:
        a.variants, extra = COMPARE, [*COMPARE_FLAGS, *extra]
    out = Path(a.out or ("runs/compare" if a.compare else "runs/ablation"))
    out.mkdir(parents=True, exist_ok=True)
    common = ["--steps", str(a.steps), "--eval-size", str(a.eval_size), *extra]
    threads = max(1, (os.cpu_count() or 1) // a.jobs)
    rl = [v for v in a.variants if v != "sft_control"]
    if "sft_control" in a.variants and "grpo" not in rl:
        rl.insert(0, "grpo")  # the control's time budget is grpo's
    t0 = time.perf_counter()
    with ThreadPoolExecutor(a.jobs) as pool:
        list(pool.map(lambda vs: train_run(out, vs[0], vs[1], common, threads),
                      [(v, s) for v in rl for s in a.seeds]))

    # Every variant shares G and the prompts per step: read them from the first run's settings.
    train_settings, gcfg, _ = settings_of(run_dir(out, rl[0], a.seeds[0]))
    G, B = gcfg.group_size, train_settings["prompts_per_step"]
    if "sft_control" in a.variants:
        for seed in a.seeds:
            grpo_run = run_dir(out, "grpo", seed)
            seconds = run_stats(grpo_run, G, B)["train_seconds"]
            # the same threads as each RL run, and the same evaluation as grpo's
            sft_control_run(out, seed, seconds, settings_of(grpo_run), threads)
    stats = {v: [run_stats(run_dir(out, v, s), G, B) for s in a.seeds]
             for v in [*rl, *(["sft_control"] if "sft_control" in a.variants else [])]}
    before = statistics.mean(100 * json.loads((run_dir(out, rl[0], s) / "summary.json")
                                              .read_text())["accuracy_before"] for s in a.seeds)
    desc = (f"{a.steps} GRPO steps of {B} prompts x G={G}, "
            f"{a.eval_size} held-out problems, warm start at {before:.1f}%")
    if a.compare:
        runs = {v: [run_dir(out, v, s) for s in a.seeds] for v in COMPARE}
        text = compare_table(stats, runs, f"Tiny world, {desc}, seeds "
                                          f"{', '.join(map(str, a.seeds))}.")
        (out / "compare.md").write_text(text + "\n")
        compare_plot(runs, out / "compare.png")
    else:
        text = table(out, stats, a.seeds, desc)
        (out / "ablation.md").write_text(text + "\n")
        plot(out, stats, before)
    print(text)
    minutes = (time.perf_counter() - t0) / 60
    name = "compare" if a.compare else "ablation"
    print(f"\n{len(stats) * len(a.seeds)} runs in {out}/ ({minutes:.0f} min this invocation); "
          f"table in {out / (name + '.md')}, plot in {out / (name + '.png')}")
    return stats


if __name__ == "__main__":
    main()
