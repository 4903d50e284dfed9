"""
benchmarks/compiled_decode_depth.py -- compiled against eager decoding at SmolLM2-135M's depth (30
layers, random weights) on this machine's CPU, three sampling calls each, with the graphs dynamo
compiled in each call; TORCH_LOGS=recompiles,graph_breaks says why it recompiled.

    TORCH_LOGS=recompiles,graph_breaks python benchmarks/compiled_decode_depth.py > out.json

Each call samples G=4 completions of 64 forced tokens for 2 prompts (vs_trl.py's SmolLM2 work),
the prompts changing from call to call as a run's do. What it showed (docs/speed.md): the 1.46 of
TRL's time measured for compiled decoding at this depth came from a recompile inside the measured
steps, when a prompt wider than the first 64-slot bucket grew the static cache.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpu_check import compile_counts, counted_since, random_model, sampler_of  # noqa: E402
from vs_trl import rows_for  # noqa: E402


def main():
    import torch
    import grpo
    torch.set_num_threads(2)
    _, tok, model = random_model("cpu", "smollm2-135m")
    rows = rows_for(6)
    cfg = grpo.GRPOConfig(group_size=4, max_new_tokens=64)
    calls = []
    for name in ("engine", "compiled"):
        sample = sampler_of(name, model, tok, 64)
        for call in range(3):
            texts = [r["prompt"] for r in rows[2 * call:2 * call + 2]]
            enc = tok(texts, add_special_tokens=False)["input_ids"]
            torch.manual_seed(0)
            start, t = compile_counts(), time.perf_counter()
            grpo.sample_completions(model, tok, texts, cfg, sample=sample)
            calls.append({"sampler": name, "call": call, "prompt_tokens": max(map(len, enc)),
                          **counted_since(start), "seconds": time.perf_counter() - t})
            print(json.dumps(calls[-1]), flush=True)


if __name__ == "__main__":
    main()
