"""The byte-level tokenizer of the random test models (the bundled models have their own BPE tokenizer).

Every UTF-8 byte is one token (a byte-level BPE with no merges), plus three special tokens.
Token counts therefore equal byte counts, which keeps the synthetic long-context tasks exact
in length, and nothing has to be downloaded to build it.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD = "<s>", "</s>", "<pad>"


def _byte_symbols() -> list[str]:
    """The printable stand-in character of each byte 0..255 used by byte-level pre-tokenizers."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    assert set(symbols.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    return [symbols[b] for b in range(256)]


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """Build the 259-token byte tokenizer (ids 0-2 special, byte b is id b + 3); encode prepends BOS."""
    vocab = {BOS: 0, EOS: 1, PAD: 2}
    for symbol in _byte_symbols():
        vocab[symbol] = len(vocab)  # byte b -> id b + 3
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    # Like Llama tokenizers, encoding a text starts it with BOS (a stable first token: the
    # attention sink StreamingLLM relies on).
    core.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD
    )
    return tokenizer
