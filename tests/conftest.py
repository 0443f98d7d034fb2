"""Test-wide settings: float64 available for the dense references, hypothesis profiles."""

import os

import jax
from hypothesis import HealthCheck, settings

jax.config.update("jax_enable_x64", True)

settings.register_profile(
    "default",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile(
    "long",
    parent=settings.get_profile("default"),
    max_examples=2000,
)
# `make mutation` (docs/mutation.md): the same tests once per mutant, so reproducible verdicts:
# derandomized, no example database (a mutant's failure must not leak into the next one).
settings.register_profile(
    "mutation",
    parent=settings.get_profile("default"),
    derandomize=True,
    database=None,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
