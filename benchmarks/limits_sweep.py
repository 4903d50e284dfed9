"""
benchmarks/limits_sweep.py -- the settings notebooks/06_limits_and_risks.ipynb tried before it chose
its own, for two of its experiments.

    python benchmarks/limits_sweep.py brakes   # 3 settings, brakes on and off: ~5 minutes, 2 cores
    python benchmarks/limits_sweep.py gaming   # the gameable reward at 2 learning rates: ~3 minutes
    python benchmarks/limits_sweep.py brakes --settings 4:1e-4 --steps 10

brakes: GRPO with the brakes (clip ε = 0.2, β = 0.04) and without them (no clip, β = 0), at each
μ:lr setting. gaming: GRPO on the gameable reward (the gold number anywhere in the completion, the
first example reward of PrimeIntellect's verifiers docs) at each lr (μ = 1), with the strict check
scored on the same samples at weight 0.

Each run: the cached warm start (tiny_world.load_warm_start, 800 steps, seed 0), the tiny preset's
settings (16 prompts a step, G = 8, 96 tokens) otherwise, the same prompts and seed for every run;
held-out greedy accuracy (strict check) on 150 problems before and after, and the KL to π_ref
measured as the notebook measures it (the mean k3 estimate per token, on the policy's own samples
of 32 held-out prompts, 4 each); gaming adds both rewards' means over the first and the last 10
steps. One JSON line per run on stdout and, with --out, in that file.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # WHY: run as a script, the repository root is not on the path

BRAKES = {"on": dict(clip_eps=0.2, beta=0.04), "off": dict(clip_eps=1e6, beta=0.0)}


def setting(text: str) -> tuple[int, float]:
    """'4:1e-4' -> (μ = 4, lr = 1e-4)."""
    try:
        mu, lr = text.split(":")
        return int(mu), float(lr)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a setting is μ:lr, such as 4:1e-4; got {text!r}")


def contains_answer(completions, answer, **kwargs):
    """The gameable reward: 1.0 where the gold number is a substring of the completion."""
    import rewards
    return [1.0 if str(rewards.gold_answer(a)) in rewards.completion_text(c) else 0.0
            for c, a in zip(completions, answer)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment", choices=["brakes", "gaming"])
    ap.add_argument("--settings", nargs="+", type=setting,
                    help="μ:lr pairs (brakes: 4:1e-4 4:3e-4 1:1e-3; gaming: 1:1e-4 1:3e-4)")
    ap.add_argument("--steps", type=int, help="GRPO steps a run (brakes: 20; gaming: 80)")
    ap.add_argument("--warm-start-steps", type=int, default=800,
                    help="the warm start's supervised steps (800: the notebook's; fewer: a test)")
    ap.add_argument("--heldout", type=int, default=150,
                    help="held-out problems (150: the notebook's)")
    ap.add_argument("--out", type=Path, help="also write the JSON lines here")
    args = ap.parse_args(argv)
    gaming = args.experiment == "gaming"
    settings = args.settings or ([(1, 1e-4), (1, 3e-4)] if gaming
                                 else [(4, 1e-4), (4, 3e-4), (1, 1e-3)])
    steps = args.steps or (80 if gaming else 20)

    import os
    os.environ.setdefault("TQDM_DISABLE", "1")
    import torch
    import grpo
    import rewards
    from machinery import engine
    from recipe import evaluation, tasks, tiny_world

    torch.set_num_threads(2)
    policy0, tok, _ = tiny_world.load_warm_start(args.warm_start_steps, 0, log=lambda *a: None)
    seams = engine.apply(engine.EngineConfig(), grpo.Seams(), [tok.eos_token_id], tok.pad_token_id)
    train_rows = tasks.gsm8k_rows(tiny_world.make_problems(16 * steps, "train", seed=0))
    eval_rows = tasks.gsm8k_rows(tiny_world.make_problems(args.heldout, "test", seed=0))
    preset = dict(group_size=8, max_new_tokens=96, micro_batch_size=128)

    def heldout(policy, cfg):
        return 100 * evaluation.evaluate(policy, tok, rewards.correctness_reward, eval_rows, cfg,
                                         "", 150, desc=None, sample=seams.sample)

    def kl_to_reference(policy, ref):
        prompts, columns = tasks.prompts_and_columns(tok, eval_rows[:32])
        cfg = grpo.GRPOConfig(**{**preset, "group_size": 4})
        with torch.random.fork_rng():   # WHY: as the notebook: measuring draws no training sample
            torch.manual_seed(123)
            b = grpo.rollout(policy, tok, prompts, columns, [rewards.correctness_reward], cfg,
                             seams)
        ids = (b["prompt_ids"], b["prompt_mask"], b["completion_ids"], b["completion_mask"], 1.0)
        with torch.no_grad():
            kl = grpo.k3_kl(grpo.token_logprobs(policy, *ids), grpo.token_logprobs(ref, *ids))
        return ((kl * b["completion_mask"]).sum() / b["completion_mask"].sum()).item()

    lines = []
    runs = [("on", BRAKES["on"])] if gaming else list(BRAKES.items())
    # gaming: trained on the gameable reward, the strict check scored beside it at weight 0
    weights = dict(reward_weights=[1.0, 0.0]) if gaming else {}
    funcs = ([contains_answer, rewards.correctness_reward] if gaming
             else [rewards.correctness_reward])
    # WHY once: every run starts from the warm start, and greedy decoding reads no lr, μ or brakes
    before = heldout(policy0, grpo.GRPOConfig(**preset))
    for mu, lr in settings:
        for label, brakes in runs:
            cfg = grpo.GRPOConfig(**preset, lr=lr, num_iterations=mu, **brakes, **weights)
            torch.manual_seed(0)
            policy = grpo.disable_dropout(copy.deepcopy(policy0))
            ref, opt = grpo.make_reference(policy), grpo.make_optimizer(policy, cfg)
            log = []
            for s in range(steps):
                prompts, columns = tasks.prompts_and_columns(tok, train_rows[16 * s:16 * (s + 1)])
                log.append(grpo.grpo_step(policy, ref if cfg.beta else None, opt, tok, prompts,
                                          funcs, cfg, columns=columns, seams=seams))
            after = heldout(policy, cfg)
            line = dict(num_iterations=mu, lr=lr, brakes=label, steps=steps,
                        heldout_before=round(before, 1), heldout_after=round(after, 1),
                        kl=round(kl_to_reference(policy, ref), 4))
            for name in ("contains_answer", "correctness_reward") if gaming else ():
                xs = [m[f"rewards/{name}"] for m in log]
                k = min(10, steps)
                line[name] = [round(sum(xs[:k]) / k, 3), round(sum(xs[-k:]) / k, 3)]
            print(json.dumps(line), flush=True)
            lines.append(line)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps(x) + "\n" for x in lines))


if __name__ == "__main__":
    main()
