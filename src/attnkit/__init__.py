"""attnkit: faster, lighter long-context inference for Hugging Face causal LMs.

    import attnkit
    model = attnkit.load_model("tiny")
    out = attnkit.generate(model, "some long prompt", "window", params={"window": 512}, max_new_tokens=32)
"""

from attnkit.continuation import generate_after
from attnkit.errors import AttnkitError
from attnkit.generation import GenerationConfig
from attnkit.hf_cache import AttnkitCache
from attnkit.methods import METHODS, Method, make_method, parse_method_spec
from attnkit.model import Geometry, LoadedModel, load_model, prepare
from attnkit.recipe import Recipe, as_recipe, load_recipe_file
from attnkit.runner import Generation, GenerationStats, generate, score_tokens, token_nll
from attnkit.speculative import speculative_generate
from attnkit.version import __version__

__all__ = [
    "AttnkitError", "AttnkitCache", "GenerationConfig", "METHODS", "Method", "make_method", "parse_method_spec",
    "Geometry", "LoadedModel", "load_model", "prepare", "Recipe", "as_recipe", "load_recipe_file", "Generation",
    "GenerationStats", "generate", "generate_after", "score_tokens", "token_nll", "speculative_generate",
    "__version__",
]
