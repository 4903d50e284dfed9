"""
recipe/ -- the support train_gsm8k.py runs on: data, checkpoints, logs, flags, the tiny world.

    tasks.py             a task: rows with a prompt (text or chat), reward functions by file
    evaluation.py        a task's held-out score (the first reward, greedy); `eval`
    gsm8k.py             GSM8K's and the tiny world's rows and reward functions
    checkpoint.py        loading models, atomic saves, resume
    flags.py             command-line flags from the config dataclasses; one-line errors
    report.py            metrics.jsonl, the progress line, curves.png, TensorBoard and W&B
    tiny_world.py        the offline world: a character tokenizer, problems, the warm start
    planner.py           `train_gsm8k.py plan`: one step's memory from a model's config

May import: grpo.py, rewards.py, machinery/, compare/'s baselines.py and ppo.py, and each other.
Nothing in machinery/ imports these; train_gsm8k.py, compare/'s scripts, benchmarks/ and tests/ do.
"""
