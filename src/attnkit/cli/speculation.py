"""The speculative-decoding options of ``generate`` and ``bench``, in one place: the flags, and the
refusal of draft options given without ``--speculate``."""

from __future__ import annotations

import argparse

from attnkit.errors import AttnkitError
from attnkit.speculative import DRAFT_KINDS
from attnkit.speculative.int8_weights import DRAFT_WEIGHTS
from attnkit.validate import fraction, whole


def add_speculation_options(parser: argparse.ArgumentParser) -> None:
    """The speculation flags (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
    Decoding", arXiv:2211.17192): lossless, the output is distributed as without them."""
    g = parser.add_argument_group("speculative decoding (lossless: output distributed as without it)")
    g.add_argument("--speculate", choices=DRAFT_KINDS, default=None,
                   help="draft source; the target verifies with full attention")
    g.add_argument("--gamma", type=int, default=4, help="drafted tokens per target forward")
    g.add_argument("--adaptive-gamma", action="store_true", help="adapt gamma to the observed acceptance")
    g.add_argument("--draft", default=None, metavar="SPEC",
                   help="draft_model: model spec (default tiny-draft); prompt_lookup: max_ngram=N,min_ngram=M; "
                        "self: the draft cache's method (default streaming:budget_tokens=256,sinks=4)")
    g.add_argument("--draft-lookup", action="store_true",
                   help="draft_model/self: the draft verifies prompt-lookup guesses several tokens per forward "
                        "(TriForce's hierarchy; needs a draft cache that only appends: self defaults to "
                        "snapkv:budget_tokens=512)")
    g.add_argument("--draft-confidence", type=float, default=None, metavar="P",
                   help="draft_model/self: stop drafting after a token the draft gave less than probability P "
                        "(gamma becomes a cap; e.g. 0.3)")
    g.add_argument("--draft-weights", choices=DRAFT_WEIGHTS, default=None,
                   help="draft_model/self: int8 drafts with weight-only int8 copies of the model's linear layers "
                        "(the target verifies with its own); same (default): the model's own weights")


def check_speculation_options(args: argparse.Namespace) -> None:
    """The draft options mean nothing without --speculate: refuse them rather than ignore them; the numbers
    are checked before any model loads."""
    given = [flag for flag, value in (("--draft", args.draft is not None), ("--draft-lookup", args.draft_lookup),
                                      ("--draft-confidence", args.draft_confidence is not None),
                                      ("--draft-weights", args.draft_weights is not None)) if value]
    if given and not args.speculate:
        what = "is an option" if len(given) == 1 else "are options"
        raise AttnkitError(f"{', '.join(given)} {what} of speculative decoding's draft; add --speculate "
                           f"{'|'.join(DRAFT_KINDS)}")
    whole("--gamma", args.gamma, minimum=1)
    if args.draft_confidence is not None:
        fraction("--draft-confidence", args.draft_confidence, allow_one=False)
