"""Models over several devices: accelerate's ``device_map`` placement, and where each part of a model runs.

``load_model(spec, device_map=...)`` hands placement to accelerate (Hugging Face's ``accelerate`` package): through
transformers' ``from_pretrained`` for the bundled models and model directories, through
``accelerate.dispatch_model`` for ``random:`` models built in memory. ``"auto"`` lets accelerate fill the GPUs, then
the CPU, then the disk; a mapping places modules by name (``model.embed_tokens``, ``model.layers.3``,
``model.norm``, ``lm_head``; ``""`` is the whole model) on ``"cpu"``, ``"disk"``, a GPU (``0``, ``"cuda:1"``) or
``"mps"``. accelerate's hooks move the activations from module to module, and move offloaded weights (``"disk"``;
``"cpu"`` too when a GPU runs the model) in before a module runs and out after it.

attnkit reads where each part *runs* (:func:`execution_device`), never where its weights are stored (offloaded
weights sit on the meta device): prompts go to the input embedding's device, each layer's KV cache is allocated
where that layer's keys are computed, and logits come from the LM head's device. accelerate is an optional
dependency (``pip install 'attnkit[accelerate]'``); asking for a placement without it is a one-line error.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
import weakref
from pathlib import Path

import torch
from torch import nn

from attnkit.config_file import read_config_file
from attnkit.errors import AttnkitError

AUTO = "auto"
PLACES = ("cpu", "disk", "mps", "cuda", "cuda:N", "a GPU index N")
INSTALL_HINT = "pip install 'attnkit[accelerate]'"


def require_accelerate() -> None:
    """A one-line error when accelerate, which places models over devices, is not installed."""
    if importlib.util.find_spec("accelerate") is None:
        raise AttnkitError(f"device_map needs accelerate, which is not installed: {INSTALL_HINT}")


def _place(name: str, value) -> int | str:
    """One device_map value, normalised: a GPU as its index, else ``cpu`` / ``disk`` / ``mps``."""
    what = f"device_map[{name!r}]"
    if isinstance(value, torch.device):
        value = str(value)
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, str) and (value == "cuda" or value.startswith("cuda:") and value[5:].isdigit()):
        value = int(value[5:] or 0)
    if isinstance(value, bool) or not isinstance(value, (int, str)) or isinstance(value, int) and value < 0 or \
            isinstance(value, str) and value not in ("cpu", "disk", "mps"):
        raise AttnkitError(f"{what} = {value!r} is not a device; give one of {', '.join(PLACES)}")
    if isinstance(value, int):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if value >= count:
            raise AttnkitError(f"{what} = GPU {value}, but this machine has {count} CUDA device(s)"
                               + (f" (0..{count - 1})" if count else "; place it on cpu or disk"))
    if value == "mps" and not torch.backends.mps.is_available():
        raise AttnkitError(f"{what} = 'mps', but MPS is not available on this machine")
    return value


def check_device_map(device_map) -> str | dict[str, int | str]:
    """``"auto"``, or a mapping of module names to devices with every value normalised (see the module
    docstring); anything else is a one-line error."""
    if device_map == AUTO:
        return AUTO
    if not isinstance(device_map, dict) or not device_map:
        raise AttnkitError(f"device_map must be 'auto' or a non-empty mapping of module names to devices "
                           f"({', '.join(PLACES)}), got {device_map!r}")
    out = {}
    for name, value in device_map.items():
        if not isinstance(name, str):
            raise AttnkitError(f"device_map keys must be module names such as 'model.layers.0', got {name!r}")
        out[name] = _place(name, value)
    return out


def parse_device_map(text: str) -> str | dict[str, int | str]:
    """The CLI's ``--device-map``: ``auto``, ``NAME=DEVICE,...`` (``model.layers.1=disk,lm_head=cpu``) or a
    JSON/YAML file holding the mapping."""
    text = text.strip()
    if text == AUTO:
        return AUTO
    if "=" not in text:
        path = Path(text)
        if not path.is_file():
            raise AttnkitError(f"--device-map {text!r} is not 'auto', NAME=DEVICE pairs or an existing JSON/YAML file")
        return check_device_map(read_config_file(path, "device map file"))
    pairs = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, eq, place = item.partition("=")
        if not eq or not place.strip():
            raise AttnkitError(f"--device-map: {item!r} is not NAME=DEVICE (e.g. model.layers.1=disk)")
        pairs[name.strip()] = place.strip()
    return check_device_map(pairs)


def check_covers(hf: nn.Module, device_map: dict) -> None:
    """Every key of `device_map` names a module of `hf` (``""`` is the whole model), and every weight of `hf`
    is placed by some key."""
    modules = dict(hf.named_modules())
    unknown = [name for name in device_map if name and name not in modules]
    if unknown:
        top = [n for n in modules if n and n.count(".") <= 1][:6]
        raise AttnkitError(f"device_map names no module {unknown[0]!r} of this model; its modules are named like "
                           f"{', '.join(top)}, model.layers.N")
    unplaced = sorted({name.rpartition(".")[0] for name in hf.state_dict() if placement_of(device_map, name) is None})
    if unplaced:
        more = f" and {len(unplaced) - 3} more" if len(unplaced) > 3 else ""
        raise AttnkitError(f"device_map places no device for module(s) {', '.join(unplaced[:3])}{more}; place every "
                           f"module (\"\" names the whole model)")


def placement_of(device_map: dict, name: str):
    """Where `device_map` puts the module `name`: the entry of the longest name that is it or contains it."""
    best = None
    for key, value in device_map.items():
        if key == "" or name == key or name.startswith(key + "."):
            if best is None or len(key) > len(best[0]):
                best = (key, value)
    return None if best is None else best[1]


def check_tied(config, device_map) -> None:
    """A model whose LM head is its input embedding (``tie_word_embeddings``) holds one weight for both:
    a mapping that puts them in different places cannot be honoured (accelerate fails on it)."""
    if device_map == AUTO or not getattr(config, "tie_word_embeddings", False):
        return
    emb, head = placement_of(device_map, "model.embed_tokens"), placement_of(device_map, "lm_head")
    if emb != head and emb is not None and head is not None:  # an unplaced module is check_covered's
        raise AttnkitError(f"this model ties lm_head to model.embed_tokens (tie_word_embeddings: one weight), which "
                           f"device_map places on {emb!r} and {head!r}; place both on the same device")


def offload_folder(model_owner, offload_dir: str | Path | None) -> str:
    """Where accelerate may write offloaded weights: `offload_dir`, or a temporary folder removed when
    `model_owner` is garbage-collected (or at exit)."""
    if offload_dir is not None:
        Path(offload_dir).mkdir(parents=True, exist_ok=True)
        return str(offload_dir)
    folder = tempfile.mkdtemp(prefix="attnkit-offload-")
    weakref.finalize(model_owner, shutil.rmtree, folder, True)
    return folder


def dispatch(hf: nn.Module, device_map, folder: str) -> None:
    """Place a model built in memory (``random:``) by `device_map` through accelerate."""
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    no_split = getattr(hf, "_no_split_modules", None) or []
    if device_map == AUTO:  # what transformers' from_pretrained does for "auto"
        device_map = infer_auto_device_map(hf, max_memory=get_balanced_memory(hf, no_split_module_classes=no_split),
                                           no_split_module_classes=no_split)
    check_covers(hf, device_map)
    try:
        dispatch_model(hf, device_map, offload_dir=folder, skip_keys=getattr(hf, "_skip_keys_device_placement", None))
    except ValueError as exc:  # accelerate's check: a parameter no entry places
        raise placement_error(exc) from None
    hf.hf_device_map = dict(device_map)


def placement_error(exc: Exception) -> AttnkitError:
    """accelerate's or transformers' complaint about a device_map, in one line (a long list of parameters cut)."""
    line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    head, sep, names = line.partition("following parameters: ")
    if sep:
        names = [n.strip() for n in names.split(",") if n.strip()]
        line = f"{head}{sep}{', '.join(names[:3])}" + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return AttnkitError(line if line.startswith("device_map") else f"device_map: {line}")


def _as_device(value) -> torch.device:
    return torch.device("cuda", value) if isinstance(value, int) else torch.device(value)


def execution_device(module: nn.Module) -> torch.device:
    """Where `module` runs: the execution device of its accelerate hook when it has one (its weights may be
    offloaded to the meta device), else the device of its first parameter or buffer not on meta, else cpu."""
    hook = getattr(module, "_hf_hook", None)
    for h in getattr(hook, "hooks", [hook]) if hook is not None else []:
        device = getattr(h, "execution_device", None)
        if device is not None:
            return _as_device(device)
    for tensor in module.parameters():
        if tensor.device.type != "meta":
            return tensor.device
    for tensor in module.buffers():
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


def module_weight(module: nn.Module, name: str = "weight") -> torch.Tensor:
    """`module`'s parameter `name` with its data, on the module's execution device: where accelerate offloads it (to
    the CPU or the disk: the parameter sits on meta between the module's calls) it is read from the hook's weights
    map, as the hook itself does before each call. For a method that reads a projection outside its forward (the
    value-weighting scorers read ``o_proj.weight`` from inside the attention)."""
    tensor = getattr(module, name)
    if tensor.device.type != "meta":
        return tensor
    hook = getattr(module, "_hf_hook", None)
    for h in getattr(hook, "hooks", [hook]) if hook is not None else []:
        weights = getattr(h, "weights_map", None)
        if weights is not None and name in weights:
            return weights[name].to(execution_device(module))
    raise AttnkitError(f"{type(module).__name__}.{name} is on the meta device and no accelerate hook holds its data")


def is_placed(hf: nn.Module) -> bool:
    """True when accelerate spread `hf` over several devices or offloads some of its weights."""
    device_map = getattr(hf, "hf_device_map", None) or {}
    if len(set(device_map.values())) > 1 or "disk" in device_map.values():
        return True
    return any(p.device.type == "meta" for p in hf.parameters())
