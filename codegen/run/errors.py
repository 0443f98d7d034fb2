"""The runner's one error: what the prompts, images or folder ask cannot be run."""


class RunError(ValueError):
    """The prompts, images or folder cannot be run with these graphs."""
