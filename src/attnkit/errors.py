"""The one exception type for bad input: its message names the bad value and what is allowed."""


class AttnkitError(ValueError):
    """A user-facing error (bad parameter, prompt, model spec, config file...)."""
