"""
benchmarks/profile_step.py -- where one grpo_step's time goes, and how it grows with G, length
and size.

    python benchmarks/profile_step.py             # profile: hidden 64, G=4, 2 prompts, 32 tokens
    python benchmarks/profile_step.py --scaling   # scaling over G, completion length and model size

The profile times grpo.py's own functions from outside (nothing in grpo.py changes to be measured):
    generation          sample_completions
    no-grad log-probs   token_logprobs under torch.no_grad (π_old when μ > 1, and π_ref)
    train fwd+bwd       token_logprobs with gradients, the loss and backward()
    optimizer           optimizer.step (AdamW) and zero_grad
    everything else     the step's wall time minus the above: rewards, advantages, metrics,
                        Python glue.
"Everything else" is this project's own overhead.

The floor: the step's arithmetic (step_flops: matmul FLOPs of generation, the reference pass and the
training forward and backward, at each row's real lengths, with causal attention) divided by this
machine's measured matmul throughput (matmul_gflops: a large fp32 matmul at the same thread count).
No implementation can take less time than that; the printed ratio says how far above it we are.

The scaling table runs each setting in a fresh process (so peak RSS is that setting's own), sweeps
all settings --repeats times and takes each row's median over the sweeps, and fits
log(time) against log(G), log(length) and log(parameters), to say which term dominates.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from vs_trl import ARCHS, build_model, peak_rss_mb, rows_for  # noqa: E402

PARTS = ("generation", "no-grad log-probs", "train fwd+bwd", "optimizer", "everything else")


def step_flops(model, prompt_lens, completion_lens, group_size: int, beta: float,
               num_iterations: int, train_passes: float = 3) -> float:
    """Matmul FLOPs of one grpo_step on these rows (real lengths, no padding), counted as 2 per
    multiply-add: generation (one prefill per prompt, then one token at a time over the growing
    context), the no-grad passes (π_ref when β != 0, π_old when μ > 1) and μ training passes at 3x a
    forward (backward is two matmuls per forward matmul), each scoring a prompt once and its G
    completions after it. Per token, a forward costs 2 x the
    Linear weights it passes through, plus causal attention's QK^T and AV: 4 x layers x
    (heads x head_dim) x the context length. Every position passes through the transformer body;
    only the positions read pass through lm_head. train_passes: 2 with LoRA, whose frozen weights
    need no weight gradient (the adapters' are counted as their own Linear layers)."""
    gen, full = flops_by_part(model, prompt_lens, completion_lens, group_size)
    return gen + scoring_passes(beta, num_iterations, train_passes) * full


def scoring_passes(beta: float, num_iterations: int, train_passes: float = 3) -> float:
    """How many forward passes' worth of scoring a step runs: π_ref's (β != 0), π_old's (μ > 1)
    and μ training passes at `train_passes` forwards each."""
    return (beta != 0) + (num_iterations > 1) + train_passes * num_iterations


def flops_by_part(model, prompt_lens, completion_lens, group_size: int) -> tuple[float, float]:
    """(generation's FLOPs, one scoring pass's FLOPs) of these rows, as step_flops counts them."""
    import torch
    head = model.get_output_embeddings()
    body = sum(m.weight.numel() for m in model.modules()
               if isinstance(m, torch.nn.Linear) and m is not head)
    lm, c = head.weight.numel(), model.config
    width = c.num_attention_heads * (getattr(c, "head_dim", None)
                                     or c.hidden_size // c.num_attention_heads)
    attn = 4 * c.num_hidden_layers * width                      # per token, per context position

    def forward(lengths, logits_for):  # a causal pass over sequences of these lengths
        return sum(2 * body * S + 2 * lm * k + attn * S * (S + 1) / 2
                   for S, k in zip(lengths, logits_for))

    firsts = prompt_lens[::group_size]                            # each distinct prompt's length
    flops = forward(firsts, [1] * len(firsts))                    # prefill
    for P, T in zip(prompt_lens, completion_lens):                # decode: T - 1 more tokens
        flops += sum(2 * (body + lm) + attn * (P + t) for t in range(1, T))
    # NOTE: a scoring pass runs each distinct prompt once and each completion after it (the least
    #       work, and what EngineConfig.share_prompts does): T positions, contexts P+1 .. P+T.
    full = forward(firsts, [0] * len(firsts)) + sum(
        2 * (body + lm) * T + attn * (P * T + T * (T + 1) / 2)
        for P, T in zip(prompt_lens, completion_lens))
    return flops, full


def matmul_gflops(threads: int, n: int = 1024, repeats: int = 5, dtype=None) -> float:
    """This machine's fp32 (or `dtype`'s) matmul throughput at `threads` threads: the best of
    `repeats` (n x n) @ (n x n) products, in GFLOP/s. An upper bound on what the model's smaller
    matmuls reach."""
    import torch
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b                                                           # warm-up
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n ** 3 / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def parts_of(spent: dict, total: float) -> dict:
    """A step's seconds by part (PARTS), from what instrument timed and the step's wall time:
    everything else is the rest, and the total."""
    timed = {k: spent[k] for k in PARTS[:-1]}
    return {**timed, "everything else": total - sum(timed.values()), "total": total}


def instrument(seams, opt, spent: dict, lengths: list):
    """Time grpo.py's own functions from outside, adding each call's seconds to spent[part]:
    sample_completions (generation; each batch's real prompt and output lengths appended to
    `lengths`), the seams' scorer (no-grad log-probs without gradients, train fwd+bwd with them),
    grpo_loss and Tensor.backward (train fwd+bwd), and opt.step and zero_grad (optimizer).
    Returns (the seams with the timed scorer, a function that undoes the module patches)."""
    import torch
    import grpo

    def timed(part, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                key = part(*args) if callable(part) else part
                spent[key] += time.perf_counter() - t
        return wrapper

    real_sample, real_loss = grpo.sample_completions, grpo.grpo_loss
    real_backward = torch.Tensor.backward

    def sample_and_count(*args, **kwargs):  # also keeps each row's real prompt and output length
        batch = real_sample(*args, **kwargs)
        lengths.append((batch["prompt_mask"].sum(1).tolist(),
                        batch["completion_mask"].sum(1).tolist()))
        return batch

    grpo.sample_completions = timed("generation", sample_and_count)
    seams = dataclasses.replace(seams, score=timed(
        lambda *a: "train fwd+bwd" if torch.is_grad_enabled() else "no-grad log-probs",
        seams.score or grpo.token_logprobs))
    grpo.grpo_loss = timed("train fwd+bwd", real_loss)
    opt.step = timed("optimizer", opt.step)
    opt.zero_grad = timed("optimizer", opt.zero_grad)
    # backward() is called on the loss inside grpo_step; time it by wrapping Tensor.backward.
    torch.Tensor.backward = timed("train fwd+bwd", real_backward)

    def restore():
        grpo.sample_completions, grpo.grpo_loss = real_sample, real_loss
        torch.Tensor.backward = real_backward
    return seams, restore


def profile(model_dir: str, group_size: int, prompts: int, tokens: int, steps: int, warmup: int,
            threads: int, beta: float = 0.04, num_iterations: int = 1,
            sampler: str = "compiled") -> dict:
    """Median seconds per step for each part, over `steps` steps after `warmup`, plus the peak
    RSS."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from machinery import engine
    import grpo
    import rewards
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    policy = grpo.disable_dropout(AutoModelForCausalLM.from_pretrained(model_dir,
                                                                       dtype=torch.float32))
    cfg = grpo.GRPOConfig(group_size=group_size, max_new_tokens=tokens, beta=beta,
                          num_iterations=num_iterations, lr=1e-4,
                          micro_batch_size=prompts * group_size)
    ecfg = engine.EngineConfig(sampler=sampler, min_new_tokens=tokens)
    seams = engine.apply(ecfg, grpo.Seams(), grpo.eos_token_ids(policy, tok),
                         grpo.pad_token_id(policy, tok))   # as train_gsm8k.py applies it
    ref = grpo.make_reference(policy) if beta else None
    engine.compile_layers(ecfg, False, policy, ref)  # --compile on: as train_gsm8k.py does it
    opt = grpo.make_optimizer(policy, cfg)

    spent, lengths = dict.fromkeys(PARTS, 0.0), []
    seams, restore = instrument(seams, opt, spent, lengths)
    rows = rows_for((warmup + steps) * prompts)
    per_step = {k: [] for k in (*PARTS, "total", "flops")}
    try:
        for step in range(warmup + steps):
            for k in spent:
                spent[k] = 0.0
            batch = rows[step * prompts:(step + 1) * prompts]
            t = time.perf_counter()
            grpo.grpo_step(policy, ref, opt, tok, [r["prompt"] for r in batch],
                           [rewards.correctness_reward], cfg,
                           columns={"answer": [r["answer"] for r in batch]}, seams=seams)
            total = time.perf_counter() - t
            if step >= warmup:
                for k, v in parts_of(spent, total).items():
                    per_step[k].append(v)
                per_step["flops"].append(step_flops(policy, *lengths[-1], group_size, beta,
                                                    num_iterations))
    finally:
        restore()
    out = {k: statistics.median(v) for k, v in per_step.items()}
    out["peak_rss_mb"] = peak_rss_mb()
    out["matmul_gflops"] = matmul_gflops(threads)
    out["floor_s"] = out["flops"] / (out["matmul_gflops"] * 1e9)
    out["ratio_to_floor"] = out["total"] / out["floor_s"]
    out["sampler"] = sampler
    out["parameters"] = sum(p.numel() for p in policy.parameters())
    return out


def print_profile(res: dict, title: str):
    print(f"\n{title}\n\n| part | median s/step | share |\n|---|---|---|")
    for k in PARTS:
        print(f"| {k} | {res[k]:.4f} | {100 * res[k] / res['total']:.1f}% |")
    print(f"| **total** | {res['total']:.4f} | 100% |")
    print(f"\nfloor: {res['flops'] / 1e9:.2f} GFLOP a step at {res['matmul_gflops']:.0f} GFLOP/s "
          f"(this machine's fp32 matmul) = {res['floor_s']:.4f} s; this step takes "
          f"{res['ratio_to_floor']:.1f}x the floor; our own overhead (everything else) is "
          f"{100 * res['everything else'] / res['total']:.1f}% of it")


def fit_exponents(rows: list[dict]) -> dict:
    """Least squares log t = c + a·log G + b·log T + g·log params. Returns {"G": a, "tokens": b,
    "params": g}."""
    import math
    import torch
    X = torch.tensor([[1.0,
                       *(math.log(r[k]) for k in ("group_size", "tokens",
                                                  "parameters"))] for r in rows],
                     dtype=torch.float64)                                        # (rows, 4)
    y = torch.tensor([[math.log(r["total"])] for r in rows], dtype=torch.float64)  # (rows, 1)
    coef = torch.linalg.lstsq(X, y).solution.flatten().tolist()
    return {"G": coef[1], "tokens": coef[2], "params": coef[3]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--arch", choices=ARCHS, default="llama",
                   help="llama sized by --hidden/--layers (default), or a real model's "
                        "architecture, random weights")
    p.add_argument("--hidden", type=int, default=64,
                   help="model width for the profile (default 64)")
    p.add_argument("--layers", type=int, default=2,
                   help="transformer blocks for the profile (default 2)")
    p.add_argument("--group-size", type=int, default=4,
                   help="G, completions per prompt (default 4)")
    p.add_argument("--prompts", type=int, default=2, help="prompts per step (default 2)")
    p.add_argument("--tokens", type=int, default=32, help="completion length, forced (default 32)")
    p.add_argument("--steps", type=int, default=10, help="measured steps (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured first steps (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--scaling", action="store_true",
                   help="the scaling table instead of one profile")
    p.add_argument("--repeats", type=int, default=3,
                   help="--scaling: sweeps over all settings (default 3)")
    p.add_argument("--compile", choices=["on", "off"], default="on",
                   help="decode with engine.decode_compiled (on, default) or engine.decode (off)")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # a model dir: profile once, print JSON
    a = p.parse_args(argv)
    import grpo
    try:  # the worker's config, built once here so a bad value is GRPOConfig's one-line error
        grpo.GRPOConfig(group_size=a.group_size, max_new_tokens=a.tokens)
    except ValueError as e:
        p.error(str(e))
    if a.steps < 1 or a.warmup < 0 or a.repeats < 1:
        p.error("--steps and --repeats must be at least 1, --warmup at least 0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from machinery import engine
    sampler = engine.sampler_for(a.compile, "engine", 0)  # on: 'compiled', off: 'engine'

    if a.worker:
        print(json.dumps(profile(a.worker, a.group_size, a.prompts, a.tokens, a.steps, a.warmup,
                                 a.threads, sampler=sampler)))
        return None
    if not a.scaling:
        with tempfile.TemporaryDirectory() as tmp:
            build_model(Path(tmp), a.hidden, a.layers, 4, a.arch)
            with contextlib.redirect_stdout(sys.stderr):
                res = profile(tmp, a.group_size, a.prompts, a.tokens, a.steps, a.warmup, a.threads,
                              sampler=sampler)
        model = (f"llama hidden {a.hidden} x {a.layers} layers" if a.arch == "llama"
                 else f"{a.arch} architecture")
        print_profile(res, f"One grpo_step, {model} "
                           f"({res['parameters'] / 1e6:.2f} M), G={a.group_size}, "
                           f"{a.prompts} prompts, "
                           f"{a.tokens} tokens, {a.threads} thread(s), median of {a.steps} steps, "
                           f"decoding compiled {a.compile}")
        print(json.dumps(res))
        return res

    # Scaling: vary one thing at a time around the base setting.
    sizes = [(64, 2), (128, 4), (256, 4)]
    settings = ([(a.group_size * m, a.tokens, sizes[0]) for m in (1, 2, 4)]
                + [(a.group_size, a.tokens * m, sizes[0]) for m in (2, 4)]
                + [(a.group_size, a.tokens, s) for s in sizes[1:]])
    # WHY: a shared machine's speed drifts by tens of percent over minutes. Sweeping every setting
    #      once per repeat and taking each row's median over repeats spreads a slow spell over all
    #      rows instead of a few.
    runs = [[] for _ in settings]
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.repeats):
            for i, (G, T, (hidden, layers)) in enumerate(settings):
                model_dir = Path(tmp) / f"h{hidden}l{layers}"
                if not model_dir.exists():
                    build_model(model_dir, hidden, layers, 4)
                cmd = [sys.executable, __file__, "--worker", str(model_dir), "--group-size", str(G),
                       "--prompts",
                       str(a.prompts), "--tokens", str(T), "--steps", str(a.steps), "--warmup",
                       str(a.warmup),
                       "--threads", str(a.threads), "--compile", a.compile]
                env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
                if proc.returncode != 0:
                    raise SystemExit(f"error: setting G={G} T={T} h={hidden} failed:\n"
                                     f"{proc.stderr[-2000:]}")
                runs[i].append(json.loads(proc.stdout.strip().splitlines()[-1]))
                print(f"repeat {rep + 1}/{a.repeats} G={G} T={T} hidden={hidden}x{layers}: "
                      f"{runs[i][-1]['total']:.3f} s/step", file=sys.stderr)
    rows = [{"group_size": G, "tokens": T, "hidden": hidden, "layers": layers,
             **{k: statistics.median(r[k] for r in reps) for k in (*PARTS, "total")},
             "peak_rss_mb": max(r["peak_rss_mb"] for r in reps),
             "parameters": reps[0]["parameters"]}
            for (G, T, (hidden, layers)), reps in zip(settings, runs)]
    print(f"\nScaling, {a.prompts} prompts/step, {a.threads} thread(s), median of {a.steps} steps, "
          f"then the median over {a.repeats} sweeps\n")
    print("| G | tokens | model (params) | s/step | generation | train fwd+bwd | other parts "
          "| peak RSS (MB) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        rest = r["no-grad log-probs"] + r["optimizer"] + r["everything else"]
        print(f"| {r['group_size']} | {r['tokens']} | "
              f"{r['hidden']}x{r['layers']} ({r['parameters'] / 1e6:.2f} M) | "
              f"{r['total']:.3f} | {100 * r['generation'] / r['total']:.0f}% | "
              f"{100 * r['train fwd+bwd'] / r['total']:.0f}% | {100 * rest / r['total']:.0f}% | "
              f"{r['peak_rss_mb']:.0f} |")
    exps = fit_exponents(rows)
    print(f"\nFit: s/step ∝ G^{exps['G']:.2f} · tokens^{exps['tokens']:.2f} · "
          f"params^{exps['params']:.2f}")
    print(json.dumps({"rows": rows, "exponents": exps}))
    return rows, exps


if __name__ == "__main__":
    main()
