"""
benchmarks/vs_trl.py -- our grpo_step against TRL's GRPOTrainer on identical work, measured in one run.

    pip install -r benchmarks/requirements.txt           # TRL: a benchmark dependency only
    python benchmarks/vs_trl.py                          # hidden-64 model, G=4, 2 prompts/step, 32 tokens, 1 thread
    python benchmarks/vs_trl.py --hidden 256 --layers 4  # the larger size

Identical work on both sides:
    - the same saved model and tokenizer (a tiny_world Llama, random weights, saved to a temporary folder);
    - the same prompts (tiny-world questions), G, prompts per step, and completion length, forced with
      min_new_tokens = max_new_tokens so neither side can stop early;
    - fp32, the same torch thread count, offline (HF_HUB_OFFLINE=1, report_to="none");
    - the same beta, num_iterations (μ), loss_type ("grpo"), learning rate, grad-norm clip, sampling
      (temperature 1, top_k 0, top_p 1) and reward function (rewards.correctness_reward).

Each side runs in a fresh process of its own, so its peak RSS is its own (imports included: that is what a user
pays). The sides alternate for --rounds rounds, so a busy machine slows both alike; the reported s/step is the
median over rounds of each round's median step time after --warmup steps. The last line printed is JSON:
    {"ours_s_per_step", "trl_s_per_step", "ratio", "ours_peak_rss_mb", "trl_peak_rss_mb", ...}
Without TRL installed it says so and exits 0 (a skip, not a failure).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def build_model(path: Path, hidden: int, layers: int, heads: int):
    """A random tiny_world Llama and its character tokenizer, saved where both sides load them from."""
    import tiny_world
    tok = tiny_world.char_tokenizer()
    model = tiny_world.tiny_llama(tok, hidden=hidden, layers=layers, heads=heads, seed=0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def rows_for(n_prompts: int) -> list[dict]:
    import tiny_world
    return [{"prompt": tiny_world.prompt_of(r["question"]), "answer": r["answer"]}
            for r in tiny_world.make_problems(n_prompts, "train", seed=0)]


def peak_rss_mb() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# ----------------------------------------------------------------------------------------------
# The two workers. Each runs --steps steps and prints one JSON line: step times and peak RSS.
# ----------------------------------------------------------------------------------------------
def run_ours(a) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import grpo
    import rewards
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    policy = grpo.disable_dropout(AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32))
    cfg = grpo.GRPOConfig(group_size=a.group_size, max_new_tokens=a.tokens, min_new_tokens=a.tokens, beta=a.beta,
                          num_iterations=a.num_iterations, lr=a.lr, micro_batch_size=a.prompts * a.group_size)
    ref = grpo.make_reference(policy) if a.beta else None
    opt = grpo.make_optimizer(policy, cfg)
    rows = rows_for(a.steps * a.prompts)
    times = []
    for step in range(a.steps):
        batch = rows[step * a.prompts:(step + 1) * a.prompts]
        t = time.perf_counter()
        grpo.grpo_step(policy, ref, opt, tok, [r["prompt"] for r in batch], [rewards.correctness_reward], cfg,
                       columns={"answer": [r["answer"] for r in batch]})
        times.append(time.perf_counter() - t)
    return {"step_times": times, "peak_rss_mb": peak_rss_mb()}


def run_trl(a) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    import rewards
    torch.set_num_threads(a.threads)
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32)

    times, started = [], []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            started.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - started[-1])

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, report_to="none", use_cpu=True, bf16=False, fp16=False, seed=0,
            max_steps=a.steps, per_device_train_batch_size=a.prompts * a.group_size, gradient_accumulation_steps=1,
            num_generations=a.group_size, max_completion_length=a.tokens,
            generation_kwargs={"min_new_tokens": a.tokens}, temperature=1.0, top_k=0, top_p=1.0,
            beta=a.beta, num_iterations=a.num_iterations, loss_type="grpo", scale_rewards="group",
            learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
            logging_steps=1, save_strategy="no", shuffle_dataset=False, dataloader_num_workers=0,
            disable_dropout=True, log_completions=False,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=[rewards.correctness_reward], args=args,
                              train_dataset=Dataset.from_list(rows_for(a.steps * a.prompts)), processing_class=tok,
                              callbacks=[StepTimer()])
        trainer.train()
    return {"step_times": times, "peak_rss_mb": peak_rss_mb()}


# ----------------------------------------------------------------------------------------------
# The parent: builds the model, alternates the two sides in fresh processes, reports
# ----------------------------------------------------------------------------------------------
def worker_cmd(a, side: str, model_dir: Path) -> list[str]:
    flags = ["--worker", side, "--model-dir", str(model_dir)]
    for k in ("threads", "group_size", "prompts", "tokens", "steps", "beta", "num_iterations", "lr"):
        flags += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    return [sys.executable, __file__, *flags]


def run_worker(cmd: list[str]) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": cmd[cmd.index("--threads") + 1]}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"error: the {cmd[cmd.index('--worker') + 1]} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=64, help="model width (default 64)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--threads", type=int, default=1, help="torch threads on each side (default 1)")
    p.add_argument("--group-size", type=int, default=4, help="G, completions per prompt (default 4)")
    p.add_argument("--prompts", type=int, default=2, help="prompts per step (default 2)")
    p.add_argument("--tokens", type=int, default=32, help="completion length, forced on both sides (default 32)")
    p.add_argument("--steps", type=int, default=12, help="steps per side per round (default 12)")
    p.add_argument("--warmup", type=int, default=2, help="first steps of each round left out of the median (default 2)")
    p.add_argument("--rounds", type=int, default=2, help="alternating ours/TRL rounds (default 2)")
    p.add_argument("--beta", type=float, default=0.04, help="KL weight on both sides (default 0.04, the paper's)")
    p.add_argument("--num-iterations", type=int, default=1, help="μ on both sides (default 1)")
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate on both sides (default 1e-4)")
    p.add_argument("--worker", choices=["ours", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.steps <= a.warmup:
        p.error(f"--steps ({a.steps}) must be larger than --warmup ({a.warmup})")

    if a.worker:
        print(json.dumps((run_ours if a.worker == "ours" else run_trl)(a)))
        return None

    try:
        import trl
    except ImportError:
        print("TRL is not installed (pip install -r benchmarks/requirements.txt); nothing to compare against.")
        return None
    import platform
    import torch
    import transformers
    with tempfile.TemporaryDirectory() as tmp:
        n_params = build_model(Path(tmp) / "model", a.hidden, a.layers, a.heads)
        runs = {"ours": [], "trl": []}
        for r in range(a.rounds):
            for side in ("ours", "trl"):
                res = run_worker(worker_cmd(a, side, Path(tmp) / "model"))
                runs[side].append(res)
                median = statistics.median(res["step_times"][a.warmup:])
                print(f"round {r + 1}/{a.rounds} {side:4s}: median {median:.3f} s/step, "
                      f"peak RSS {res['peak_rss_mb']:.0f} MB", file=sys.stderr)

    def s_per_step(side):
        return statistics.median(statistics.median(r["step_times"][a.warmup:]) for r in runs[side])

    def rss(side):
        return max(r["peak_rss_mb"] for r in runs[side])

    ours, theirs = s_per_step("ours"), s_per_step("trl")
    result = {
        "ours_s_per_step": round(ours, 4), "trl_s_per_step": round(theirs, 4), "ratio": round(ours / theirs, 3),
        "ours_peak_rss_mb": round(rss("ours"), 1), "trl_peak_rss_mb": round(rss("trl"), 1),
        "model": f"llama hidden {a.hidden}, {a.layers} layers ({n_params / 1e6:.2f} M parameters)",
        "work": f"G={a.group_size}, {a.prompts} prompts/step, {a.tokens} tokens, beta={a.beta}, mu={a.num_iterations}",
        "threads": a.threads, "rounds": a.rounds, "steps_per_round": a.steps, "warmup": a.warmup,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__,
        "transformers": transformers.__version__, "trl": trl.__version__,
    }
    print(f"\n| {result['model']}, {result['work']}, {a.threads} thread(s) | ours | TRL GRPOTrainer | ours / TRL |\n"
          f"|---|---|---|---|\n"
          f"| median s/step | {ours:.3f} | {theirs:.3f} | {ours / theirs:.2f} |\n"
          f"| peak RSS (MB) | {rss('ours'):.0f} | {rss('trl'):.0f} | {rss('ours') / rss('trl'):.2f} |\n")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
