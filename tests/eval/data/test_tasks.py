"""The evaluation tasks (attnkit.eval.data.tasks): prompts are the asked length in tokens, with the byte tokenizer
and with a subword (BPE) tokenizer, whose lines and runs of spaces do not have a fixed length. Needle tasks are
assembled in token space and decoded, so a subword tokenizer may merge a token across a seam when the
text is encoded again; kv_retrieval is built as text and measured, so it is exact with both."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from attnkit.eval.data import corpus
from attnkit.eval.data.tasks import TASKS
from attnkit.tokenizer import BOS, EOS, PAD, build_byte_tokenizer


def small_bpe() -> PreTrainedTokenizerFast:
    """A 600-token byte-level BPE with single digits, trained on some training-split code (like model v2's)."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                  pre_tokenizers.ByteLevel(add_prefix_space=False)])
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=[BOS, EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator([corpus.haystack_text("train")[:200_000]], trainer=trainer)
    core.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD)


TOKENIZERS = {"byte": build_byte_tokenizer(), "bpe": small_bpe()}


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
@pytest.mark.parametrize("name", ["kv_retrieval", "passkey", "variable_tracking", "code_completion"])
def test_prompts_are_exactly_the_asked_length(tokenizer, name):
    tok = TOKENIZERS[tokenizer]
    for length in (512, 1024, 2048):
        for seed, depth in ((0, 0.0), (1, 0.5), (2, 1.0)):
            sample = TASKS[name].make(tok, length, depth, seed)
            n = len(tok.encode(sample.prompt))
            if tokenizer == "byte" or name == "kv_retrieval":
                assert n == length, (length, seed)
            else:
                assert abs(n - length) <= 10, (n, length, seed)  # at most one per seam: variable_tracking has 10
            assert sample.answers[0] in sample.prompt or name == "code_completion"


def test_kv_retrieval_asks_for_a_key_that_is_in_the_object():
    tok = TOKENIZERS["bpe"]
    for depth in (0.0, 0.3, 1.0):
        sample = TASKS["kv_retrieval"].make(tok, 1024, depth, 5)
        key, value = sample.meta["key"], sample.answers[0]
        assert f'"{key}": "{value}",\n' in sample.prompt
        assert sample.prompt.count(f'"{key}"') == 2  # once in the object, once in the question
