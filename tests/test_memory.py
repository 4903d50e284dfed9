"""memory.py's switches against the page's path: log-probs in chunks (memory.chunked_scorer) and
activations kept in CPU RAM (memory.offloaded) give the same log-probs, entropies, losses and
gradients as grpo.token_logprobs and a plain backward, within float tolerance, on a Llama, a
GPT-2 and a Qwen2, with and without gradient checkpointing and LoRA; and a whole grpo_step with
chunks lands on the same weights as without.

Needs: torch and transformers (tiny random models built in memory); peft for the LoRA case. CPU,
offline, ~10 s.
"""

import copy

import pytest
import torch

from machinery import engine
import grpo
from machinery import memory
from recipe import tiny_world
from test_engine import tiny_gpt2

PROMPTS = ["What is 2+3?", "Hi", "Q: 7*8 then 9"]


def model_for(arch, tok):
    if arch == "gpt2":
        return tiny_gpt2(tok)
    if arch == "qwen2":
        return tiny_world.tiny_qwen2(tok)
    return tiny_world.tiny_llama(tok, hidden=32, layers=2, heads=2, seed=0)


def batch_of(model, tok, G=3, T=9):
    """A sampled batch: left-padded prompts of 3 lengths, completions of varying length."""
    torch.manual_seed(0)
    return grpo.sample_completions(model, tok, PROMPTS, grpo.GRPOConfig(group_size=G,
                                                                        max_new_tokens=T))


def inputs(b):
    return b["prompt_ids"], b["prompt_mask"], b["completion_ids"], b["completion_mask"]


def score(model, *args, chunk=0):
    """grpo.token_logprobs (the page's), or with chunk > 0 memory's chunked scorer (its seam)."""
    return (memory.chunked_scorer(chunk) if chunk else grpo.token_logprobs)(model, *args)


def seams_of(logprob_chunk=0, update_in_backward=False):
    """grpo.Seams as train_gsm8k.py builds them from these memory switches."""
    return memory.apply(memory.MemoryConfig(logprob_chunk=logprob_chunk,
                                            update_in_backward=update_in_backward), grpo.Seams())


def relative_errors(grads, exact):
    """{name: ‖grads[name] - exact[name]‖ / ‖exact[name]‖} over exact's parameters."""
    return {n: ((grads[n] - g).norm() / g.norm()).item() for n, g in exact.items()}


def logp_and_grads(model, b, chunk, temperature=1.0):
    """(logp, entropy, every parameter's gradient) of a loss weighting each token differently."""
    model.zero_grad(set_to_none=True)
    logp, entropy = score(model, *inputs(b), temperature, True, chunk=chunk)
    w = torch.linspace(-1, 2, logp.numel()).view_as(logp)                           # (N, T)
    (logp * w * b["completion_mask"]).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), entropy, grads


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("chunk", [1, 7, 10_000])
def test_chunked_logprobs_and_gradients_match_the_plain_ones(arch, chunk):
    """Chunks of 1 token, of 7 (not dividing N*T = 81, so the last is short) and one chunk
    larger than the batch: log-probs, entropies and every gradient match the plain code at
    temperature 0.7."""
    tok = tiny_world.char_tokenizer()
    model = model_for(arch, tok)
    b = batch_of(model, tok)
    want = logp_and_grads(model, b, 0, 0.7)
    got = logp_and_grads(model, b, chunk, 0.7)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    assert got[2].keys() == want[2].keys() and len(want[2]) > 5
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-4, atol=1e-5)


def backward_peak(model, b, chunk):
    """The most bytes alive at once during backward of a weighted log-prob loss, over what was
    alive when it started, counted from the CPU allocator's own events (torch.profiler); and
    every parameter's gradient."""
    from torch.profiler import ProfilerActivity, profile
    model.zero_grad(set_to_none=True)
    logp = score(model, *b, 1.0, False, chunk=chunk)                                  # (n, T)
    w = torch.linspace(-1, 2, logp.numel()).view_as(logp)                             # (n, T)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        (logp * w).sum().backward()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    alive = peak = 0
    for _, nbytes in events:  # NOTE: allocations count positive, frees negative
        alive += nbytes
        peak = max(peak, alive)
    return peak, {n: p.grad.clone() for n, p in model.named_parameters()}


