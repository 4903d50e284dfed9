"""
benchmarks/real_model_numerics.py -- step 1 on a real model: π_ref against the policy, and the
sampler against the trainer, in fp32 and under bf16 autocast (CPU).

    python benchmarks/real_model_numerics.py --model <SmolLM2 .gguf or folder> --data <gsm8k dir>

Before the first update the policy and π_ref are the same model and the sampler draws from the
policy the trainer scores, so step 1's KL and the sampler-trainer log-prob gap measure only how
each is computed. One grpo_step per setting (B = 4 GSM8K prompts, G = 4, 96 tokens, the same
seed), read from its own metrics (kl, sampling/logp_difference/mean and
sampling/ratio_outside_0.9_1.1):
    fp32                       the reference: both 0 up to float rounding
    bf16, π_ref all bf16       the whole copy cast to bf16 (train_gsm8k.py --bf16 before
                               precision.bf16_reference)
    bf16, π_ref Linear bf16    precision.bf16_reference
    ..., fp32 logits           and precision.fp32_logits (train_gsm8k.py --bf16 now)
    bf16, plain page, ...      grpo.py's own sampler and scorer, with both
and, by part, with bf16 and with fp32 logits, where the bf16 gap comes from: the trainer's bf16
log-probs of the same tokens scored twice, all rows in one batch and one row at a time (no
sampler in it); and the sampler's and the trainer's bf16 log-probs against fp32's.
The last line printed is JSON; --out writes it to a file too.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def gap(a, b, mask) -> dict:
    """Mean |a - b| over real tokens, and the share whose ratio exp(a - b) is outside [0.9, 1.1]."""
    real, n = mask.bool(), max(1.0, mask.sum().item())
    d = (a - b).masked_fill(~real, 0.0)
    return {"logp_difference_mean": d.abs().sum().item() / n,
            "ratio_outside_0.9_1.1": ((d.exp() - 1).abs() > 0.1).masked_fill(~real, False)
            .sum().item() / n}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help="a folder with GSM8K's train.jsonl, test.jsonl")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    import torch
    import grpo
    import rewards
    from machinery import engine, precision
    from recipe import checkpoint, gsm8k, tasks
    torch.set_num_threads(a.threads)
    model, tok = checkpoint.load_pretrained(a.model)
    model = grpo.disable_dropout(model)
    rows = gsm8k.load_data(a.data, 4, 4)[0][:4]
    prompts = [tasks.gsm8k_prompt(tok, r["question"], gsm8k.GSM8K_SYSTEM_PROMPT) for r in rows]
    cfg = grpo.GRPOConfig(group_size=4, max_new_tokens=96, micro_batch_size=16, lr=1e-6)
    fast = engine.apply(engine.EngineConfig(), grpo.Seams(), grpo.eos_token_ids(model, tok),
                        grpo.pad_token_id(model, tok))
    refs = {"all bf16": lambda r: r.to(torch.bfloat16), "Linear bf16": precision.bf16_reference,
            "fp32": lambda r: r}
    res = {"model": a.model, "threads": a.threads, "settings": {}, "bf16 parts": {}}
    for name, bf16, ref_kind, fp32_logits, seams in [
            ("fp32", False, "fp32", False, fast),
            ("bf16, π_ref all bf16", True, "all bf16", False, fast),
            ("bf16, π_ref Linear bf16", True, "Linear bf16", False, fast),
            ("bf16, π_ref Linear bf16, fp32 logits", True, "Linear bf16", True, fast),
            ("bf16, plain page, fp32 logits", True, "Linear bf16", True, grpo.Seams())]:
        policy = precision.fp32_logits(copy.deepcopy(model).train(), fp32_logits)
        ref = refs[ref_kind](grpo.make_reference(policy))
        opt = grpo.make_optimizer(policy, cfg)
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            m = grpo.grpo_step(policy, ref, opt, tok, prompts, [rewards.correctness_reward], cfg,
                               columns={"answer": [r["answer"] for r in rows]}, seams=seams,
                               return_samples=False)
        res["settings"][name] = {
            "kl": m["kl"], "logp_difference_mean": m["sampling/logp_difference/mean"],
            "ratio_outside_0.9_1.1": m["sampling/ratio_outside_0.9_1.1"],
            "reference_mb": sum(t.numel() * t.element_size() for t in ref.parameters()) / 2**20}
        print(name, json.dumps(res["settings"][name]), flush=True)
    # By part: the same tokens, sampled once under bf16 by the engine, scored again.
    for head in ("bf16 logits", "fp32 logits"):
        policy = precision.fp32_logits(copy.deepcopy(model).eval(), head == "fp32 logits")
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            batch = grpo.sample_completions(policy, tok, prompts, cfg, sample=fast.sample)
        args = [batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids",
                                   "completion_mask")]
        mask = batch["completion_mask"]
        with torch.no_grad():
            fp32 = grpo.token_logprobs(model, *args)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                whole = grpo.token_logprobs(policy, *args)
                rows_one = torch.cat([grpo.token_logprobs(policy, *[x[i:i + 1] for x in args])
                                      for i in range(mask.shape[0])])
        res["bf16 parts"][head] = {
            "sampler bf16 vs trainer bf16": gap(batch["sampler_logp"], whole, mask),
            "trainer bf16, whole batch vs one row at a time": gap(whole, rows_one, mask),
            "sampler bf16 vs trainer fp32": gap(batch["sampler_logp"], fp32, mask),
            "trainer bf16 vs trainer fp32": gap(whole, fp32, mask)}
        for k, v in res["bf16 parts"][head].items():
            print(head, k, json.dumps(v), flush=True)
    print(json.dumps(res))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
