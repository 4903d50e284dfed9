"""
benchmarks/profile_preset.py -- where a preset's step goes, as train_gsm8k.py builds the run (its
model, LoRA, chat template, sampler and batch sizes), beside the floors the hardware allows.

    python benchmarks/profile_preset.py --preset smollm2-135m            # 3 steps, ~5 min, 2 cores
    python benchmarks/profile_preset.py --preset tiny --steps 2 --warmup 1
    python benchmarks/profile_preset.py --preset smollm2-135m -- --compile on   # any train flag
    python benchmarks/profile_preset.py --preset smollm2-135m --ops 12   # + torch.profiler's top

The run is train_gsm8k.setup's, in a temporary folder; its steps are run.step's, timed from outside
by profile_step.instrument (nothing in the code path changes to be measured):
    generation          grpo.sample_completions (the run's sampler)
    no-grad log-probs   the scorer without gradients: π_ref (with LoRA, the base with adapters
                        off) and π_old when μ > 1
    train fwd+bwd       the scorer with gradients, the loss and backward()
    optimizer           AdamW's step and zero_grad
    everything else     the step's wall time minus the above: tokenizing, rewards, advantages,
                        metrics, Python glue
The floors, from the model's config and each step's real lengths: FLOPs (profile_step.step_flops;
LoRA's training pass at 2x a forward, its frozen weights needing no weight gradient) at this
machine's fp32 matmul rate, and the bytes decoding must read (every weight once per decoding
step of each sampling call, 4 bytes each in fp32) at this machine's copy bandwidth. The step's
floor is the scoring and training FLOPs' time plus, for generation, the larger of its FLOP time
and its byte time. One table, then one JSON line; --out writes the JSON to a file too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from profile_step import (PARTS, flops_by_part, instrument, matmul_gflops,  # noqa: E402
                          parts_of, scoring_passes)
from vs_trl import peak_rss_mb  # noqa: E402


def copy_gbs(mb: int = 256, repeats: int = 5) -> float:
    """This machine's memory bandwidth: the best of `repeats` copies of an `mb` MB fp32 tensor,
    counting its bytes read and written, in GB/s. What decoding's weight reads can reach at most."""
    import torch
    a = torch.empty(mb * 2**20 // 4)
    b = torch.empty_like(a)
    b.copy_(a)                                                        # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    return 2 * a.numel() * 4 / best / 1e9


def top_ops(run, step: int, n: int) -> list[dict]:
    """Step `step` of `run` once more under torch.profiler: its `n` costliest operators by CPU time
    spent in them (self time, summed over both threads' work as the profiler counts it), each
    with its calls. The profiler's own overhead slows that step, so only the shares compare."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run.step(step)
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events)
    return [{"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "calls": e.count,
             "share": e.self_cpu_time_total / total} for e in events[:n]]


def profile_preset(preset: str, steps: int, warmup: int, flags: list[str], ops: int = 0) -> dict:
    """Median seconds of each part over `steps` steps of the preset's run after `warmup`, the
    floors, the peak RSS and the run's settings; with ops > 0, one more step's top operators
    (top_ops)."""
    import torch
    import train_gsm8k
    with tempfile.TemporaryDirectory() as tmp:
        configs = train_gsm8k.parse_args(["--preset", preset,
                                          "--steps", str(warmup + steps + (ops > 0)),
                                          "--out", str(Path(tmp) / "run"), *flags])
        run = train_gsm8k.setup(configs)
        spent, lengths = dict.fromkeys(PARTS, 0.0), []
        run.seams, restore = instrument(run.seams, run.optimizer, spent, lengths)
        policy, gcfg, lora = run.policy, run.gcfg, bool(run.tcfg.lora_r)
        weights = sum(p.numel() for p in policy.parameters())
        per_step = {k: [] for k in (*PARTS, "total", "gen_flops", "pass_flops", "decode_steps")}
        try:
            for step in range(1, warmup + steps + 1):
                for k in spent:
                    spent[k] = 0.0
                first = len(lengths)
                t = time.perf_counter()
                run.step(step)
                total = time.perf_counter() - t
                if step <= warmup:
                    continue
                calls = lengths[first:]                   # this step's sampling calls
                P = [p for c in calls for p in c[0]]
                T = [n for c in calls for n in c[1]]
                gen, one_pass = flops_by_part(policy, P, T, gcfg.group_size)
                passes = scoring_passes(gcfg.beta, gcfg.num_iterations, 2 if lora else 3)
                for k, v in {**parts_of(spent, total), "gen_flops": gen,
                             "pass_flops": passes * one_pass,
                             "decode_steps": sum(max(c[1]) for c in calls)}.items():
                    per_step[k].append(v)
        finally:
            restore()
        top = top_ops(run, warmup + steps + 1, ops) if ops else []
    out = {k: statistics.median(v) for k, v in per_step.items()}
    if top:
        out["top_ops"] = top
    gflops, gbs = matmul_gflops(torch.get_num_threads()), copy_gbs()
    gen_flop_s = out["gen_flops"] / (gflops * 1e9)
    gen_byte_s = out["decode_steps"] * weights * 4 / (gbs * 1e9)
    out.update(preset=preset, flags=flags, threads=torch.get_num_threads(),
               matmul_gflops=gflops, copy_gbs=gbs, parameters=weights,
               matmul_gflops_bf16=matmul_gflops(torch.get_num_threads(), dtype=torch.bfloat16),
               trainable=sum(p.numel() for p in policy.parameters() if p.requires_grad),
               gen_floor_flops_s=gen_flop_s, gen_floor_bytes_s=gen_byte_s,
               passes_floor_s=out["pass_flops"] / (gflops * 1e9),
               sampler=run.sampler()["used"], peak_rss_mb=peak_rss_mb(),
               group_size=gcfg.group_size, prompts=run.tcfg.prompts_per_step,
               max_new_tokens=gcfg.max_new_tokens)
    out["floor_s"] = out["passes_floor_s"] + max(gen_flop_s, gen_byte_s)
    out["ratio_to_floor"] = out["total"] / out["floor_s"]
    return out


def print_table(r: dict):
    flags = "".join(f" {f}" for f in r["flags"])
    print(f"\nOne step of --preset {r['preset']}{flags}: {r['prompts']} prompts x "
          f"G = {r['group_size']}, up to {r['max_new_tokens']} tokens, {r['threads']} threads, "
          f"sampler {r['sampler']}; {r['parameters'] / 1e6:.1f} M parameters "
          f"({r['trainable'] / 1e6:.2f} M trained)\n")
    print("| part | median s/step | share | floor (s) |\n|---|---|---|---|")
    gen_floor = max(r["gen_floor_flops_s"], r["gen_floor_bytes_s"])
    floors = {"generation": f"{gen_floor:.2f}", "no-grad log-probs": "", "train fwd+bwd": ""}
    for k in PARTS:
        print(f"| {k} | {r[k]:.2f} | {100 * r[k] / r['total']:.1f}% | {floors.get(k, '')} |")
    print(f"| **total** | {r['total']:.2f} | 100% | {r['floor_s']:.2f} |")
    print(f"\ngeneration: {r['gen_flops'] / 1e12:.2f} TFLOP ({r['gen_floor_flops_s']:.2f} s at "
          f"{r['matmul_gflops']:.0f} GFLOP/s), {r['decode_steps']:.0f} decoding steps reading "
          f"{r['parameters'] * 4 / 1e6:.0f} MB each ({r['gen_floor_bytes_s']:.2f} s at "
          f"{r['copy_gbs']:.1f} GB/s); scoring and training: {r['pass_flops'] / 1e12:.2f} TFLOP "
          f"({r['passes_floor_s']:.2f} s). The step takes {r['ratio_to_floor']:.1f}x its floor. "
          f"bf16 matmuls here: {r['matmul_gflops_bf16']:.0f} GFLOP/s.")
    if r.get("top_ops"):
        print("\nOne more step under torch.profiler, its costliest operators (self CPU time):\n")
        print("| operator | s | share | calls |\n|---|---|---|---|")
        for o in r["top_ops"]:
            print(f"| {o['op']} | {o['self_s']:.2f} | {100 * o['share']:.1f}% | {o['calls']} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="smollm2-135m", help="train_gsm8k.py's preset")
    ap.add_argument("--steps", type=int, default=3, help="measured steps (default 3)")
    ap.add_argument("--warmup", type=int, default=0,
                    help="unmeasured first steps (default 0: a run's first step counts too)")
    ap.add_argument("--ops", type=int, default=0, metavar="N",
                    help="then one more step under torch.profiler: its N costliest operators")
    ap.add_argument("--out", type=Path, help="also write the JSON line here")
    ap.add_argument("flags", nargs="*", help="after --: more train_gsm8k.py flags")
    a = ap.parse_args(argv)
    if a.steps < 1 or a.warmup < 0 or a.ops < 0:
        ap.error("--steps must be at least 1, --warmup and --ops at least 0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    r = profile_preset(a.preset, a.steps, a.warmup, a.flags, a.ops)
    print_table(r)
    print(json.dumps(r))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(r) + "\n")
    return r


if __name__ == "__main__":
    main()