class SubclassedHead(torch.nn.Linear):
    """An output layer the written-out path does not take (not exactly nn.Linear): its chunks go
    through the general, checkpointed path."""


@pytest.mark.parametrize("tied", [True, False])
def test_chunked_backward_holds_one_output_layer_gradient(tied):
    """At a vocabulary large enough for the output layer to dominate (V = 20,000 × H = 32, 2.56
    MB), backward's peak over its start, in units of that layer's size W:
    - the written-out path (memory._LinearLogp), tied (memory._TiedEmbedding): the one (V, H)
      gradient both uses add into, plus small change: < 1.6 W;
    - the same, untied: the output layer's gradient and the input embedding's, 2 W + change;
    - the general path (a subclass of nn.Linear): each chunk's backward makes its own (V, H)
      gradient before autograd adds it in, so at least 2 W tied or not, and 3 W measured here;
    - the plain, unchunked code: (n, T, V) logits, their softmax and gradient: far more.
    All give the plain code's gradients. The tied weight's hook fires once, on a dense gradient."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    V, H = 20_000, 32
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tied, pad_token_id=3))
    ids = torch.randint(0, V, (4, 30))                                                # (n, P+T)
    ids[0, :4] = 3  # NOTE: pad tokens, whose embedding row gets no gradient
    mask = (ids != 3).long()                                                          # (n, P+T)
    b = (ids[:, :10], mask[:, :10], ids[:, 10:], mask[:, 10:])
    W = V * H * 4
    head = model.get_output_embeddings()
    seen = []
    head.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.is_sparse))
    plain, want = backward_peak(model, b, 0)
    seen.clear()
    lean, got = backward_peak(model, b, 5)
    assert seen == [False]  # once, dense
    general = SubclassedHead(H, V, bias=False)
    general.weight = head.weight
    model.set_output_embeddings(general)
    slow, got_slow = backward_peak(model, b, 5)
    for grads in (got, got_slow):
        assert grads.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(grads[name], want[name], rtol=1e-4, atol=1e-5)
    assert lean < (1.6 if tied else 2.6) * W
    assert slow > 2.6 * W and plain > 5 * W


def test_chunked_logprobs_under_bf16_autocast_are_no_less_exact_than_the_plain_ones():
    """Under CPU bf16 autocast the written-out path computes its logits in bf16 as autocast does
    (the plain forward's log-probs and entropies, to float rounding), and the output layer's
    gradient in fp32 where autocast's backward rounds it to bf16. So against the fp32 gradients,
    every parameter's relative error is at most the plain bf16 code's (measured: 0.24% against
    0.32% for the tied embedding, the same for the rest) and within bf16's 3 digits."""
    tok = tiny_world.char_tokenizer()
    model = model_for("qwen2", tok)
    b = batch_of(model, tok)
    exact = logp_and_grads(model, b, 0, 0.7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain, got = logp_and_grads(model, b, 0, 0.7), logp_and_grads(model, b, 7, 0.7)
    torch.testing.assert_close(got[0], plain[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], plain[1], rtol=1e-5, atol=1e-5)
    assert not torch.equal(plain[0], exact[0])  # so autocast really ran in bf16
    err_plain, err_got = relative_errors(plain[2], exact[2]), relative_errors(got[2], exact[2])
    for name in exact[2]:
        assert err_got[name] <= err_plain[name] * 1.01 + 1e-7 and err_got[name] < 0.05, name


def test_chunked_logprobs_without_gradients_and_a_wrong_offset_fails():
    """Under no_grad (π_old, π_ref) the chunked values match too; and the check can fail: scoring
    the hidden states one position late (the off-by-one the code warns about) does not match."""
    tok = tiny_world.char_tokenizer()
    model = model_for("llama", tok)
    b = batch_of(model, tok)
    with torch.no_grad():
        want = grpo.token_logprobs(model, *inputs(b))
        got = score(model, *inputs(b), chunk=5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        late = score(model, b["prompt_ids"][:, :-1], b["prompt_mask"][:, :-1], *inputs(b)[2:],
                     chunk=5)
    assert not torch.allclose(late, want, atol=1e-3)


def test_chunked_logprobs_with_gradient_checkpointing_and_lora():
    """The chunked path goes through the backbone as the model's own forward does, so it sees
    checkpointed layers and LoRA adapters (switched off for π_ref) the same way."""
    pytest.importorskip("peft")
    from machinery import lora
    tok = tiny_world.char_tokenizer()
    policy = lora.add_adapters(model_for("llama", tok), r=4, alpha=8)
    for n, p in policy.named_parameters():  # non-zero B, so the adapters change the output
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.2)
    engine.enable_activation_checkpointing(policy)
    policy.train()
    b = batch_of(policy, tok)
    want, got = logp_and_grads(policy, b, 0), logp_and_grads(policy, b, 4)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert want[2] and all("lora_" in n for n in want[2])
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-4, atol=1e-5)
    ref = lora.AdaptersOff(policy)
    with torch.no_grad():
        off_plain = grpo.token_logprobs(ref, *inputs(b))
        off_chunked = score(ref, *inputs(b), chunk=4)
    torch.testing.assert_close(off_chunked, off_plain, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(off_plain, want[0], atol=1e-3)  # the adapters were really off


def test_a_whole_step_with_chunks_lands_on_the_same_weights():
    """grpo_step with logprob_chunk=5 (policy, π_ref, μ = 2 so π_old is scored too) against the
    plain one, from the same weights and seed: the same rewards and the same weights after."""
    tok = tiny_world.char_tokenizer()
    start = model_for("llama", tok)
    after = []
    for chunk in (0, 5):
        policy = copy.deepcopy(start)
        cfg = grpo.GRPOConfig(group_size=4, max_new_tokens=8, num_iterations=2, lr=1e-2,
                              micro_batch_size=5)
        torch.manual_seed(1)
        m = grpo.grpo_step(policy, grpo.make_reference(policy), grpo.make_optimizer(policy, cfg),
                           tok, PROMPTS, [lambda completions, **_: [len(c) % 3 for c in
                                                                   completions]], cfg,
                           seams=seams_of(logprob_chunk=chunk))
        after.append((m, torch.cat([p.detach().flatten() for p in policy.parameters()])))
    (m0, w0), (m1, w1) = after
    assert m0["reward"] == m1["reward"]
    assert not torch.equal(w0, torch.cat([p.flatten() for p in start.parameters()]))
    torch.testing.assert_close(w1, w0, rtol=1e-4, atol=1e-5)
    assert m1["kl"] == pytest.approx(m0["kl"], rel=1e-4, abs=1e-8)


def test_offloaded_activations_give_the_same_gradients_and_are_really_offloaded(monkeypatch):
    """Under memory.offloaded(True) the saved tensors go through save_on_cpu's hooks (counted
    here), with and without gradient checkpointing; the gradients equal the plain ones."""
    tok = tiny_world.char_tokenizer()
    packed = []
    real = torch.autograd.graph.save_on_cpu

    class Counting(real):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pack = self.pack_hook

            def counted(t):
                packed.append(t.shape)
                return pack(t)
            self.pack_hook = counted

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Counting)
    for checkpointing in (False, True):
        model = model_for("llama", tok)
        if checkpointing:
            engine.enable_activation_checkpointing(model)
        model.train()
        b = batch_of(model, tok)
        want = logp_and_grads(model, b, 0)
        packed.clear()
        with memory.offloaded(True):
            got = logp_and_grads(model, b, 0)
        assert len(packed) > 3, checkpointing
        for name in want[2]:
            torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-5, atol=1e-7)
    with memory.offloaded(False):
        packed.clear()
        logp_and_grads(model, b, 0)
    assert packed == []


