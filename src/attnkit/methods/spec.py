"""The registry of methods and the method-spec grammar the Python API, recipes and the CLI share.

A spec names a registered method and its parameters: ``"window:window=1024"``,
``"snapkv:budget=0.3,window=32"``; ``"PREFILL+CACHE"`` joins two specs into the ``compose`` method
(``"minference+snapkv:budget=0.3"``). A quantizer (a method whose class says ``quantizer = True``: ``kivi``)
may come last, once, and then holds the cache of everything before it: ``"snapkv:budget=0.3+kivi:bits=4"``,
``"minference+snapkv:budget=0.3+kivi"`` (``+`` reads "and then"; the quantizer is recognised by its name, so
the grammar stays one list of specs joined by ``+``). Values in a spec are strings, converted here to each
dataclass field's type (a per-layer list is written ``512/256/256``). Python callers pass typed values.
"""

from __future__ import annotations

import re
import types
import typing
from typing import Any

from attnkit.errors import AttnkitError

METHODS: dict[str, type] = {}

METHOD_KEYS = ("method", "params")


def register(cls: type) -> type:
    """Class decorator: add a method dataclass to the registry under ``cls.name``."""
    if cls.name in METHODS:
        raise ValueError(f"method {cls.name!r} registered twice")
    METHODS[cls.name] = cls
    return cls


def method_class(name: str, source: str = "method") -> type:
    """The registered class of `name`, or a one-line error listing the registered names."""
    if name not in METHODS:
        raise AttnkitError(f"{source}: unknown method {name!r}; available: {', '.join(sorted(METHODS))}")
    return METHODS[name]


