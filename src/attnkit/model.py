"""Loading causal LMs and reading their geometry.

``load_model(spec)`` accepts:

- ``"tiny"`` / ``"tiny-draft"``: the small models bundled in ``attnkit/assets``, loaded offline;
- ``"random:<arch>[:key=value,...]"`` with arch in llama, mistral, qwen2, qwen3: a small random-weight
  model built in memory from a config (GQA, seedable), with the byte tokenizer so text prompts work.
  Keys: layers, hidden, heads, kv_heads, head_dim, intermediate, context, seed, sliding_window, rope_theta;
- a local Hugging Face model directory, or a hub id (needs the network or a local hub cache);
- any of the last two followed by ``:yarn=F`` (``tiny:yarn=8``): the model with its RoPE extended to F
  times its trained positions without training, by YaRN (Peng, Quesnelle, Fan and Shippole 2023, "YaRN:
  Efficient Context Window Extension of Large Language Models", arXiv:2309.00071, Sec. 3.4: "NTK-by-parts"
  interpolation of the RoPE frequencies plus an attention temperature), as transformers implements it.

``device`` is ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"mps"`` or a :class:`torch.device`; ``dtype`` a floating
:class:`torch.dtype` or its name (``"float32"``, ``"float16"``, ``"bfloat16"``). Instead of one device,
``device_map`` (``"auto"`` or a mapping of module names to devices) spreads the model over several devices, or
offloads weights to the CPU or the disk, through accelerate (:mod:`attnkit.placement`).

Supported architectures are the Llama-family decoders whose modules the runner drives directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from attnkit.environment import import_failure

try:
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
        LlamaConfig,
        MistralConfig,
        PreTrainedModel,
        Qwen2Config,
        Qwen3Config,
    )
except ImportError as exc:  # a broken environment: say which package and how to fix it (attnkit.environment)
    raise import_failure(exc) from None

from attnkit.attention import ATTN_IMPLEMENTATION
from attnkit.errors import AttnkitError
from attnkit.placement import (
    check_covers,
    check_device_map,
    check_tied,
    dispatch,
    execution_device,
    is_placed,
    offload_folder,
    placement_error,
    require_accelerate,
)
from attnkit.tokenizer import build_byte_tokenizer
from attnkit.validate import text

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
BUNDLED = ("tiny", "tiny-draft")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEVICE_KINDS = ("cpu", "cuda", "mps")
# builds the bundled models (training/bundle_v2.py says how, from a checkout)
TRAINING_SCRIPT = "training/bundle_v2.py"

_RANDOM_CONFIGS = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
_RANDOM_DEFAULTS = dict(layers=2, hidden=256, heads=8, kv_heads=2, head_dim=32, intermediate=512, context=4096,
                        seed=0, sliding_window=0, rope_theta=10000.0)


@dataclass(frozen=True)
class Geometry:
    """What the methods need to know about a model's attention."""

    architecture: str
    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    max_positions: int
    rope_theta: float
    vocab_size: int
    sliding_window: int | None

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers at float32."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * 4


@dataclass
class LoadedModel:
    """A Hugging Face causal LM prepared for attnkit, with its tokenizer and geometry."""

    hf: PreTrainedModel
    tokenizer: object
    geometry: Geometry
    spec: str

    @property
    def device(self) -> torch.device:
        """Where the prompt goes in: the device the input embedding runs on."""
        return execution_device(self.hf.get_input_embeddings())

    @property
    def output_device(self) -> torch.device:
        """Where the logits come out: the device the LM head runs on (:attr:`device` unless placed)."""
        return execution_device(self.hf.get_output_embeddings())

    def layer_devices(self) -> list[torch.device]:
        """The device each decoder layer runs on (its KV cache lives there)."""
        return [execution_device(layer) for layer in self.hf.model.layers]

    @property
    def placed(self) -> bool:
        """True when accelerate spread the model over several devices or offloads some of its weights."""
        return is_placed(self.hf)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.hf.parameters()).dtype


def read_geometry(hf: PreTrainedModel) -> Geometry:
    """Geometry of a supported model; a clear error for anything else."""
    config = hf.config
    arch = getattr(config, "model_type", "?")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise AttnkitError(
            f"unsupported architecture {arch!r}; attnkit supports {', '.join(SUPPORTED_ARCHITECTURES)} "
            "(Llama-family decoders with RoPE)"
        )
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)) if isinstance(rope, dict) else 10000.0
    window = getattr(config, "sliding_window", None)
    if arch in ("qwen2", "qwen3") and "sliding_attention" not in (getattr(config, "layer_types", None) or []):
        window = None
    return Geometry(arch, config.num_hidden_layers, heads, getattr(config, "num_key_value_heads", heads) or heads,
                    head_dim, config.max_position_embeddings, float(theta), config.vocab_size, window or None)