def test_logprob_chunk_must_not_be_negative():
    with pytest.raises(ValueError, match="logprob_chunk must be >= 0"):
        memory.MemoryConfig(logprob_chunk=-1)


def length_reward(completions, **_):
    return [len(c) % 3 for c in completions]


def two_steps(start, tok, update_in_backward, checkpointing=False, logprob_chunk=0, **kw):
    """Two grpo_steps (μ = 2, so four AdamW steps) from `start`: (metrics, weights, AdamW state)."""
    policy = grpo.disable_dropout(copy.deepcopy(start))
    if checkpointing:
        engine.enable_activation_checkpointing(policy)
    cfg = grpo.GRPOConfig(group_size=4, max_new_tokens=8, num_iterations=2, lr=1e-2,
                          micro_batch_size=12, **kw)
    ref, opt = grpo.make_reference(policy), grpo.make_optimizer(policy, cfg)
    seams = seams_of(logprob_chunk, update_in_backward)
    torch.manual_seed(1)
    ms = [grpo.grpo_step(policy, ref, opt, tok, PROMPTS, [length_reward], cfg, seams=seams)
          for _ in range(2)]
    state = [opt.state[p][k] for p in policy.parameters()
             for k in ("exp_avg", "exp_avg_sq", "step")]
    return ms, [p.detach().clone() for p in policy.parameters()], state


