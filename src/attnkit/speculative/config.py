"""How speculative decoding is configured: one frozen :class:`SpeculativeConfig`, validated once.

Every option of the draft and of the loop is a field of :class:`SpeculativeConfig`, with its help text
and its check in the field's metadata (``help``, ``check``; ``key`` where its name in a recipe's
``decode:`` mapping and on the command line differs: ``source`` is ``speculate`` there). The command
line builds its flags from the fields, a recipe's ``decode:`` mapping is read with
:meth:`SpeculativeConfig.from_mapping` and written with :meth:`SpeculativeConfig.to_mapping`, and
:func:`attnkit.speculative.speculative_generate` takes the field names as keyword options. The rules
that span fields (an option of a model draft given to prompt lookup, a draft spec of the wrong kind
for its source) are checked here, once. Adding a draft option touches this file and the code that uses
the option, nothing else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from attnkit.errors import AttnkitError
from attnkit.methods.base import Method
from attnkit.methods.full import Full
from attnkit.methods.spec import parse_method_spec
from attnkit.model import LoadedModel
from attnkit.speculative.draft import DEFAULT_VERIFY_COST, DraftSource
from attnkit.speculative.int8_weights import DRAFT_WEIGHTS, check_draft_weights
from attnkit.speculative.model_draft import check_confidence, check_lookup_cache
from attnkit.speculative.prompt_lookup import PromptLookupDraft
from attnkit.validate import flag, number, optional_whole, whole

DRAFT_KINDS = ("draft_model", "prompt_lookup", "self")
MODEL_KINDS = ("draft_model", "self")  # the sources that run a model (its options: scope "model")
DEFAULT_SELF_METHOD = "streaming:budget_tokens=256,sinks=4"
DEFAULT_SELF_LOOKUP_METHOD = "snapkv:budget_tokens=512"  # with lookup guessing: a cache that only appends
DEFAULT_DRAFT_MODEL = "tiny-draft"


# ---- what a draft spec means, per source ------------------------------------------------------------
def self_draft_method(spec: str | Method | None, lookup: bool = False) -> Method:
    """The draft cache's method of self-speculation: `spec` (a method spec or a Method), by default
    :data:`DEFAULT_SELF_METHOD` (:data:`DEFAULT_SELF_LOOKUP_METHOD` with lookup guessing). Full attention
    is refused: that is the target itself."""
    if isinstance(spec, Method):
        method = spec
    else:
        method = parse_method_spec(spec or (DEFAULT_SELF_LOOKUP_METHOD if lookup else DEFAULT_SELF_METHOD))
    if isinstance(method, Full):
        raise AttnkitError("self-speculation drafts with a compressed cache: give an eviction method such as "
                           f"{DEFAULT_SELF_METHOD!r}, not {method.describe()!r} (that is the target itself)")
    return method


def draft_model_spec(spec: str | None) -> tuple[str, str | Method]:
    """``(model spec, method)`` of a draft model spec ``MODEL[@METHOD-SPEC]`` (default
    :data:`DEFAULT_DRAFT_MODEL`, method ``full``): the suffix gives the draft its own attention method
    (``tiny-draft@window:window=256``)."""
    model_spec, at, method_spec = (spec or DEFAULT_DRAFT_MODEL).partition("@")
    return model_spec, parse_method_spec(method_spec) if at else "full"


# ---- the checks of single fields: (name, value) -> value ----------------------------------------------
def _source(name: str, value):
    if isinstance(value, DraftSource) or (isinstance(value, str) and value in DRAFT_KINDS):
        return value
    raise AttnkitError(f"unknown draft source {value!r}; {name} must be one of {', '.join(DRAFT_KINDS)} "
                       f"(or a DraftSource instance)")


def _draft(name: str, value):
    if value is None or isinstance(value, (str, LoadedModel, Method)):
        return value
    raise AttnkitError(f"{name} must be a spec string, a LoadedModel (draft_model) or a Method (self), got "
                       f"{type(value).__name__}")


def _draft_lookup(name: str, value):
    if value is None or isinstance(value, bool):
        return bool(value)
    what = f"{name} must be true or false or a prompt_lookup spec such as 'max_ngram=3'"
    if not isinstance(value, str):
        raise AttnkitError(f"{what}, got {value!r}")
    try:
        PromptLookupDraft.from_spec(value)
    except AttnkitError as e:
        raise AttnkitError(f"{what}, got {value!r} ({e})") from None
    return value


def _help(text: str, check, key: str | None = None, scope: str = "loop", **arg) -> dict:
    """A field's metadata. `scope`: ``loop`` (the speculative loop), ``draft`` (the draft source's
    construction) or ``model`` (a model draft's only: draft_model and self); `arg`: how its command-line
    flag parses (argparse keywords besides help and default)."""
    return {"help": text, "check": check, "key": key, "scope": scope, "arg": arg}


# ---- the config -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding's options (module docstring). `source` may also be a :class:`DraftSource`
    built by hand; the draft options (scope ``draft`` and ``model``) then stay unset."""

    source: str | DraftSource = field(metadata=_help(
        "draft source: draft_model, prompt_lookup or self; the target verifies with full attention",
        _source, key="speculate", scope="draft", choices=DRAFT_KINDS))
    gamma: int = field(default=4, metadata=_help(
        "drafted tokens per target forward (default 4)", lambda name, v: whole(name, v, 1), type=int))
    adaptive_gamma: bool = field(default=False, metadata=_help(
        "adapt gamma to the observed acceptance", flag, action="store_true"))
    max_gamma: int | None = field(default=None, metadata=_help(
        "the largest gamma adaptive gamma may choose (default max(2 gamma, 8))",
        lambda name, v: optional_whole(name, v, 1), type=int))
    verify_cost: float = field(default=DEFAULT_VERIFY_COST, metadata=_help(
        "extra cost of one more verified token relative to a one-token target step, used only to size "
        "proposals (about 0 where decoding is memory-bound, e.g. a GPU)", lambda name, v: number(name, v, 0),
        type=float))
    draft: str | LoadedModel | Method | None = field(default=None, metadata=_help(
        f"draft_model: model spec (default {DEFAULT_DRAFT_MODEL}); prompt_lookup: max_ngram=N,min_ngram=M; "
        f"self: the draft cache's method (default {DEFAULT_SELF_METHOD})", _draft, scope="draft", metavar="SPEC"))
    draft_lookup: bool | str = field(default=False, metadata=_help(
        "draft_model/self: the draft verifies prompt-lookup guesses several tokens per forward (TriForce's "
        f"hierarchy; needs a draft cache that only appends: self defaults to {DEFAULT_SELF_LOOKUP_METHOD})",
        _draft_lookup, scope="model", action="store_true"))
    draft_confidence: float | None = field(default=None, metadata=_help(
        "draft_model/self: stop drafting after a token the draft gave less than this probability (gamma "
        "becomes a cap; e.g. 0.3)", check_confidence, scope="model", type=float, metavar="P"))
    draft_weights: str = field(default="same", metadata=_help(
        f"draft_model/self: {' or '.join(DRAFT_WEIGHTS)}; int8 drafts with weight-only int8 copies of the "
        "model's linear layers (the target verifies with its own); same: the model's own weights",
        lambda name, v: check_draft_weights(v, name), scope="model", choices=DRAFT_WEIGHTS))

    def __post_init__(self):
        for f in fields(self):
            object.__setattr__(self, f.name, f.metadata["check"](f.name, getattr(self, f.name)))
        if self.max_gamma is not None and self.max_gamma < self.gamma:
            raise AttnkitError(f"max_gamma must be a whole number >= gamma ({self.gamma}), got {self.max_gamma!r}")
        self._check_draft_options()

    def _check_draft_options(self) -> None:
        """The rules between the source and the draft options."""
        source, draft = self.source, self.draft
        if isinstance(source, DraftSource):
            given = [f.name for f in fields(self) if f.metadata["scope"] != "loop" and f.name != "source"
                     and getattr(self, f.name) != f.default]
            if given:
                raise AttnkitError(f"{', '.join(given)} given with a DraftSource instance; configure the instance "
                                   f"instead")
            return
        if source not in MODEL_KINDS:
            for f in fields(self):
                value = getattr(self, f.name)
                if f.metadata["scope"] == "model" and value != f.default:
                    raise AttnkitError(f"{f.name}={value!r} is an option of a model draft "
                                       f"({', '.join(MODEL_KINDS)}); {source!r} runs no model")
        lookup = self.draft_lookup is not False
        if source == "prompt_lookup":
            PromptLookupDraft.from_spec(draft)  # refuses a non-string draft, checks the options
        elif source == "self":
            if isinstance(draft, LoadedModel):
                raise AttnkitError("self-speculation drafts with the target itself: draft is the draft cache's "
                                   "method spec or a Method, not a model")
            method = self_draft_method(draft, lookup)
            if lookup:
                check_lookup_cache(method)
        elif source == "draft_model":
            if isinstance(draft, Method):
                raise AttnkitError(f"draft_model drafts with a second model: draft is a model spec or a LoadedModel, "
                                   f"not the method {draft.describe()!r}")
            method = "full" if isinstance(draft, LoadedModel) else draft_model_spec(draft)[1]
            if lookup and isinstance(method, Method):
                check_lookup_cache(method)

    # ---- as a recipe's ``decode:`` mapping ------------------------------------------------------------
    @staticmethod
    def mapping_keys() -> tuple[str, ...]:
        """The keys of a ``decode:`` mapping (``speculate`` for the source), in field order."""
        return tuple(f.metadata["key"] or f.name for f in fields(SpeculativeConfig))

    @classmethod
    def from_mapping(cls, mapping, source: str = "recipe") -> SpeculativeConfig:
        """A config from a recipe's ``decode:`` mapping (e.g. ``{"speculate": "self", "gamma": 4}``);
        `source` names where it came from in errors (a file). Its draft is a spec string."""
        if not isinstance(mapping, Mapping):
            raise AttnkitError(f"{source}: 'decode' must be a mapping like {{'speculate': 'prompt_lookup', "
                               f"'gamma': 4}}")
        keys = cls.mapping_keys()
        unknown = sorted(set(mapping) - set(keys))
        if unknown:
            raise AttnkitError(f"{source}: decode has no key {', '.join(map(str, unknown))}; allowed: {', '.join(keys)}")
        if mapping.get("draft") is not None and not isinstance(mapping["draft"], str):
            raise AttnkitError(f"{source}: decode.draft must be a spec string (as --draft takes), got "
                               f"{mapping['draft']!r}")
        values = {}
        for f in fields(cls):
            key = f.metadata["key"] or f.name
            if key in mapping or f.name == "source":
                try:
                    values[f.name] = f.metadata["check"](f"decode.{key}", mapping.get(key))
                except AttnkitError as e:
                    raise AttnkitError(f"{source}: {e}") from None
        try:
            return cls(**values)
        except AttnkitError as e:
            raise AttnkitError(f"{source}: decode: {e}") from None

    def to_mapping(self) -> dict:
        """The ``decode:`` mapping :meth:`from_mapping` reads back: the source and every option that is
        not at its default. A config holding a loaded model, a Method or a DraftSource has no mapping."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if not (value is None or isinstance(value, (str, bool, int, float))):
                raise AttnkitError(f"{f.name} is a {type(value).__name__}, which a decode mapping cannot hold; "
                                   f"give it as a spec string")
            if f.name == "source" or value != f.default:
                out[f.metadata["key"] or f.name] = value
        return out

    def drafting_with(self, source: DraftSource) -> SpeculativeConfig:
        """The same loop options with an already built draft source (the draft options left unset)."""
        return dataclasses.replace(self, source=source, **{f.name: f.default for f in fields(self)
                                                           if f.metadata["scope"] != "loop" and f.name != "source"})


# ---- as command-line flags ---------------------------------------------------------------------------
def command_line_options() -> list[tuple[str, dict]]:
    """``(flag, argparse keywords)`` for every field (``--speculate``, ``--gamma``, ``--draft-lookup``...):
    ``group.add_argument(flag, **keywords)``. The parsed value lands in ``args.<key>`` (``speculate`` for
    the source); every default is None, so a flag not given leaves its field at the config's default."""
    out = []
    for f in fields(SpeculativeConfig):
        key = f.metadata["key"] or f.name
        out.append(("--" + key.replace("_", "-"), dict(f.metadata["arg"], dest=key, default=None,
                                                        help=f.metadata["help"])))
    return out


def from_arguments(args) -> SpeculativeConfig | None:
    """The config of parsed command-line flags (:func:`command_line_options`); None without
    ``--speculate``, when any other of these flags is refused rather than ignored."""
    given = {}
    for f in fields(SpeculativeConfig):
        key = f.metadata["key"] or f.name
        value = getattr(args, key, None)
        if value is not None and value is not False:
            given[f.name] = f.metadata["check"]("--" + key.replace("_", "-"), value)  # errors name the flag
    source = given.pop("source", None)
    if source is None:
        if given:
            flags = ", ".join(flag for flag, kw in command_line_options() if kw["dest"] in given)
            what = "is an option" if len(given) == 1 else "are options"
            raise AttnkitError(f"{flags} {what} of speculative decoding; add --speculate {'|'.join(DRAFT_KINDS)}")
        return None
    return SpeculativeConfig(source, **given)


def speculative_config(config: SpeculativeConfig | str | DraftSource = "prompt_lookup",
                       **options) -> SpeculativeConfig:
    """A :class:`SpeculativeConfig` from a config, a source name or a DraftSource, with `options` (field
    names) set on it: what :func:`attnkit.speculative.speculative_generate` and
    :func:`attnkit.speculative.factory.make_draft` take."""
    names = [f.name for f in fields(SpeculativeConfig) if f.name != "source"]
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise AttnkitError(f"no speculative decoding option {', '.join(unknown)}; options: {', '.join(names)}")
    if isinstance(config, SpeculativeConfig):
        return dataclasses.replace(config, **options) if options else config
    return SpeculativeConfig(config, **options)
