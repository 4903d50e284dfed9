"""
tiny_world.py -- the offline stand-in for "a pretrained LM": a character tokenizer and a tiny causal LM.

Nothing here downloads anything. The tokenizer is a real `transformers.PreTrainedTokenizerFast`
(so `save_pretrained` / `from_pretrained` work) and the model is a real `LlamaForCausalLM`,
so grpo.py runs on them exactly as it runs on a hub model.
"""

from __future__ import annotations

import string

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
# WHY: printable ASCII plus newline covers GSM8K-style text; anything else maps to <unk>.
DEFAULT_CHARS = "\n" + "".join(c for c in string.printable if c.isprintable())


def char_tokenizer(chars: str = DEFAULT_CHARS) -> PreTrainedTokenizerFast:
    """One token per character, plus <pad> <s> </s> <unk>. The pad token is distinct from EOS.

    WHY distinct: if pad == eos, masking pads would also mask the real EOS and the model would
    never be credited for stopping.
    """
    specials = [PAD, BOS, EOS, UNK]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(set(chars)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every char alone
    tok.decoder = decoders.Fuse()                                                    # join with no spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                   unk_token=UNK)


def tiny_llama(tokenizer, hidden: int = 64, layers: int = 2, heads: int = 4, ffn: int | None = None,
               max_positions: int = 512, seed: int = 0) -> LlamaForCausalLM:
    """A randomly initialised Llama with tied embeddings; hidden=128, layers=4 gives about 1 M parameters."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=ffn or 4 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=max_positions, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    # NOTE: a fresh model's generation_config has no special ids; set them so generate() knows when to stop.
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model
