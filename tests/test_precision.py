"""precision.py under CPU bf16 autocast, against the plain fp32 path: π_ref made by
bf16_reference scores bit for bit what the fp32 policy scores (step 1's KL is exactly 0), and
fp32_logits' output layer gives fp32 logits in every scorer (the plain one, the engine's shared
one and memory's chunked one) and survives the copy that makes π_ref.

Needs: torch and transformers (tiny random models built in memory). CPU, offline, ~20 s.
"""

import copy

import pytest
import torch

import grpo
from machinery import engine, memory, precision
from recipe import tiny_world
from test_memory import batch_of, inputs, model_for

AUTOCAST = dict(device_type="cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("fp32_logits", [False, True])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_a_bf16_reference_scores_exactly_what_the_policy_scores_under_autocast(arch, fp32_logits):
    """bf16_reference keeps π_ref's Linear weights in bf16 and the rest fp32: under bf16 autocast
    its log-probs equal the fp32 policy's bit for bit, so step 1's KL is 0. The bug it catches:
    casting the whole copy to bf16 (train_gsm8k.py --bf16 did), whose bf16 embeddings and norms
    make π_ref another function; that copy is shown to differ here."""
    tok = tiny_world.char_tokenizer()
    policy = precision.fp32_logits(model_for(arch, tok), fp32_logits)
    b = batch_of(policy, tok)
    ref = precision.bf16_reference(grpo.make_reference(policy))
    whole = grpo.make_reference(policy).to(torch.bfloat16)
    assert ref.get_input_embeddings().weight.dtype == torch.float32
    bf16 = [p for p in ref.parameters() if p.dtype == torch.bfloat16]
    assert sum(p.numel() for p in bf16) > 0.5 * sum(p.numel() for p in ref.parameters())
    with torch.no_grad(), torch.autocast(**AUTOCAST):
        want, got, off = (grpo.token_logprobs(m, *inputs(b)) for m in (policy, ref, whole))
    assert torch.equal(want, got)
    assert not torch.equal(want, off)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fp32_logits_are_fp32_in_every_scorer_and_in_the_copy(arch):
    """Under bf16 autocast the FP32Logits output layer gives exactly the fp32 product of the
    hidden state, where the plain layer's logits are bf16; grpo.token_logprobs, engine's shared
    scorer and memory's chunked scorer then agree within fp32 rounding, not bf16's; and
    make_reference's copy keeps the layer. The bug it catches: a scorer (the chunked one writes
    its own output layer) that rounds the logits to bf16 anyway."""
    tok = tiny_world.char_tokenizer()
    policy = model_for(arch, tok)
    b = batch_of(policy, tok)
    x = torch.randn(5, policy.config.hidden_size)
    with torch.no_grad():
        exact = x @ policy.get_output_embeddings().weight.T                           # fp32
    with torch.no_grad(), torch.autocast(**AUTOCAST):
        assert policy.get_output_embeddings()(x).dtype == torch.bfloat16
        plain = grpo.token_logprobs(policy, *inputs(b))
        plain_shared = engine.shared_token_logprobs(policy, *inputs(b))
        precision.fp32_logits(policy)
        head = policy.get_output_embeddings()
        assert torch.equal(head(x), exact)
        scores = [grpo.token_logprobs(policy, *inputs(b)),
                  engine.shared_token_logprobs(policy, *inputs(b)),
                  memory.chunked_scorer(7)(policy, *inputs(b))]
    mask = inputs(b)[3].bool()
    # The chunked scorer runs the same backbone pass as token_logprobs, so only the output layer
    # could differ: bf16 logits would be ~1e-3 apart, fp32 ones agree to rounding.
    torch.testing.assert_close(scores[2][mask], scores[0][mask], atol=2e-6, rtol=0)
    assert (plain - scores[0])[mask].abs().max() > 1e-4
    # The shared scorer runs the prompt apart, whose bf16 hidden states differ from the whole
    # sequence's in their last bits, so it is held to itself: the same pass with the plain bf16
    # output layer must differ from it by bf16's rounding. (A shared scorer that rounded its
    # logits to bf16 anyway would give the plain numbers again.)
    assert (plain_shared - scores[1])[mask].abs().max() > 1e-4
    torch.testing.assert_close(scores[1][mask], scores[0][mask], atol=2e-2, rtol=0)
    assert type(copy.deepcopy(policy).get_output_embeddings()) is precision.FP32Logits
