"""
compare/ -- the methods GRPO is compared with, and the runs that compare them.

    baselines.py   RLOO's and REINFORCE's advantages, CISPO's surrogate, each method's step built
                   from grpo.py's functions (BaselineConfig, step_function)
    ppo.py         PPO with a learned critic: the step GRPO replaces (ppo.Critic)
    ablation.py    the published variants and these baselines side by side, over seeds
    train_trl.py   the same data and rewards through TRL's GRPOTrainer, on many GPUs (zero3.yaml)

grpo.py imports none of them; the recipe (train_gsm8k.py, recipe/) may import baselines.py and
ppo.py, and nothing imports the two scripts.
May import: baselines.py and ppo.py, grpo.py only; ablation.py and train_trl.py, anything but
train_gsm8k.py (they run it as a separate process).
"""
