"""The house rules, checked on the source: layers import only downwards, no import cycles (function-level
imports included), no attnkit import inside a function outside the CLI, no library file over 400 lines."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "attnkit"

# bottom to top: a module may import modules of its own layer or the layers below
LAYERS = [
    ("errors", "validate", "config_file", "version", "native", "environment"),
    ("tokenizer", "rope", "masks", "sampling", "heads"),
    ("attention",),
    ("model", "cache", "placement", "quant"),
    ("session", "generation", "forward"),
    ("sparse",),
    ("methods",),
    ("runner", "hf_cache", "continuation"),
    ("speculative",),
    ("recipe",),
    ("vllm",),  # the vLLM host (its plugin imports vLLM; attnkit.vllm itself imports nothing)
    ("eval",),  # eval's own package facade; its subpackages, bottom to top:
    ("eval.data",),
    ("eval.stats",),
    ("eval.run",),
    ("eval.report",),
    ("eval.tune",),
    ("calibrate",),  # calibration prompts come from eval's task generators
    ("bench",),
    ("cli",),
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path) -> list[tuple[str, bool, int]]:
    """(imported attnkit module, inside a function, line) for every import of attnkit in `path`."""
    found = []

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom) and child.module and child.module.split(".")[0] == "attnkit":
                for alias in child.names:  # `from attnkit.x import y` may import the submodule attnkit.x.y
                    sub = f"{child.module}.{alias.name}"
                    found.append((sub if sub in MODULES else child.module, in_function, child.lineno))
            elif isinstance(child, ast.Import):
                found.extend((a.name, in_function, child.lineno) for a in child.names
                             if a.name.split(".")[0] == "attnkit")
            visit(child, inner)

    visit(ast.parse(path.read_text()), False)
    return sorted(set(found), key=lambda x: x[2])


def layer(module: str) -> int | None:
    """The layer of `module` (None: the package's facade, ``attnkit`` itself, which is above everything)."""
    parts = module.split(".")
    if len(parts) > 2 and ".".join(parts[1:3]) in RANK:  # a subpackage with layers of its own (eval's)
        return RANK[".".join(parts[1:3])]
    return RANK.get(parts[1]) if len(parts) > 1 else None


def test_every_module_has_a_layer():
    unplaced = [m for m in MODULES if m != "attnkit" and layer(m) is None]
    assert not unplaced, f"modules outside the layer list in tests/test_house.py: {unplaced}"


def test_imports_go_down_the_layers():
    bad = []
    for module, path in MODULES.items():
        if module == "attnkit":
            continue
        for target, _, line in imports(path):
            if layer(target) is None:
                bad.append(f"{module}:{line} imports the package facade {target!r} (import the defining module)")
            elif layer(target) > layer(module):
                bad.append(f"{module}:{line} imports {target} from a higher layer")
    assert not bad, "\n".join(bad)


# modules that may defer imports, and why (the cycle check below sees their deferred imports too)
DEFERRING = {"attnkit.vllm.plugin": "vLLM loads it in every process: on a vLLM version the plugin is not tested "
                                    "with it must not import the modules that import vLLM's internals"}


def test_no_attnkit_import_inside_functions():
    """A function-level import hides a cycle; only the CLI may defer imports (for its start-up time), and the modules
    of DEFERRING for their reason."""
    bad = [f"{module}:{line} imports {target} inside a function"
           for module, path in MODULES.items() if layer(module) != RANK["cli"] and module not in DEFERRING
           for target, inside, line in imports(path) if inside]
    assert not bad, "\n".join(bad)


def reached(importer: str, target: str) -> set[str]:
    """What importing `target` runs: the module and its packages' ``__init__`` (those that do not already
    contain `importer`: a package's own modules import their siblings while it initialises)."""
    parts = target.split(".")
    out = {target}
    for i in range(2, len(parts)):
        package = ".".join(parts[:i])
        if not importer.startswith(package + "."):
            out.add(package)
    return {m for m in out if m in MODULES and m != importer}


def test_no_import_cycles():
    graph = {m: set().union(*[reached(m, t) for t, _, _ in imports(p)]) for m, p in MODULES.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in state:
                walk(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            walk(m)


def test_library_files_are_small():
    big = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"library files over {MAX_LINES} lines: {big}"


def test_the_checker_sees_function_level_and_upward_imports(tmp_path):
    """The checks above would notice what they forbid."""
    probe = tmp_path / "probe.py"
    probe.write_text("from attnkit.errors import AttnkitError\n\ndef f():\n    from attnkit.cli import main\n")
    assert imports(probe) == [("attnkit.errors", False, 1), ("attnkit.cli", True, 4)]
    assert layer("attnkit.cli") > layer("attnkit.errors")


def test_method_classes_are_exported_under_their_registry_names():
    import attnkit.methods as methods

    def squash(name: str) -> str:
        return name.replace("_", "").lower()

    for name, cls in methods.METHODS.items():
        assert getattr(methods, cls.__name__) is cls and squash(cls.__name__) == squash(name), name