@pytest.mark.parametrize("arch,kw", [
    ("llama", dict(max_grad_norm=0.05)),    # the clip engages: every gradient is scaled
    ("llama", dict(max_grad_norm=1e9)),     # it does not: the factor is 1
    ("gpt2", dict(max_grad_norm=0.05)),     # tied input and output embeddings, one tensor
    ("gpt2", dict(max_grad_norm=0.05, logprob_chunk=5)),  # tied, the sparse input gradient
    ("qwen2", dict(max_grad_norm=0.05, beta=0.0)),
    ("llama", dict(max_grad_norm=0.05, logprob_chunk=5, checkpointing=True)),
])
def test_stepping_inside_backward_lands_on_the_same_weights_and_state(arch, kw):
    """memory.step_in_backward (MemoryConfig.update_in_backward) against backward, clip_grad_norm_
    and AdamW's step: two grpo_steps at μ = 2 give the same rewards, gradient norms and losses,
    and bit for bit the same weights, AdamW moments and step counts. The same arithmetic in the
    same order, only at other moments, so nothing may differ, not even in the last bit."""
    tok = tiny_world.char_tokenizer()
    start = model_for(arch, tok)
    (m0, w0, s0), (m1, w1, s1) = (two_steps(start, tok, flag, **kw) for flag in (False, True))
    assert not torch.equal(w0[0], next(start.parameters()))
    for a, b in zip(m0, m1):
        for key in ("reward", "grad_norm", "loss", "kl", "skipped_updates"):
            assert a[key] == b[key], key
    if kw["max_grad_norm"] < 1:
        assert m0[-1]["grad_norm"] > kw["max_grad_norm"]  # so the clip really scaled
    assert len(w0) == len(w1) and len(s0) == len(s1) > 0
    for a, b in zip(w0 + s0, w1 + s1):
        assert torch.equal(a, b)


def test_inside_backward_at_most_one_gradient_exists_at_a_time():
    """A probe hook, run before step_in_backward's own on every parameter, counts the parameters
    holding a gradient: never more than the one just accumulated, in either pass, and none after.
    The same probe on a plain backward sees them pile up, so it can tell the two apart."""
    tok = tiny_world.char_tokenizer()
    model = model_for("llama", tok)
    params = list(model.parameters())
    b = batch_of(model, tok)
    seen = []
    for p in params:
        p.register_post_accumulate_grad_hook(
            lambda _: seen.append(sum(q.grad is not None for q in params)))

    def loss():
        return grpo.token_logprobs(model, *inputs(b), 1.0, False).sum()

    loss().backward()
    assert max(seen) == len(params)
    model.zero_grad(set_to_none=True)
    seen.clear()
    opt = torch.optim.AdamW(params, lr=1e-3)
    assert memory.step_in_backward(params, opt, loss(), max_grad_norm=1.0) > 0
    assert len(seen) == 2 * len(params) and max(seen) == 1
    assert all(p.grad is None for p in params)
    assert all(opt.state[p]["step"] == 1 for p in params)