def coerce(name: str, method: str, hint, raw):
    """Turn a spec's string `raw` into the dataclass field's type `hint`, with a clear error; values that
    are not strings (Python callers, recipe files) pass through to the method's own validation."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if not isinstance(raw, str):
        return raw
    if raw.lower() in ("none", "null") and type(None) in options:
        return None
    for typ in options:
        if typ is type(None):
            continue
        try:
            if typ is bool:
                if raw.lower() in ("1", "true", "yes"):
                    return True
                if raw.lower() in ("0", "false", "no"):
                    return False
                raise ValueError
            if typ in (int, float, str):
                return typ(raw)
            if typing.get_origin(typ) is typing.Literal:
                if raw in typing.get_args(typ):
                    return raw
                raise ValueError
            if typing.get_origin(typ) is list:
                # a per-layer list in a spec: values separated by "/" ("512/256/256"); where commas cannot
                # separate parameters (--param KEY=VALUE) also "[512,256,256]" or "512,256,256"
                (item,) = typing.get_args(typ) or (str,)
                values = raw.strip().removeprefix("[").removesuffix("]")
                if "/" in values or "," in values:
                    return [item(x) for x in values.replace(",", "/").split("/")]
        except ValueError:
            continue
    lists = any(typing.get_origin(t) is list for t in options)
    raise AttnkitError(f"method {method!r}: parameter {name}={raw!r} is not a valid {hint}"
                       + (" (a per-layer list: one value per layer separated by '/', e.g. 0.5/0.3/0.3)" if lists else ""))


def make_method(name: str, **params: Any):
    """Build a registered method by name; string values (from a spec) are converted to the field types."""
    if not isinstance(name, str):
        raise AttnkitError(f"a method name must be a string (see `attnkit methods`), got {name!r}")
    cls = method_class(name, "method")
    fields = {f.name: f for f in cls.parameters()}
    unknown = sorted(set(params) - set(fields))
    if unknown:
        allowed = ", ".join(fields) or "none"
        raise AttnkitError(f"method {name!r} has no parameter {', '.join(unknown)}; its parameters: {allowed}")
    hints = typing.get_type_hints(cls)
    values = {k: coerce(k, name, hints.get(k, str), v) for k, v in params.items()}
    try:
        return cls(**values)
    except (ValueError, TypeError) as exc:
        raise AttnkitError(f"method {name!r}: {exc}") from None


def method_from_dict(data, source: str = "recipe"):
    """A ``{"method": NAME, "params": {...}}`` mapping -> a method instance."""
    if not isinstance(data, dict):
        raise AttnkitError(f"{source}: a recipe must be a mapping with a 'method' key, got {type(data).__name__}")
    unknown = sorted(set(data) - set(METHOD_KEYS))
    if unknown:
        raise AttnkitError(f"{source}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(METHOD_KEYS)}")
    if not isinstance(data.get("method"), str):
        raise AttnkitError(f"{source}: 'method' must be a method name (see `attnkit methods`)")
    params = data.get("params", {}) or {}
    if not isinstance(params, dict):
        raise AttnkitError(f"{source}: 'params' must be a mapping of parameter names to values")
    return make_method(data["method"], **params)


_JOIN = re.compile(r"\+(?=\s*[A-Za-z_]\w*\s*(?::|,|\+|$))")  # "+" before a method name


def is_quantizer(name: str) -> bool:
    """Whether `name` is a registered quantizer (a trailing ``+NAME`` part wraps the cache before it)."""
    return bool(getattr(METHODS.get(name), "quantizer", False))


def join_parts(spec: str) -> list[str]:
    """The method specs a ``PREFILL+CACHE`` spec joins (one item for a single method)."""
    return [p.strip() for p in _JOIN.split(spec)]


def split_method_spec(spec: str) -> list[tuple[str, dict[str, str]]]:
    """``"window:window=1024"`` -> ``[("window", {"window": "1024"})]``, without building the method;
    ``"PREFILL+CACHE"`` -> two entries. Values stay strings (:func:`make_method` converts them)."""
    if not isinstance(spec, str) or not spec.strip():
        raise AttnkitError(f"a method spec is a non-empty string like 'window:window=512', got {spec!r}")
    parts = join_parts(spec)
    if not all(parts):
        raise AttnkitError(f"method spec {spec!r}: 'PREFILL+CACHE' joins exactly two method specs")
    out = []
    for part in parts:
        name, _, rest = part.partition(":")
        params = {}
        for item in filter(None, rest.split(",")):
            key, eq, value = item.partition("=")
            if not eq:
                hint = " (a per-layer list is written with '/': budget=0.5/0.3/0.3)" if "[" in rest else ""
                raise AttnkitError(f"method spec {spec!r}: expected key=value, got {item!r}{hint}")
            params[key.strip()] = value.strip()
        out.append((name.strip(), params))
    quantizers = [i for i, (name, _) in enumerate(out) if is_quantizer(name)]
    if quantizers and quantizers != [len(out) - 1]:
        raise AttnkitError(f"method spec {spec!r}: a quantizer ({out[quantizers[0]][0]}) comes last, once: "
                           f"'CACHE+{out[quantizers[0]][0]}' or 'PREFILL+CACHE+{out[quantizers[0]][0]}'")
    if len(out) - (1 if quantizers and len(out) > 1 else 0) > 2:
        raise AttnkitError(f"method spec {spec!r}: 'PREFILL+CACHE' joins exactly two method specs (a quantizer "
                           f"such as kivi may follow them)")
    return out


def parse_method_spec(spec: str):
    """``"window:window=1024"`` or ``"window:window=1024,foo=bar"`` -> a method instance.

    ``"PREFILL+CACHE"`` (two specs joined by ``+``, e.g. ``"minference:config=p.json+snapkv:budget=0.3"``)
    is the ``compose`` method: prefill outputs from the first, the KV cache policy of the second. A trailing
    quantizer part (``"...+kivi:bits=4"``) holds the cache of what precedes it.
    """
    parts = split_method_spec(spec)
    texts = join_parts(spec)
    if len(parts) > 1 and is_quantizer(parts[-1][0]):
        name, params = parts[-1]
        if "cache" in params:
            raise AttnkitError(f"method spec {spec!r}: {name} holds the cache of what precedes it; drop cache=")
        return make_method(name, cache="+".join(texts[:-1]), **params)
    if len(parts) > 1:
        return make_method("compose", prefill=texts[0], cache=texts[1])
    name, params = parts[0]
    return make_method(name, **params)


def split_spec_list(text: str, what: str = "--methods") -> list[str]:
    """Split "full,window:window=1024,foo:a=1,b=2" into method specs (a part with '=' before any ':'
    continues the previous method's parameters; so does "a=1+snapkv:budget=0.3", the rest of a
    composition "minference:config=f,a=1+snapkv:budget=0.3")."""
    specs: list[str] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" in part.split(":", 1)[0] and specs:
            specs[-1] += "," + part
        else:
            specs.append(part)
    if not specs:
        raise AttnkitError(f"{what} is empty; give e.g. full,window:window=1024")
    return specs