def prepare(hf: PreTrainedModel, tokenizer, spec: str = "custom") -> LoadedModel:
    """Wrap an already loaded transformers model: checks the architecture, switches its attention
    implementation to attnkit's (which behaves as SDPA unless attnkit drives the forward)."""
    geometry = read_geometry(hf)
    hf.set_attn_implementation(ATTN_IMPLEMENTATION)
    hf.eval()
    return LoadedModel(hf, tokenizer, geometry, spec)


def check_loaded_model(model, name: str = "model") -> LoadedModel:
    """`model` if it is a :class:`LoadedModel`; a model spec string or a bare transformers model gets an
    error saying how to make one."""
    if isinstance(model, LoadedModel):
        return model
    if isinstance(model, str):
        raise AttnkitError(f"{name} must be a loaded model, got the string {model!r}; load it first: "
                           f"attnkit.load_model({model!r})")
    if isinstance(model, PreTrainedModel):
        raise AttnkitError(f"{name} must be an attnkit LoadedModel, got a transformers "
                           f"{type(model).__name__}; wrap it with attnkit.prepare(model, tokenizer)")
    raise AttnkitError(f"{name} must be a LoadedModel (from attnkit.load_model or attnkit.prepare), "
                       f"got {type(model).__name__}")


def resolve_dtype(dtype) -> torch.dtype:
    """A floating torch dtype, or its name (``"float32"``, ``"float16"``, ``"bfloat16"``)."""
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise AttnkitError(f"dtype must be a floating torch.dtype or one of {', '.join(DTYPES)}, got {dtype!r}")


def resolve_device(device) -> torch.device:
    """A device this machine has: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"mps"`` or a :class:`torch.device`."""
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError:
            raise AttnkitError(f"unknown device {device!r}; give one of cpu, cuda, cuda:N, mps") from None
    if not isinstance(device, torch.device):
        raise AttnkitError(f"device must be a string such as 'cpu' or 'cuda', or a torch.device, got {device!r}")
    if device.type not in DEVICE_KINDS:
        raise AttnkitError(f"device {str(device)!r} is not supported; give one of cpu, cuda, cuda:N, mps")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise AttnkitError(f"device {str(device)!r}: CUDA is not available on this machine (this torch "
                               f"{'has no CUDA support' if torch.version.cuda is None else 'sees no GPU'}); "
                               f"use device='cpu'")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise AttnkitError(f"device {str(device)!r}: this machine has {count} CUDA device(s), "
                               f"cuda:0..cuda:{count - 1}")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise AttnkitError(f"device {str(device)!r}: MPS is not available on this machine; use device='cpu'")
    return device


def bundled_path(name: str) -> Path:
    return Path(str(resources.files("attnkit") / "assets" / name))


def _parse_options(spec: str, text: str) -> dict:
    options = dict(_RANDOM_DEFAULTS)
    for item in filter(None, text.split(",")):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in _RANDOM_DEFAULTS:
            raise AttnkitError(f"model spec {spec!r}: bad option {item!r}; options: {', '.join(_RANDOM_DEFAULTS)}")
        try:
            options[key] = type(_RANDOM_DEFAULTS[key])(value)
        except ValueError:
            raise AttnkitError(f"model spec {spec!r}: option {key} needs a number, got {value!r}") from None
    return options


def _split_yarn(spec: str) -> tuple[str, float | None]:
    """``"tiny:yarn=8"`` -> ``("tiny", 8.0)``; a spec without the suffix -> ``(spec, None)``."""
    base, sep, option = spec.rpartition(":yarn=")
    if not sep:
        return spec, None
    try:
        factor = float(option)
    except ValueError:
        factor = float("nan")
    if not base or not factor > 1.0:  # NaN fails the comparison too
        raise AttnkitError(f"model spec {spec!r}: yarn=F needs a model before it and a factor F > 1 "
                           f"(e.g. 'tiny:yarn=8'), got {option!r}")
    return base, factor


def _yarn_config(source: str, factor: float):
    """The model's config with YaRN RoPE scaling by `factor` over its trained positions."""
    config = AutoConfig.from_pretrained(source)
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") not in ("default", None):
        raise AttnkitError(f"{source}: its RoPE is already scaled ({rope.get('rope_type')!r}); yarn= extends "
                           f"only a model with plain RoPE")
    original = int(config.max_position_embeddings)
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    config.rope_parameters = {"rope_type": "yarn", "rope_theta": float(theta), "factor": float(factor),
                              "original_max_position_embeddings": original}
    config.max_position_embeddings = int(original * factor)
    return config


