"""Test-wide settings: float64 available for the dense references, hypothesis profiles, the
XLA compile settings of the default run, and the order that balances `make test`'s workers."""

import gc
import os
import shutil
import tempfile

# The default run compiles thousands of small XLA programs and runs each a few times: compile
# time is most of it, and XLA's backend optimizations cost more than they save (measured
# on tests/ref/test_vision.py's transformers test: 41 s → 26 s). XLA:CPU's MLIR fusion emitters
# compile a small program in about twice the time its older IR emitters take (600 one-op
# programs: 20.0 s → 12.3 s; test_layerwise's verdict test 26 s → 14 s). Results stay within
# every test's tolerance (docs/testing.md). The long profile keeps the optimizing compiler and
# the default emitters, as users run them.
# Set before jax is imported, in os.environ so that subprocess tests inherit it.
LONG = os.environ.get("HYPOTHESIS_PROFILE") == "long"
if not LONG:
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    os.environ["XLA_FLAGS"] = (
        f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0"
        " --xla_cpu_use_fusion_emitters=false"
    )

# One XLA compilation cache per run, shared by its workers: the same small programs (one
# primitive on one tiny shape, a layer of the default model) are compiled again by many
# tests, in both workers, and by functions jitted anew. Keyed by the program and XLA's
# flags, so a hit is the very executable a compile would give.
RUN = os.environ.setdefault("GEMMA4_QAIC_TEST_RUN", str(os.getpid()))  # workers inherit it
CACHE = os.path.join(tempfile.gettempdir(), f"gemma4-qaic-xla-{RUN}")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import jax  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

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

# `make test` runs modules on two workers (`pytest -n auto --dist loadfile`), each module whole
# on one worker (module fixtures and compiled functions are built once). Handing out the
# slowest modules first keeps both workers busy to the end; order measured on this 2-core
# machine (docs/testing.md), the rest follow in file order.
SLOWEST_FIRST = [
    "test_layerwise.py",
    "test_codegen.py",
    "test_attention.py",
    "test_precision.py",
    "test_model_export.py",
    "test_vision.py",
    "test_generate.py",
    "test_text.py",
    "test_moe_export.py",
    "test_moe.py",
    "test_mesh.py",
    "test_speculative.py",
    "test_speculate.py",
    "test_ccl.py",
    "test_cache.py",
    "test_codegen_checks.py",
    "test_vision_export_tiles.py",
    "test_photo_run.py",
    "test_serve.py",
    "test_chat.py",
    "test_npi_drift.py",
    "test_hostile_input.py",
]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_runtest_setup(item):
    """At each module's first test: collect the garbage the earlier modules left, then freeze
    everything alive (`gc.freeze`: jax, torch and transformers' modules, models cached for
    the run), so that a full collection — Python's own, or one of `codegen.check`'s — walks
    this module's objects only, not the whole worker (before, one took about a second late
    in a worker). Objects alive now are still freed when their count drops; only those that
    become garbage in a reference cycle later stay."""
    if item.module is not _FROZEN_AT[0]:
        _FROZEN_AT[0] = item.module
        gc.collect()
        gc.freeze()


_FROZEN_AT = [None]


def pytest_sessionfinish(session):
    """The run's compilation cache goes with the run (removed by the process that named it:
    the controller, or a run without workers)."""
    if RUN == str(os.getpid()):
        shutil.rmtree(CACHE, ignore_errors=True)
