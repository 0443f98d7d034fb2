"""Mutation testing, one module at a time: `make mutation` (all modules) or
`make mutation MODULE=ref/cache.py`. See docs/mutation.md.

mutmut 3 reads a single `[tool.mutmut]` section, but each module has its own fast test selection.
So each module runs in its own scratch copy of the project, build/mutation/<module>/, whose
pyproject.toml has the `[tool.mutmut]` section of this repository (process isolation, timeouts)
plus that module's `source_paths`, `only_mutate` and test selection. The repository itself is
never modified; the scratch copy stays afterwards for `mutmut results` / `mutmut show NAME`
(run them inside it). Every run starts from a fresh copy, so a score never mixes old results,
unless `--resume`: then, if the mutated module's tree (e.g. all of ref/) is byte-identical to
the scratch copy's, only the tests and docs are refreshed and mutmut goes on with the mutants
it has not checked, then re-checks the survivors. A killed mutant stays killed (tests were
only added since); a changed module tree always starts afresh.

Hypothesis runs under the `mutation` profile (tests/conftest.py): derandomized, no example
database, so a mutant's verdict does not depend on earlier runs. JAX keeps a persistent
compilation cache in build/mutation/jax-cache (each mutant is a fresh process).
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRATCH = ROOT / "build" / "mutation"
TREES = ["ref", "weights", "codegen", "benchmarks", "tests", "docs"]  # docs: tests read them
FILES = ["README.md"]  # tests/test_readme.py reads it

# Not the hypothesis sweep over random shapes nor the transformers comparison (minutes per
# mutant under eager JAX); the numpy oracles, exact masks and the fixed-shape mode sweep.
ATTENTION_TESTS = [
    "tests/ref/test_attention.py",
    "-k",
    "not test_blocked_equals_reference and not test_reference_matches_transformers",
]

# Module → the pytest arguments that select its tests (fast ones: they run once per mutant).
MODULES = {
    "ref/cache.py": ["tests/ref/test_cache.py", "tests/codegen/graphs/test_attention_export.py"],
    "ref/blocking.py": ["tests/ref/test_blocking.py"],
    "ref/blocking_plan.py": ["tests/ref/test_blocking.py"],
    "ref/attention/dense.py": ATTENTION_TESTS,
    "ref/attention/blocks.py": ATTENTION_TESTS,
    "ref/attention/tiles.py": ATTENTION_TESTS,
    "ref/rope.py": ["tests/ref/test_rope.py"],
    "ref/gemma4/packing.py": ["tests/ref/test_packing.py"],
    "ref/gemma4/schedule.py": [
        "tests/ref/test_text.py",
        "-k",
        "chunk_bounds or chunk_arrays or image_runs",
    ],
    "weights/safetensors.py": ["tests/weights/test_weights.py"],
    "weights/writer.py": ["tests/weights/test_weights.py"],
}

# Extra environment per module. attention: four CPU devices, so `mesh=` really splits the heads
# in-process (test_blocked_over_every_device_of_this_process), where mutmut can see it.
ENV = {"ref/attention/blocks.py": {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}}


def toml_value(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string for these ASCII values
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} to TOML")


def module_config(module):
    """The repository's [tool.mutmut] section, narrowed to one module and its tests."""
    base = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"].get("mutmut", {})
    top = module.split("/")[0]
    config = dict(base)
    config["source_paths"] = [top + "/"]
    config["only_mutate"] = [module]
    config["also_copy"] = [t + "/" for t in TREES if t not in (top, "tests")] + FILES
    config["pytest_add_cli_args_test_selection"] = MODULES[module]
    config["use_git_change_detection"] = False  # the scratch copy is not a git work tree
    return "[tool.mutmut]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in config.items())


def scratch_copy(module):
    """A fresh copy of the project for one module, with its own [tool.mutmut] section."""
    work = SCRATCH / module.replace("/", "_").removesuffix(".py")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    skip = shutil.ignore_patterns("__pycache__", ".hypothesis", ".pytest_cache")
    for tree in TREES:
        shutil.copytree(ROOT / tree, work / tree, ignore=skip)
    for name in FILES:
        shutil.copy2(ROOT / name, work / name)
    text = (ROOT / "pyproject.toml").read_text()
    section = re.compile(r"^\[tool\.mutmut\]\n(?:(?!\[).*\n?)*", re.MULTILINE)
    text, count = section.subn("", text)
    if count > 1:
        raise SystemExit("pyproject.toml has more than one [tool.mutmut] section")
    (work / "pyproject.toml").write_text(text.rstrip("\n") + "\n\n" + module_config(module))
    return work


