"""
benchmarks/memory_parts.py -- where one grpo_step's peak memory comes from, part by part (CPU).

    python benchmarks/memory_parts.py                        # hidden-64 Llama, G=4, 2 prompts
    python benchmarks/memory_parts.py --arch qwen2.5-0.5b --threads 2    # Qwen2.5-0.5B's arch
    python benchmarks/memory_parts.py --arch qwen2.5-0.5b --threads 2 --gradient-checkpointing
    python benchmarks/memory_parts.py --arch qwen2.5-0.5b --threads 2 --logprob-chunk 512
    python benchmarks/memory_parts.py --arch qwen2.5-0.5b --threads 2 --lora-r 16

It builds the model as benchmarks/vs_trl.py does (random weights, the same settings: forced
completion length, micro-batch = the whole step, fp32), then measures in this one process:
    persistent memory, read after each thing is made: the process after its imports, the policy's
    weights, the frozen reference, AdamW's state (made by the first optimizer step);
    each phase's own peak within step 2 (AdamW's state then exists), over the RSS the step started
    at: sampling, the reference pass (no grad), the training forward, backward, the optimizer step.
The peaks are exact, not sampled: Linux resets a process's high-water mark (VmHWM) when "5" is
written to /proc/self/clear_refs, so each phase starts from its own starting RSS and VmHWM at its
end is the highest that phase reached. Nothing in grpo.py changes to be measured: its functions
are wrapped from outside, as benchmarks/profile_step.py does for time.

The last line printed is JSON: {"baseline_mb", "weights_mb", "reference_mb", "optimizer_mb",
"step_start_mb", "phases": {phase: peak over step start, MB}, "peak_mb", "peak_over_baseline_mb",
"peak_phase", ...}.
Linux only (it reads /proc/self); elsewhere it says so and exits 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from vs_trl import ARCHS, build_model, rows_for  # noqa: E402

PHASES = ("sampling", "reference log-probs", "training forward", "backward", "optimizer step")
STATUS = Path("/proc/self/status")


def status_mb(field: str) -> float:
    """VmRSS (now) or VmHWM (the high-water mark since the last reset) of this process, in MB."""
    return int(re.search(rf"{field}:\s+(\d+) kB", STATUS.read_text()).group(1)) / 1024


def reset_peak():
    """Start a new high-water mark at the current RSS (Linux >= 4.0, /proc/self/clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def measure(model_dir: str, group_size: int, prompts: int, tokens: int, threads: int,
            beta: float = 0.04, gradient_checkpointing: bool = False, logprob_chunk: int = 0,
            lora_r: int = 0, baseline: str = "group", update_in_backward: bool = False,
            lean_activations: bool = False, share_prompts: bool = True,
            return_freed_memory: bool = False) -> dict:
    """Persistent memory by part and each phase's peak in step 2 of grpo_step, in MB.
    baseline='critic': PPO's step (ppo.Critic) instead, with its value model and AdamW state.
    update_in_backward: AdamW steps inside backward (memory.step_in_backward), which is then one
    phase with it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from machinery import engine
    import grpo
    from machinery import lora
    from machinery import memory
    from compare import ppo
    import rewards
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    if lora_r:
        lora.peft_module()  # WHY: imported before the baseline, so its modules are not "weights"
    out = {"baseline_mb": status_mb("VmRSS")}
    policy = grpo.disable_dropout(AutoModelForCausalLM.from_pretrained(model_dir,
                                                                       dtype=torch.float32))
    if lora_r:  # as train_gsm8k.py --lora-r does it
        policy = lora.add_adapters(policy, lora_r, 2 * lora_r)
    # The machinery, applied from outside grpo.py as train_gsm8k.py applies it.
    mcfg = memory.MemoryConfig(logprob_chunk=logprob_chunk, update_in_backward=update_in_backward,
                               gradient_checkpointing=gradient_checkpointing,
                               lean_activations=lean_activations)
    engine.enable_activation_checkpointing(policy, gradient_checkpointing)
    memory.lean_activations(policy.train(), lean_activations)
    if return_freed_memory:  # NOTE: process-wide; only by its own flag, as train_gsm8k.py
        memory.return_freed_memory()
    out["weights_mb"] = status_mb("VmRSS") - out["baseline_mb"]
    cfg = grpo.GRPOConfig(group_size=group_size, max_new_tokens=tokens, beta=beta, lr=1e-4,
                          micro_batch_size=prompts * group_size)
    seams = memory.apply(mcfg, engine.apply(
        engine.EngineConfig(share_prompts=share_prompts, min_new_tokens=tokens), grpo.Seams(),
        grpo.eos_token_ids(policy, tok), grpo.pad_token_id(policy, tok)))
    before = status_mb("VmRSS")
    ref = (None if not beta else lora.AdaptersOff(policy) if lora_r
           else grpo.make_reference(policy))
    out["reference_mb"] = status_mb("VmRSS") - before
    opt = grpo.make_optimizer(policy, cfg)
    before_critic = status_mb("VmRSS")
    critic = ppo.Critic(policy, cfg) if baseline == "critic" else None
    out["critic_mb"] = status_mb("VmRSS") - before_critic
    step_fn = critic or grpo.grpo_step

    peaks, start = {}, [0.0]

    def phase(name, fn):
        def wrapper(*args, **kwargs):
            if name == "training forward" and not torch.is_grad_enabled():
                return fn(*args, **kwargs)  # the reference pass, measured as a whole
            reset_peak()
            try:
                return fn(*args, **kwargs)
            finally:
                peaks[name] = max(peaks.get(name, 0.0), status_mb("VmHWM") - start[0])
        return wrapper

    real = (grpo.sample_completions, grpo.fixed_logprobs, torch.Tensor.backward)
    grpo.sample_completions = phase("sampling", real[0])
    grpo.fixed_logprobs = phase("reference log-probs", real[1])
    seams = replace(seams, score=phase("training forward", seams.score or grpo.token_logprobs))
    torch.Tensor.backward = phase("backward", real[2])
    if not update_in_backward:  # WHY: inside backward, a phase of its own would reset its peak
        opt.step = phase("optimizer step", opt.step)
    if critic:  # PPO: the value model's own AdamW step
        critic.optimizer.step = phase("optimizer step", critic.optimizer.step)
    rows = rows_for(2 * prompts)
    try:
        for step in range(2):
            if step == 1:  # step 2: AdamW's state exists, so this is the steady state
                out["optimizer_mb"] = (status_mb("VmRSS") - before - out["reference_mb"]
                                       - out["critic_mb"])
                peaks.clear()
            start[0] = status_mb("VmRSS")
            batch = rows[step * prompts:(step + 1) * prompts]
            step_fn(policy, ref, opt, tok, [r["prompt"] for r in batch],
                    [rewards.correctness_reward], cfg,
                    columns={"answer": [r["answer"] for r in batch]}, seams=seams)
    finally:
        grpo.sample_completions, grpo.fixed_logprobs, torch.Tensor.backward = real
    out["step_start_mb"] = start[0] - out["baseline_mb"]
    out["phases"] = {k: peaks.get(k, 0.0) for k in PHASES}
    out["peak_phase"] = max(out["phases"], key=out["phases"].get)
    out["peak_over_baseline_mb"] = out["step_start_mb"] + out["phases"][out["peak_phase"]]
    out["peak_mb"] = out["baseline_mb"] + out["peak_over_baseline_mb"]
    out["trainable"], out["parameters"] = lora.trainable_share(policy)
    out.update(gradient_checkpointing=gradient_checkpointing, logprob_chunk=logprob_chunk,
               lora_r=lora_r, baseline=baseline, update_in_backward=update_in_backward,
               lean_activations=lean_activations)
    # The planner's prediction for the same step (planner.py), from the config alone
    from recipe import planner
    prompt_tokens = planner.prompt_tokens_of(tok, [r["prompt"] for r in rows[prompts:]])  # step 2
    settings = planner.settings_of(cfg, prompt_tokens, prompts_per_step=prompts,
                                   gradient_checkpointing=gradient_checkpointing, lora_r=lora_r,
                                   update_in_backward=update_in_backward,
                                   lean_activations=lean_activations, logprob_chunk=logprob_chunk,
                                   share_prompts=share_prompts)
    plan = planner.step_memory(planner.model_shape(engine.base_model(policy).config), settings,
                               critic=critic is not None)
    # WHY the allowance: on a CPU the plan is the tensors plus planner.CPU_RUNTIME, the runtime's
    #     own memory; --plan-check and `plan` add it too, so every line compares one plan
    planned = (plan["peak"] + planner.CPU_RUNTIME) / 2**20
    out.update(planned_peak_mb=plan["peak"] / 2**20, planned_phase=plan["peak_phase"],
               planned_with_runtime_mb=planned,
               plan_error=out["peak_over_baseline_mb"] / planned - 1)
    return out


def print_parts(res: dict, title: str):
    mb = res["parameters"] * 4 / 2**20  # one fp32 copy of the parameters
    tr = res["trainable"] * 4 / 2**20  # of the trainable ones: gradients, each AdamW moment
    rows = [("process after imports (torch, transformers)", res["baseline_mb"], ""),
            ("policy weights", res["weights_mb"], f"fp32 parameters: {mb:.0f}"),
            ("frozen reference (a copy; none with LoRA)", res["reference_mb"],
             "0" if res["lora_r"] else f"{mb:.0f}"),
            ("AdamW state (exp_avg, exp_avg_sq)", res["optimizer_mb"], f"{2 * tr:.0f}")]
    if res.get("baseline") == "critic":
        rows.insert(3, ("PPO's value model (backbone + scalar head)", res["critic_mb"],
                        "the policy's, less its output layer"))
    print(f"\n{title}\n\n| part | MB | for comparison (MB) |\n|---|---|---|")
    for name, v, note in rows:
        print(f"| {name} | {v:,.0f} | {note} |")
    print(f"| **step 2 starts at (over the imports)** | {res['step_start_mb']:,.0f} | |")
    for name, v in res["phases"].items():
        note = f"gradients alone: {tr:.0f}" if name == "backward" else ""
        print(f"| peak of {name}, over step start | +{v:,.0f} | {note} |")
    print(f"| **peak ({res['peak_phase']})** | {res['peak_mb']:,.0f} | "
          f"{res['peak_over_baseline_mb']:,.0f} over the imports |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--arch", choices=ARCHS, default="llama",
                   help="llama sized by --hidden/--layers (default), or a real model's "
                        "architecture, random weights")
    p.add_argument("--hidden", type=int, default=64, help="llama width (default 64)")
    p.add_argument("--layers", type=int, default=2, help="llama blocks (default 2)")
    p.add_argument("--vocab", type=int, default=0,
                   help="llama vocabulary rows (default 0: the character tokenizer's)")
    p.add_argument("--group-size", type=int, default=4, help="G (default 4)")
    p.add_argument("--prompts", type=int, default=2, help="prompts per step (default 2)")
    p.add_argument("--tokens", type=int, default=64,
                   help="completion length, forced (default 64)")
    p.add_argument("--beta", type=float, default=0.04,
                   help="KL weight; 0: no reference (default 0.04)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute activations in backward, as train_gsm8k.py's flag does")
    p.add_argument("--logprob-chunk", type=int, default=0,
                   help="score log-probs this many tokens at a time (memory.py; default 0: off)")
    p.add_argument("--lora-r", type=int, default=0,
                   help="LoRA rank, alpha 2r, all linear layers (lora.py; default 0: off)")
    p.add_argument("--baseline", choices=["group", "critic"], default="group",
                   help="'critic': PPO's step with its value model (ppo.py) instead of GRPO's")
    p.add_argument("--update-in-backward", action="store_true",
                   help="AdamW steps each weight inside backward (memory.step_in_backward)")
    p.add_argument("--return-freed-memory", action="store_true",
                   help="glibc gives freed blocks of 1 MB or more back at once "
                        "(memory.return_freed_memory, process-wide; pairs with "
                        "--update-in-backward)")
    p.add_argument("--lean-activations", action="store_true",
                   help="SwiGLU MLPs and RMSNorms keep fewer activations for backward "
                        "(memory.lean_activations)")
    p.add_argument("--no-share-prompts", dest="share_prompts", action="store_false",
                   help="score G whole sequences per prompt, not each prompt once "
                        "(EngineConfig.share_prompts)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--plan-check", metavar="SIZES",
                   help="measure planner.py's prediction against these sizes (comma-separated "
                        f"names from {', '.join(SIZES)}, or 'all'), each full, LoRA r 16, "
                        "log-prob chunk 64, checkpointed, PPO + critic, stepped in backward and "
                        "lean activations; "
                        "exit 1 if one is off by > 15%%")
    p.add_argument("--measure-runtime", action="store_true",
                   help="measure the runtime's own memory, which no tensor holds, on a 0.1 M-"
                        "parameter model (what planner.CPU_RUNTIME was set from)")
    p.add_argument("--jobs", type=int, default=1,
                   help="--plan-check: cases measured at once, each in its own process with its "
                        "own memory (default 1; 2 halves the time at small sizes)")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # a model dir: measure once, print JSON
    a = p.parse_args(argv)
    if not STATUS.exists():
        p.error("this benchmark reads /proc/self (Linux only)")
    if min(a.group_size, a.prompts, a.tokens, a.threads, a.hidden, a.layers, a.jobs) < 1:
        p.error("--group-size, --prompts, --tokens, --threads, --hidden, --layers, --jobs must "
                "be >= 1")
    if min(a.logprob_chunk, a.lora_r) < 0:
        p.error("--logprob-chunk and --lora-r must be >= 0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if a.measure_runtime:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "1048576"  # WHY: as --plan-check measures
        from importlib.metadata import version

        from recipe import planner
        mb = measure_runtime(a.threads)
        print(json.dumps({"runtime_mb": mb, "planner_cpu_runtime_mb": planner.CPU_RUNTIME / 2**20,
                          "threads": a.threads, "torch": version("torch")}))
        return mb
    if a.plan_check:
        return plan_check(a.plan_check, a.threads, a.jobs)
    if a.worker:
        with contextlib.redirect_stdout(sys.stderr):
            res = measure(a.worker, a.group_size, a.prompts, a.tokens, a.threads, a.beta,
                          a.gradient_checkpointing, a.logprob_chunk, a.lora_r, a.baseline,
                          a.update_in_backward, a.lean_activations, a.share_prompts,
                          a.return_freed_memory)
        print(json.dumps(res))
        return res
    # WHY a fresh process: building the model here leaves freed memory behind in this one, which
    #      would blur the baseline; the worker only loads the saved model, as a user's run does.
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp), a.hidden, a.layers, 4, a.arch, a.vocab)
        cmd = [sys.executable, __file__, "--worker", tmp, *(argv if argv is not None
                                                               else sys.argv[1:])]
        env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"error: the measuring worker failed (exit {proc.returncode})")
        res = json.loads(proc.stdout.strip().splitlines()[-1])
    model = (f"llama hidden {a.hidden} x {a.layers} layers" if a.arch == "llama"
             else f"{a.arch} architecture")
    step = "PPO step (ppo.Critic)" if a.baseline == "critic" else "grpo_step"
    print_parts(res, f"Memory of one {step}, {model} ({res['parameters'] / 1e6:.1f} M), "
                     f"G={a.group_size}, {a.prompts} prompts, {a.tokens} tokens, fp32, "
                     f"gradient checkpointing {'on' if a.gradient_checkpointing else 'off'}, "
                     f"log-prob chunk {a.logprob_chunk or 'off'}, LoRA r {a.lora_r or 'off'}"
                     + (", lean activations" if a.lean_activations else "")
                     + ("" if a.share_prompts else ", each prompt scored G times"))
    print(f"planner.py's prediction: {res['planned_peak_mb']:,.0f} MB of tensors "
          f"({res['planned_phase']}) + the runtime's allowance = "
          f"{res['planned_with_runtime_mb']:,.0f} MB over the imports; measured "
          f"{res['peak_over_baseline_mb']:,.0f} ({res['plan_error']:+.1%})")
    print(json.dumps(res))
    return res


SIZES = {  # name: this script's flags for it
    "llama-h256": ["--hidden", "256", "--layers", "4", "--vocab", "32000"],
    "llama-h1024": ["--hidden", "1024", "--layers", "8", "--vocab", "32000"],
    "qwen2.5-0.5b": ["--arch", "qwen2.5-0.5b"],
}
VARIANTS = {"full": [], "LoRA r 16": ["--lora-r", "16"], "chunk 64": ["--logprob-chunk", "64"],
            "checkpointed": ["--gradient-checkpointing"],
            "PPO + critic": ["--baseline", "critic"],
            "stepped in backward": ["--update-in-backward"],
            "lean activations": ["--lean-activations"]}


def measure_runtime(threads: int) -> float:
    """MB of the runtime's own memory, which no tensor holds (the code that from_pretrained and the
    first optimizer step load, autograd's threads): a 0.1 M-parameter model's measured peak over
    the imports less its planned tensors, which are a few MB. planner.CPU_RUNTIME is this, measured
    once on the reference machine; --plan-check measures it again to show whether it still holds."""
    with contextlib.redirect_stdout(sys.stderr):
        tiny = main(["--threads", str(threads)])
    return tiny["peak_over_baseline_mb"] - tiny["planned_peak_mb"]


def plan_check(sizes: str, threads: int, jobs: int = 1) -> list[dict]:
    """Each size x variant measured (a fresh worker each) against planner.py's prediction; a
    table, one JSON line, exit 1 if any is off by more than 15%. jobs: workers measuring at once.
    WHY MALLOC_MMAP_THRESHOLD_: glibc keeps freed blocks under 32 MB for reuse, so RSS keeps
    memory no tensor holds (docs/memory.md); with blocks over 1 MB given back when freed, RSS
    follows the live tensors, which is what the planner predicts (and what
    torch.cuda.max_memory_allocated measures on a GPU)."""
    names = list(SIZES) if sizes == "all" else [n.strip() for n in sizes.split(",")]
    unknown = [n for n in names if n not in SIZES]
    if unknown:
        raise SystemExit(f"error: --plan-check: unknown size {unknown[0]!r} "
                         f"(known: {', '.join(SIZES)})")
    from recipe import planner
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "1048576"
    allowance_mb = planner.CPU_RUNTIME / 2**20
    measured_now = measure_runtime(threads)
    variants = dict(VARIANTS)
    skipped = []
    if importlib.util.find_spec("peft") is None:  # NOTE: LoRA is optional (requirements-dev.txt)
        del variants["LoRA r 16"]
        skipped.append("LoRA r 16: peft is not installed")
        print("--plan-check: LoRA r 16 skipped, peft is not installed", file=sys.stderr)
    cases = [(name, variant, [*SIZES[name], *extra, "--threads", str(threads)])
             for name in names for variant, extra in variants.items()]
    # WHY threads are enough: each case measures in its own worker process, which is what runs in
    #     parallel; each worker's peak is its own RSS, so two at once do not blur each other.
    with contextlib.redirect_stdout(sys.stderr), ThreadPoolExecutor(jobs) as pool:
        results = list(pool.map(lambda case: main(case[2]), cases))
    rows = []
    for (name, variant, _), res in zip(cases, results):
        tensors, measured = res["planned_peak_mb"], res["peak_over_baseline_mb"]
        # NOTE: each worker's plan already holds the allowance (measure): one plan, one error
        rows.append({"size": name, "variant": variant, "parameters": res["parameters"],
                     "measured_mb": measured, "planned_tensors_mb": tensors,
                     "planned_mb": res["planned_with_runtime_mb"], "error": res["plan_error"],
                     "error_without_allowance": measured / tensors - 1})
    print(f"the plan: the tensors' peak plus planner.CPU_RUNTIME, a fixed {allowance_mb:.0f} MB "
          f"(measured in this run: {measured_now:.0f} MB)\n\n| size | variant | measured MB (over "
          f"the imports) | planned MB | off by | planned without the allowance | off by |\n"
          f"|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']} ({r['parameters'] / 1e6:.1f} M) | {r['variant']} | "
              f"{r['measured_mb']:,.0f} | {r['planned_mb']:,.0f} | {r['error']:+.1%} | "
              f"{r['planned_tensors_mb']:,.0f} | {r['error_without_allowance']:+.1%} |")
    worst = max(abs(r["error"]) for r in rows)
    print(json.dumps({"plan_check": rows, "skipped": skipped, "runtime_allowance_mb": allowance_mb,
                      "runtime_measured_now_mb": measured_now, "max_abs_error": worst,
                      "error_range": [min(r["error"] for r in rows),
                                      max(r["error"] for r in rows)],
                      "error_range_without_allowance": [
                          min(r["error_without_allowance"] for r in rows),
                          max(r["error_without_allowance"] for r in rows)],
                      "within_15pct": worst <= 0.15}))
    if worst > 0.15:
        raise SystemExit(1)
    return rows


if __name__ == "__main__":
    main()