def random_model(arch: str, spec: str = "", **overrides) -> LoadedModel:
    """A small random-weight model of `arch` with the byte tokenizer (for tests and benchmarks)."""
    if arch not in _RANDOM_CONFIGS:
        raise AttnkitError(f"unknown random architecture {arch!r}; choose from {', '.join(_RANDOM_CONFIGS)}")
    o = dict(_RANDOM_DEFAULTS, **overrides)
    if o["heads"] % o["kv_heads"]:
        raise AttnkitError(f"heads ({o['heads']}) must be a multiple of kv_heads ({o['kv_heads']})")
    tokenizer = build_byte_tokenizer()
    kwargs = dict(
        vocab_size=len(tokenizer), hidden_size=o["hidden"], num_hidden_layers=o["layers"],
        num_attention_heads=o["heads"], num_key_value_heads=o["kv_heads"], head_dim=o["head_dim"],
        intermediate_size=o["intermediate"], max_position_embeddings=o["context"], rope_theta=o["rope_theta"],
        bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
    )
    if arch == "mistral":
        kwargs["sliding_window"] = o["sliding_window"] or None
    elif arch in ("qwen2", "qwen3"):
        kwargs["use_sliding_window"] = bool(o["sliding_window"])
        kwargs["sliding_window"] = o["sliding_window"] or None
        kwargs["max_window_layers"] = o["layers"]  # every layer full attention unless asked otherwise
    elif o["sliding_window"]:
        raise AttnkitError(f"sliding_window is only an option of mistral, qwen2 and qwen3, not {arch}")
    config = _RANDOM_CONFIGS[arch](**kwargs)
    torch.manual_seed(o["seed"])
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return prepare(hf, tokenizer, spec or f"random:{arch}")


def load_model_for_length(spec: str, positions: int, **options) -> LoadedModel:
    """Like :func:`load_model` (with its keyword `options`), but a ``random:`` spec without its own
    ``context=`` gets `positions` positions (benchmarks and calibration at lengths beyond the default 4096)."""
    text("model spec", spec)
    if spec.startswith("random:") and "context=" not in spec:
        return load_model(spec, context=positions, **options)
    return load_model(spec, **options)


def load_model(spec: str, *, device: str | torch.device | None = None, dtype: torch.dtype | str = torch.float32,
               device_map: str | dict | None = None, offload_dir: str | Path | None = None,
               **random_options) -> LoadedModel:
    """Load a model by spec (see the module docstring), on `device` (default cpu) or placed by `device_map`
    (weights accelerate offloads to the disk go to `offload_dir`, default a temporary folder)."""
    text("model spec", spec)
    dtype = resolve_dtype(dtype)
    if device_map is not None:
        if device is not None:
            raise AttnkitError(f"give device ({device!r}) or device_map, not both: device_map places every module")
        require_accelerate()
        device_map = check_device_map(device_map)
    elif offload_dir is not None:
        raise AttnkitError("offload_dir is where device_map's 'disk' entries go; give a device_map with it")
    device = resolve_device("cpu" if device is None else device)
    if spec.startswith("random:"):
        arch, _, opts = spec[len("random:"):].partition(":")
        options = _parse_options(spec, opts)
        options.update(random_options)
        model = random_model(arch, spec, **{k: v for k, v in options.items()})
        if device_map is None:
            model.hf.to(device=device, dtype=dtype)
        else:
            model.hf.to(dtype=dtype)
            dispatch(model.hf, device_map, offload_folder(model, offload_dir))
        return model
    base, yarn_factor = _split_yarn(spec)
    if base in BUNDLED:
        path = bundled_path(base)
        if not (path / "config.json").is_file():
            raise AttnkitError(f"the bundled model {spec!r} is missing at {path}; {TRAINING_SCRIPT} in attnkit's "
                               f"checkout says how to train it")
    else:
        path = Path(base)
    source = str(path) if path.is_dir() else base
    holder = _Holder()  # owns a temporary offload folder until the model does
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        extra = {} if yarn_factor is None else {"config": _yarn_config(source, yarn_factor)}
        if device_map is not None:
            check_tied(extra.get("config") or AutoConfig.from_pretrained(source), device_map)
            extra.update(device_map=device_map, offload_folder=offload_folder(holder, offload_dir))
        hf = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation="sdpa", **extra)
    except (OSError, ValueError) as exc:
        if isinstance(exc, AttnkitError):
            raise
        if device_map is not None and "device" in str(exc):
            raise placement_error(exc) from None
        if path.is_dir():
            raise AttnkitError(f"could not load the model directory {spec!r}: {type(exc).__name__}: "
                               f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
        raise AttnkitError(
            f"model spec {spec!r} is not 'tiny', 'tiny-draft', 'random:<arch>' or a local model directory, "
            f"and loading it as a hub id failed ({type(exc).__name__}: {str(exc).splitlines()[0]})"
        ) from None
    if device_map is None:
        return prepare(hf.to(device), tokenizer, spec)
    if device_map != "auto":
        check_covers(hf, device_map)  # transformers ignores names that match no module, and unplaced ones
    model = prepare(hf, tokenizer, spec)
    model.offload_holder = holder
    return model


class _Holder:
    """Keeps a temporary offload folder alive (:func:`attnkit.placement.offload_folder`) as long as the model."""