def test_step_in_backward_never_sets_the_process_wide_glibc_setting(monkeypatch):
    """The glibc setting is process-wide, so only its own switch turns it on
    (MemoryConfig.return_freed_memory); stepping inside backward does not call it."""
    calls = []
    monkeypatch.setattr(memory, "return_freed_memory", lambda: calls.append(1))
    tok = tiny_world.char_tokenizer()
    model = model_for("llama", tok)
    b = batch_of(model, tok)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    memory.step_in_backward(model.parameters(), opt,
                            grpo.token_logprobs(model, *inputs(b), 1.0, False).sum(), 1.0)
    update = memory.StepInsideBackward()
    update.backward(grpo.token_logprobs(model, *inputs(b)).sum())
    update.step(model, opt, 1.0, 0.0)
    assert calls == []


def test_a_non_finite_loss_inside_backward_moves_nothing():
    tok = tiny_world.char_tokenizer()
    model = model_for("llama", tok)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    b = batch_of(model, tok)
    loss = grpo.token_logprobs(model, *inputs(b), 1.0, False).sum() * float("nan")
    memory.step_in_backward(model.parameters(), opt, loss, max_grad_norm=1.0)
    assert not opt.state
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())


def test_update_in_backward_with_more_than_one_micro_batch_is_refused():
    tok = tiny_world.char_tokenizer()
    policy = model_for("llama", tok)
    cfg = grpo.GRPOConfig(group_size=4, max_new_tokens=4, micro_batch_size=5, beta=0.0)
    before = [p.detach().clone() for p in policy.parameters()]
    opt = grpo.make_optimizer(policy, cfg)
    with pytest.raises(ValueError, match=r"in one micro-batch: raise micro_batch_size"):
        grpo.grpo_step(policy, None, opt, tok, PROMPTS,
                       [length_reward], cfg, seams=seams_of(update_in_backward=True))
    # refused before anything moved: the weights and AdamW's state are as they were
    assert all(torch.equal(b, p) for b, p in zip(before, policy.parameters())) and not opt.state


def glibc_script(*lines: str) -> str:
    """A script for a fresh process that reads its own RSS in MB (rss()), with `lines` after the
    imports; the test skips where glibc's malloc is not the allocator."""
    import platform
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc's malloc only")
    return "\n".join([
        "import sys, torch",
        "from machinery import memory",
        "def rss():",
        "    line = [x for x in open('/proc/self/status') if x.startswith('VmRSS:')][0]",
        "    return int(line.split()[1]) / 1024",
        *lines])


def test_return_freed_memory_makes_glibc_give_freed_blocks_back():
    """In a fresh process: freeing a 16 MB tensor raises glibc's mmap threshold to 16 MB, so the
    next 2 MB blocks come from the heap, and freeing all but the last keeps their ~62 MB in RSS.
    memory.return_freed_memory (its own switch, MemoryConfig.return_freed_memory) gives that back
    at once ("after"), and blocks freed after it leave RSS as they are freed ("on"). Linux with
    glibc only (the function does nothing elsewhere). The three processes run at once; each reads
    its own RSS."""
    import os
    import subprocess
    import sys
    script = glibc_script(
        "if sys.argv[1] == 'on':",
        "    memory.return_freed_memory()",
        "big = torch.ones(4 << 20)",
        "del big",
        "blocks = [torch.ones(1 << 19) for _ in range(32)]",
        "before = rss()",
        "del blocks[:-1]",
        "if sys.argv[1] == 'after':",
        "    memory.return_freed_memory()",
        "print(before - rss())")
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(memory.__file__)))
    runs = {flag: subprocess.Popen([sys.executable, "-c", script, flag], env=env, text=True,
                                   stdout=subprocess.PIPE) for flag in ("off", "on", "after")}
    freed = {flag: float(p.communicate()[0].split()[-1]) for flag, p in runs.items()}
    assert all(p.returncode == 0 for p in runs.values())
    assert freed["off"] < 10 and freed["on"] > 50 and freed["after"] > 50, freed


