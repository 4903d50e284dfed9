"""
benchmarks/fits_table.py -- the README's table of what fits on one card ("One GPU and beyond"),
from planner.py.

    python benchmarks/fits_table.py            # the markdown table, then one JSON line
    python benchmarks/fits_table.py --max-new-tokens 1024

For Qwen2.5-0.5B, Qwen2.5-1.5B and the paper's 7B (DeepSeekMath-7B's architecture; the configs are
in benchmarks/configs/), it predicts the peak memory of one training step for GRPO (full
fine-tuning and LoRA) and for PPO with a critic the policy's size (the same two), at the paper's
group size, and says whether each fits a 24, 48 and 80 GB card (with planner.CUDA_RESERVE on
top). Every cell is a projection: planner.py's, checked against measured steps on a CPU in fp32
(benchmarks/memory_parts.py --plan-check) and not yet on a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from recipe import planner  # noqa: E402

MODELS = {"Qwen2.5-0.5B": "qwen2.5-0.5b.json", "Qwen2.5-1.5B": "qwen2.5-1.5b.json",
          "DeepSeekMath-7B (the paper's)": "deepseek-math-7b.json"}
CARDS = (24, 48, 80)


def table(s: planner.StepSettings) -> list[dict]:
    rows = []
    for name, file in MODELS.items():
        shape = planner.model_shape(planner.load_config(str(ROOT / "benchmarks/configs" / file)))
        for method, critic, r in [("GRPO, full fine-tuning", False, 0),
                                  ("GRPO + LoRA r 16", False, 16),
                                  ("PPO + critic, full fine-tuning", True, 0),
                                  ("PPO + critic, LoRA r 16", True, 16)]:
            res = planner.step_memory(shape, replace(s, lora_r=r), critic)
            rows.append({"model": name, "method": method, "parameters": shape.params,
                         "peak_bytes": res["peak"], "peak_phase": res["peak_phase"],
                         "kv_cache_bytes": res["parts"]["KV cache"],
                         "fits": {gb: planner.fits(res["peak"], gb) for gb in CARDS}})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--group-size", type=int, default=64, help="G (default 64, the paper's)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt length (default 256)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="completion cap (default 512)")
    p.add_argument("--micro-batch-size", type=int, default=8, help="sequences a pass (default 8)")
    p.add_argument("--sample-batch-size", type=int, default=16,
                   help="completions sampled at once (default 16; 0: the whole group)")
    a = p.parse_args(argv)
    s = planner.StepSettings(group_size=a.group_size, prompts_per_step=1,
                             prompt_tokens=a.prompt_tokens, max_new_tokens=a.max_new_tokens,
                             micro_batch_size=a.micro_batch_size, beta=0.04, bf16=True,
                             gradient_checkpointing=True, logprob_chunk=1024,
                             sample_batch_size=a.sample_batch_size)
    rows = table(s)
    print(f"Projected by planner.py: one group of G={s.group_size} per step, {s.prompt_tokens} "
          f"prompt + {s.max_new_tokens} completion tokens, sampled {s.sample_batch_size or 'all'} "
          f"at a time, micro-batch {s.micro_batch_size}, bf16 "
          f"autocast (fp32 master weights and AdamW state; a LoRA base's Linear weights in bf16), "
          f"gradient checkpointing, log-probs in chunks of 1,024, beta 0.04; a card fits a run if "
          f"the peak plus {planner.CUDA_RESERVE / planner.GiB:.0f} GiB for CUDA fits it.\n")
    methods = list(dict.fromkeys(r["method"] for r in rows))
    print("| model | " + " | ".join(methods) + " |\n|---|" + "---|" * len(methods))
    for name in MODELS:
        cells = []
        for r in (r for r in rows if r["model"] == name):
            cards = [f"{gb}" for gb in CARDS if r["fits"][gb]]
            cells.append(f"{r['peak_bytes'] / planner.GiB:.1f}: "
                         + (", ".join(cards) if cards else "none"))
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"\n(peak GiB: the cards of {', '.join(map(str, CARDS))} GB it fits)")
    print(json.dumps({"settings": asdict(s), "rows": rows}))
    return rows


if __name__ == "__main__":
    main()
