"""
benchmarks/eval_memory.py -- where the held-out evaluation's memory goes, part by part (CPU).

    python benchmarks/eval_memory.py --model <SmolLM2 .gguf or folder> --data <gsm8k dir> \
        --rows 32 --max-new-tokens 320

One greedy batch of `rows` GSM8K test prompts (GSM8K's system prompt, the chat template), decoded
as `train_gsm8k.py eval` decodes them (engine's sampler). It reads this process's RSS (Linux,
/proc/self/status): after the imports (the baseline), after loading the weights, and the peak
while decoding, reset at its start (/proc/self/clear_refs, as benchmarks/memory_parts.py does);
the KV cache's own bytes at the end of decoding; and what `train_gsm8k.py plan` predicts for the
same batch (planner.eval_memory: the weights plus the KV cache, the prefill's temporaries and the
logits). Run it from another checkout to measure that code (it imports the repository it is in).
The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from memory_parts import STATUS, reset_peak, status_mb  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help="a folder with GSM8K's test.jsonl")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=320)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    if not STATUS.exists():
        sys.exit("eval_memory.py reads /proc/self/status: Linux only")
    import torch
    import grpo
    from machinery import engine
    from recipe import checkpoint, gsm8k, planner, tasks
    torch.set_num_threads(a.threads)
    res = {"model": a.model, "rows": a.rows, "max_new_tokens": a.max_new_tokens,
           "baseline_mb": status_mb("VmRSS")}
    model, tok = checkpoint.load_pretrained(a.model)
    model = grpo.disable_dropout(model).eval()
    res["weights_mb"] = status_mb("VmRSS") - res["baseline_mb"]
    rows = gsm8k.load_data(a.data, a.rows, 0)[1]
    prompts = [tasks.gsm8k_prompt(tok, r["question"], gsm8k.GSM8K_SYSTEM_PROMPT) for r in rows]
    caches = []
    model.register_forward_hook(lambda m, args, kw, out: caches.append(
        out["cache"] if "cache" in out else out["past_key_values"]), with_kwargs=True)
    sample = engine.apply(engine.EngineConfig(), grpo.Seams(), grpo.eos_token_ids(model, tok),
                          grpo.pad_token_id(model, tok)).sample
    cfg = grpo.GRPOConfig(max_new_tokens=a.max_new_tokens)
    start = status_mb("VmRSS")
    reset_peak()                                    # NOTE: VmHWM starts again from here
    t = time.perf_counter()
    out = grpo.sample_completions(model, tok, prompts, cfg, greedy=True, group_size=1,
                                  sample=sample)
    res["seconds"] = time.perf_counter() - t
    res["decode_peak_over_weights_mb"] = status_mb("VmHWM") - start
    res["peak_over_baseline_mb"] = status_mb("VmHWM") - res["baseline_mb"]
    layers = caches[-1].layers
    res["kv_cache_mb"] = sum(sum(b.nbytes for b in getattr(x, "buffers", (x.keys, x.values)))
                             for x in layers) / 2**20
    res["prompt_tokens"], res["completion_tokens"] = (out["prompt_ids"].shape[1],
                                                      out["completion_ids"].shape[1])
    s = planner.StepSettings(prompt_tokens=res["prompt_tokens"],
                             max_new_tokens=a.max_new_tokens, eval_batch_size=a.rows)
    shape = planner.model_shape(model.config)
    res["plan_mb"] = planner.step_memory(shape, s)["eval_command"] / 2**20
    res["measured_over_plan"] = res["peak_over_baseline_mb"] / res["plan_mb"] - 1
    print(json.dumps(res))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