def test_keep_freed_memory_keeps_a_freed_large_tensor_for_reuse():
    """In a fresh process: a 302 MB tensor (a micro-batch's logits in the smollm2-135m preset)
    comes from a fresh mmap under glibc's defaults, so freeing it gives its pages back and the next
    one is page-faulted in again; after memory.keep_freed_memory (MemoryConfig.keep_freed_memory)
    it comes from glibc's heap, whose freed memory stays with the process (RSS does not fall), for
    later blocks to reuse. Linux with glibc only."""
    import os
    import subprocess
    import sys
    script = glibc_script(
        "if sys.argv[1] == 'on':",
        "    memory.keep_freed_memory()",
        "x = torch.ones(16 * 96, 49152)",
        "before = rss()",
        "del x",
        "print(before - rss())")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(memory.__file__)))
    freed = {}
    for flag in ("off", "on"):
        out = subprocess.run([sys.executable, "-c", script, flag], env=env, text=True,
                             capture_output=True, check=True)
        freed[flag] = float(out.stdout.split()[-1])
    assert freed["off"] > 250 and abs(freed["on"]) < 10, freed


def test_return_and_keep_freed_memory_are_refused_together():
    with pytest.raises(ValueError, match="opposites"):
        memory.MemoryConfig(return_freed_memory=True, keep_freed_memory=True)


def saved_bytes(model, b):
    """Bytes autograd keeps for backward in one forward: each distinct storage once, parameters
    left out (torch.autograd.graph.saved_tensors_hooks)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            kept[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        grpo.token_logprobs(model, *inputs(b), 1.0, False)
    return sum(kept.values())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lean_activations_keep_fewer_tensors_and_give_the_same_gradients(arch):
    """memory.lean_activations reroutes every SwiGLU MLP (2 layers) and RMSNorm (2 a layer and
    the final one). The forward is the same arithmetic, so the log-probs are equal bit for bit,
    and the gradients agree to float rounding. Autograd keeps exactly 2 (tokens, i) tensors fewer
    per MLP (silu(g) and the product) and 1 (tokens, h) per norm (the normalised x), in fp32.
    Under bf16 autocast, against the fp32 gradients, the error stays within bf16's, like the plain
    code's. LoRA-wrapped MLPs are left alone; their norms are not."""
    tok = tiny_world.char_tokenizer()
    model = model_for(arch, tok)
    b = batch_of(model, tok)
    plain_kept, want = saved_bytes(model, b), logp_and_grads(model, b, 0, 0.7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain16 = logp_and_grads(model, b, 0, 0.7)
    lean = copy.deepcopy(model)
    assert memory.lean_activations(lean) == 2 + 5 and memory.lean_activations(model, False) == 0
    lean_kept, got = saved_bytes(lean, b), logp_and_grads(lean, b, 0, 0.7)
    tokens = b["prompt_ids"].numel() + b["completion_ids"].numel()
    c = model.config
    assert plain_kept - lean_kept == 4 * tokens * (2 * 2 * c.intermediate_size + 5 * c.hidden_size)
    assert torch.equal(got[0], want[0])
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-5, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got16 = logp_and_grads(lean, b, 0, 0.7)
    assert torch.equal(got16[0], plain16[0])
    err_plain, err_lean = relative_errors(plain16[2], want[2]), relative_errors(got16[2], want[2])
    for name in want[2]:
        assert err_lean[name] < max(2 * err_plain[name], 0.02), name
    if arch == "llama" and __import__("importlib").util.find_spec("peft"):
        from machinery import lora
        assert memory.lean_activations(lora.add_adapters(copy.deepcopy(model), r=4, alpha=8)) == 5

