"""The contract between the speculative loop and a draft source (:class:`DraftSource`).

A source proposes up to ``gamma`` tokens after the current context, with the distributions it drew
them from (``p`` in Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding", arXiv 2211.17192, section 2.3) or ``None`` for a deterministic draft (a point mass), and is
told after verification how many of them the target accepted (:meth:`DraftSource.feedback`), so it
can roll its own state back. Losslessness never depends on what a source proposes: the acceptance
rule only needs the ``p`` the proposal was really drawn from. What a source proposes only decides the
speed.

The sources: :class:`attnkit.speculative.model_draft.ModelDraft` (a second model, or the target itself
over a compressed cache) and :class:`attnkit.speculative.prompt_lookup.PromptLookupDraft` (n-gram
lookup, no model); :func:`attnkit.speculative.factory.make_draft` builds one from a
:class:`attnkit.speculative.config.SpeculativeConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit.errors import AttnkitError
from attnkit.model import LoadedModel
from attnkit.sampling import SamplingConfig
from attnkit.session import Session

# Extra cost of each drafted token in the target's verification forward, relative to a one-token target
# step (the forward over gamma + 1 tokens costs about 1 + gamma * this). Where the step is memory-bound
# (a GPU) this is about 0; where it is compute-bound (a CPU) the extra rows cost matmul and attention
# compute. Used only to size proposals (adaptive gamma, prompt lookup's own lengths).
DEFAULT_VERIFY_COST = 0.1


@dataclass
class Proposal:
    """Drafted tokens ``[g]`` (``g <= gamma``, possibly 0) and the distributions ``[g, V]`` they were
    drawn from; ``probs=None`` means a deterministic draft (point mass on each token)."""

    tokens: list[int]
    probs: torch.Tensor | None = None


@dataclass
class DraftRun:
    """What a source learns when a generation starts."""

    target: LoadedModel
    prompt_ids: torch.Tensor  # [n]
    max_new_tokens: int
    sampling: SamplingConfig
    generator: torch.Generator | None
    chunk_size: int | None = None
    adaptive: bool = False  # gamma adaptive: a source that sizes its own proposals may propose fewer
    verify_cost: float = DEFAULT_VERIFY_COST  # cost of one more verified token / a 1-token target step


class DraftSource:
    """The interface. ``start`` once per generation, then per round ``propose`` and ``feedback``."""

    kind: str = "base"
    forwards: int = 0  # model forwards run while proposing in the current generation (0: no model)

    def start(self, run: DraftRun) -> Session | None:
        """Prepare for a generation. May return a session to be filled by the target's prompt pass
        (the source then owns a cache built from the target's own forward); None otherwise."""
        return None

    def propose(self, context: list[int], gamma: int) -> Proposal:
        """Up to `gamma` (>= 1) tokens to follow `context` (prompt + everything generated so far)."""
        raise NotImplementedError

    def feedback(self, accepted: int) -> None:
        """The target accepted the first `accepted` tokens of the last proposal."""

    def relative_cost(self) -> float:
        """Estimated cost of drafting one token relative to one target forward (for adaptive gamma)."""
        return 0.0

    def weight_bytes(self) -> int:
        """Bytes of weights the source holds besides the target's (a draft model's, int8 copies)."""
        return 0

    def sizes_own_proposals(self) -> bool:
        """Whether the source chooses how many tokens to propose (gamma is then only a cap), instead of
        the loop's :class:`attnkit.speculative.gamma.GammaController`."""
        return False

    def fork(self) -> DraftSource:
        """A fresh source with the same settings and none of this one's state, for another sequence of a
        batch (each sequence drafts with its own source: its own cache, index, statistics). A source
        that does not say how to copy itself cannot draft for a batch."""
        raise AttnkitError(f"a batch of prompts needs one draft source per prompt, and the {type(self).__name__} "
                           f"source ({self.describe()}) has no fork() to make them; give one prompt, or name the "
                           f"source (draft_model, prompt_lookup, self)")

    def describe(self) -> str:
        return self.kind
