"""
machinery/ -- speed and memory for grpo.py, applied from outside it.

grpo.py is the algorithm and its complete, plain path. The modules here make the same step faster
or leaner without changing what it computes, and reach it only through grpo.Seams (a sampler, a
scorer, an update) or by acting on the model (LoRA adapters, lean activations, checkpointing):

    engine.py   the fast and compiled samplers, each prompt scored once (EngineConfig)
    memory.py   log-probs in chunks, lean activations, offloading, AdamW inside backward
                (MemoryConfig)
    lora.py     LoRA adapters through PEFT; π_ref is the base with its adapters off
    precision.py  under bf16 autocast: the logits in fp32, π_ref with the policy's numbers

Each is tested against grpo.py's own path (tests/test_engine.py, test_memory.py, test_lora.py,
test_precision.py) and says in its docstring what it buys, measured.
May import: grpo.py, rewards.py and each other. Never the recipe (train_gsm8k.py, recipe/).
"""
