"""The tokenizer of model v2: a small byte-level BPE trained on the training corpus (issue #29).

    python training/tokenizer_v2.py --measure          # chars/token on held-out text for several settings
    python training/tokenizer_v2.py --out DIR           # train the configured one and save it to DIR

Byte-level BPE (Sennrich et al. 2016, "Neural Machine Translation of Rare Words with Subword Units";
GPT-2's byte-level variant) over the 256 byte symbols, so any text encodes. Digits are split into single
tokens before merging (as in Llama and PaLM) so that numbers, the values the retrieval tasks ask for, are
sequences of digit tokens rather than opaque ids the model would have to memorise one by one. Special
tokens are those of :mod:`attnkit.tokenizer` at the same ids (<s> 0, </s> 1, <pad> 2), and encoding
prepends <s> like the byte tokenizer does.

Training text: the training split only (standard-library code without the documentation topics file, the
training half of the documentation topics, generated grammar prose and training-split task samples), so
the held-out text it is measured on is never seen. Training is deterministic for a given corpus.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from attnkit.eval.data import corpus
from attnkit.eval.data import retrieval_data as R
from attnkit.eval.data import retrieval_templates as T
from attnkit.tokenizer import BOS, EOS, PAD, build_byte_tokenizer


def training_texts(n_samples: int = 400) -> Iterator[str]:
    """The training corpus, in chunks of lines."""
    byte_tok = build_byte_tokenizer()
    code = byte_tok.decode(list(R.filler_ids(byte_tok, "code", "train")))
    for text in (code, T.doc_prose("train")):
        lines = text.split("\n")
        for i in range(0, len(lines), 200):
            yield "\n".join(lines[i : i + 200]) + "\n"
    rng = random.Random("tokenizer-v2")
    yield R.grammar_prose(rng, 2000)
    for i in range(n_samples):
        task = list(R.GENERATORS)[i % len(R.GENERATORS)]
        ex = R.example(task, byte_tok, 1024, rng, "train")
        yield byte_tok.decode(list(ex.ids))


def pre_tokenizer(individual_digits: bool = True, isolated_newlines: bool = False):
    """How text is cut before the merges apply (no merge crosses a cut): GPT-2's byte-level regex, digits one
    by one, and with `isolated_newlines` every newline a piece of its own. Without it the regex joins a newline
    and the next line's indentation into one token ("\\n" + spaces), so a prompt that ends at a line break
    (code completion) ends in a bare newline token the model rarely saw before indentation."""
    parts = [pre_tokenizers.Split("\n", behavior="isolated")] if isolated_newlines else []
    parts += [pre_tokenizers.Digits(individual_digits=True)] if individual_digits else []
    parts.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    return pre_tokenizers.Sequence(parts) if len(parts) > 1 else parts[0]


def train_bpe(vocab_size: int = 4096, individual_digits: bool = True, texts=None,
              isolated_newlines: bool = False) -> PreTrainedTokenizerFast:
    """Train the BPE; returns it wrapped for transformers (encode prepends <s>)."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizer(individual_digits, isolated_newlines)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    core.train_from_iterator(texts if texts is not None else training_texts(), trainer=trainer)
    core.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    assert [core.token_to_id(t) for t in (BOS, EOS, PAD)] == [0, 1, 2]
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD)


def load_tokenizer(run_dir: Path, config: dict) -> PreTrainedTokenizerFast:
    """A training run's tokenizer, trained on the run's first start. `isolated_newlines` in the config cuts every
    newline into a piece of its own, also for a tokenizer taken over from another run: the vocabulary (and so the
    weights) stay, and the tokens joining a newline with indentation are no longer produced."""
    path = run_dir / "tokenizer"
    tc = config["tokenizer"]
    if not (path / "tokenizer.json").exists():
        train_bpe(tc["vocab_size"], tc["individual_digits"], isolated_newlines=tc.get("isolated_newlines", False)
                  ).save_pretrained(path)
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    if tc.get("isolated_newlines"):
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizer(tc["individual_digits"], isolated_newlines=True)
    return tok


def heldout_text() -> str:
    return corpus.haystack_text("heldout") + "\n" + T.doc_prose("eval")


def measure() -> None:
    texts = list(training_texts())
    held = heldout_text()
    numbers = " ".join(str(random.Random(i).randrange(10**7)) for i in range(2000))
    rows = [("byte-level (259)", build_byte_tokenizer())]
    for size, digits in ((1024, True), (2048, True), (4096, True), (2048, False)):
        rows.append((f"bpe {size}{' digits split' if digits else ''}", train_bpe(size, digits, texts)))
    code, prose = corpus.haystack_text("heldout"), T.doc_prose("eval")
    print(f"held-out text: {len(code)} chars of code, {len(prose)} of documentation prose")
    for name, tok in rows:
        per = {k: len(t) / len(tok.encode(t, add_special_tokens=False))
               for k, t in (("all", held), ("code", code), ("prose", prose), ("numbers", numbers))}
        print(f"{name:24s} chars/token all {per['all']:.2f}  code {per['code']:.2f}  prose {per['prose']:.2f}  "
              f"numbers {per['numbers']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measure", action="store_true")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.measure:
        measure()
    if args.out:
        train_bpe(args.vocab_size).save_pretrained(args.out)


if __name__ == "__main__":
    main()