def same_tree(a, b):
    """True when the .py files under a and b are the same names with the same bytes."""

    def files(root):
        return {p.relative_to(root): p.read_bytes() for p in root.rglob("*.py")}

    return b.exists() and files(a) == files(b)


def refresh_tests(module):
    """The scratch copy of `module` with today's tests and docs, its mutants and verdicts kept;
    None when there is none or the module's tree changed since (then a fresh run is needed)."""
    work = SCRATCH / module.replace("/", "_").removesuffix(".py")
    top = module.split("/")[0]
    if not (work / "mutants").exists() or not same_tree(ROOT / top, work / top):
        return None
    skip = shutil.ignore_patterns("__pycache__", ".hypothesis", ".pytest_cache")
    for tree in ("tests", "docs"):
        for base in (work, work / "mutants"):
            if (base / tree).exists():
                shutil.rmtree(base / tree)
                shutil.copytree(ROOT / tree, base / tree, ignore=skip)
    return work


def counts(work):
    """Status → number of mutants, from `mutmut results --all true`."""
    out = subprocess.run(
        [str(Path(sys.executable).parent / "mutmut"), "results", "--all", "true"],
        cwd=work,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    tally = {}
    for line in out.splitlines():
        if ": " in line:
            status = line.rsplit(": ", 1)[1].strip()
            tally[status] = tally.get(status, 0) + 1
    return tally, [ln.strip() for ln in out.splitlines() if ln.endswith(": survived")]


def run(module, max_children, resume=False):
    work = refresh_tests(module) if resume else None
    if resume and work is None:
        print(f"{module}: no scratch copy with the same sources to resume; starting afresh")
    work = work or scratch_copy(module)
    _, survivors = counts(work) if resume and (work / "mutants").exists() else ({}, [])
    # Each mutant runs in a fresh fork that would compile every JAX op again; a persistent
    # compilation cache (kept across modules and runs) cuts that to a disk read.
    env = dict(
        os.environ,
        HYPOTHESIS_PROFILE="mutation",
        JAX_COMPILATION_CACHE_DIR=str(SCRATCH / "jax-cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
        **ENV.get(module, {}),
    )
    mutmut = str(Path(sys.executable).parent / "mutmut")
    start = time.monotonic()
    command = [mutmut, "run", "--max-children", str(max_children)]
    subprocess.run(command, cwd=work, env=env, check=True)
    if survivors:  # resumed: the survivors of the earlier run meet the tests added since
        names = [line.rsplit(": ", 1)[0] for line in survivors]
        subprocess.run(command + names, cwd=work, env=env, check=True)
    seconds = time.monotonic() - start
    tally, survivors = counts(work)
    return work, seconds, tally, survivors


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help=f"default: all of {', '.join(MODULES)}")
    parser.add_argument("--max-children", type=int, default=2)
    parser.add_argument(
        "--resume", action="store_true", help="go on with an earlier run's scratch copy"
    )
    args = parser.parse_args()
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        raise SystemExit(f"unknown module(s) {unknown}; known: {', '.join(MODULES)}")
    rows = []
    for module in args.modules or list(MODULES):
        work, seconds, tally, survivors = run(module, args.max_children, args.resume)
        total = sum(tally.values())
        killed = tally.get("killed", 0)
        rows.append((module, total, killed, tally, seconds, work, survivors))
    print("\n| module | mutants | killed | survived | timeout | other | score | time |")
    print("|---|---|---|---|---|---|---|---|")
    for module, total, killed, tally, seconds, _, _ in rows:
        survived, timeout = tally.get("survived", 0), tally.get("timeout", 0)
        other = total - killed - survived - timeout
        score = 100 * (killed + timeout) / total if total else 0
        print(
            f"| {module} | {total} | {killed} | {survived} | {timeout} | {other} "
            f"| {score:.1f} % | {seconds / 60:.1f} min |"
        )
    for module, *_, work, survivors in rows:
        print(f"\n{module}: {len(survivors)} survivors (mutmut show NAME in {work})")
        for line in survivors:
            print("   ", line)


if __name__ == "__main__":
    main()
