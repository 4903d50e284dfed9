"""
train_trl.py -- the same GSM8K training on TRL's GRPOTrainer: the road past one GPU.

    pip install trl                                                      # not a core dependency
    python train_trl.py --model Qwen/Qwen2.5-0.5B-Instruct --data openai/gsm8k       # one device
    accelerate launch --num_processes 8 train_trl.py --model Qwen/Qwen2.5-7B-Instruct \\
        --data openai/gsm8k                                                          # 8 devices
    accelerate launch --config_file zero3.yaml train_trl.py ... --use-vllm    # DeepSpeed + vLLM
    accelerate launch --multi_gpu --num_processes 2 train_trl.py --model M --data tiny --cpu
                                                 # 2 processes on one CPU (torchrun, gloo): a test

When to switch from train_gsm8k.py: when one device cannot hold the policy, the reference and
AdamW state, or when generation is the wall and you want vLLM. grpo.py stays the reference for
what the math must be; TRL's GRPOTrainer runs it on accelerate / DeepSpeed / FSDP with vLLM.

This script reuses this project's pieces unchanged: the data comes from gsm8k.load_data and
tasks.gsm8k_prompt (the tiny world, a GSM8K JSONL folder, or the hub), and the rewards are
rewards.py's correctness_reward and format_reward, whose signature is TRL's. TRL's defaults
differ from the paper; here they are set to the paper's (and grpo.GRPOConfig's) where both have
the knob:
    loss_type "grpo" (TRL: "dapo"), beta 0.04 (TRL: 0.0), epsilon 0.2, num_iterations 1,
    scale_rewards by the group std, temperature 1 with top_k 0 and top_p 1, a constant learning
    rate with no warm-up.
Batch sizes: TRL counts completions per device, so one process trains --prompts-per-step x
--group-size completions per step, and N processes train N times that.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # WHY: run as a script

import grpo  # noqa: E402
from recipe import gsm8k  # noqa: E402
from recipe import tasks  # noqa: E402
from recipe.flags import InputError  # noqa: E402


def parse_args(argv=None):
    paper = grpo.GRPOConfig()
    p = argparse.ArgumentParser(description="GRPO on GSM8K with TRL's GRPOTrainer, fed by this "
                                "project's data loading and reward functions (see the docstring).")
    p.add_argument("--model", required=True, help="hub id or local directory of a causal LM")
    p.add_argument("--data", default="openai/gsm8k",
                   help="'tiny', a folder with train.jsonl/test.jsonl, or 'openai/gsm8k' (default)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    p.add_argument("--prompts-per-step", type=int, default=8,
                   help="prompts per step per process (default 8)")
    p.add_argument("--group-size", type=int, default=paper.group_size,
                   help=f"G (default {paper.group_size})")
    p.add_argument("--max-new-tokens", type=int, default=512, help="completion cap (default 512)")
    p.add_argument("--lr", type=float, default=paper.lr,
                   help=f"learning rate (default {paper.lr}, the paper's)")
    p.add_argument("--beta", type=float, default=paper.beta,
                   help=f"KL weight (default {paper.beta}, the paper's)")
    p.add_argument("--system-prompt", default=gsm8k.GSM8K_SYSTEM_PROMPT,
                   help="system message for chat models (default: ask for the '####' layout)")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=False,
                   help="bf16 mixed precision")
    p.add_argument("--use-vllm", action="store_true",
                   help="generate with vLLM (pip install vllm; GPU only)")
    p.add_argument("--cpu", action="store_true", help="run on CPU even if a GPU is present")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/trl", help="output directory (default runs/trl)")
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    try:
        import torch
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        raise InputError(f"train_trl.py needs TRL and datasets: pip install trl ({e})") from None

    # The data, exactly as train_gsm8k.py loads and formats it.
    train_rows, _ = gsm8k.load_data(a.data, eval_size=1, n_train=a.steps * a.prompts_per_step,
                                    seed=a.seed)
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    dataset = Dataset.from_list([
        {"prompt": tasks.gsm8k_prompt(tokenizer, r["question"], a.system_prompt),
         "question": r["question"], "answer": r["answer"]} for r in train_rows])

    args = GRPOConfig(
        output_dir=a.out, report_to="none", seed=a.seed, use_cpu=a.cpu, bf16=a.bf16,
        max_steps=a.steps, per_device_train_batch_size=a.prompts_per_step * a.group_size,
        num_generations=a.group_size, max_completion_length=a.max_new_tokens,
        temperature=1.0, top_k=0, top_p=1.0,                # sample from the true policy (grpo.py)
        loss_type="grpo", beta=a.beta, epsilon=grpo.GRPOConfig.clip_eps,           # the paper's
        num_iterations=1, scale_rewards="group", learning_rate=a.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        reward_weights=gsm8k.DEFAULT_REWARD_WEIGHTS,
        use_vllm=a.use_vllm, logging_steps=1, save_strategy="no",
    )
    # WHY fp32: a checkpoint loads in its own dtype (bf16 for Qwen2.5), where AdamW's small
    #      updates are rounded away; --bf16 computes in bf16 over fp32 weights.
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=gsm8k.REWARD_FUNCS, args=args,
                          train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    trainer.save_model(a.out)
    if trainer.accelerator.is_main_process:
        print(f"trained {trainer.state.global_step} steps on {trainer.accelerator.num_processes} "
              f"process(es); the model is in {a.out}")
    return trainer


if __name__ == "__main__":
    try:
        main()
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
