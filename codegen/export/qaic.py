"""QAIC compiler artifacts: specializations.json, custom_io.yaml, the qaic-compile command.

Formats follow QEfficient's so its tooling reads them: every specialization value is a string;
the named form `{"specializations": [{"name": ..., "symbols": {...}}]}` is what current SDKs
read, `legacy=True` writes the flat `{"specializations": [{symbol: value, ...}]}` older SDKs
need. `vision_size` is a specialization symbol only, never a compiler flag.
"""

import json
import shlex

from ref import formats

COMPILE_SCRIPT = "compile.sh"

KV_DTYPES = formats.KV
KV_ALIASES = formats.ALIASES


def specializations_json(specializations, *, legacy=False):
    """Text of specializations.json for one graph's [{"name", "symbols": {sym: int}}]."""
    if legacy:
        entries = [{k: str(v) for k, v in s["symbols"].items()} for s in specializations]
    else:
        entries = [
            {"name": s["name"], "symbols": {k: str(v) for k, v in s["symbols"].items()}}
            for s in specializations
        ]
    return json.dumps({"specializations": entries}, indent=2) + "\n"


def custom_io_yaml(retained, kv_dtype):
    """Text of custom_io.yaml: each retained-state input and its `_RetainedState` output in
    `kv_dtype` (QEfficient's layout)."""
    kv_dtype = KV_ALIASES.get(kv_dtype, kv_dtype)
    if kv_dtype not in KV_DTYPES:
        raise ValueError(
            f"kv dtype {kv_dtype!r}: expected one of {KV_DTYPES} (or {sorted(KV_ALIASES)})"
        )
    lines = ["# Model Inputs", ""]
    for name, _ in retained:
        lines += [f" - IOName: {name}", f"   Precision: {kv_dtype}", ""]
    lines += ["# Model Outputs", ""]
    for _, name in retained:
        lines += [f" - IOName: {name}", f"   Precision: {kv_dtype}", ""]
    return "\n".join(lines)


def compile_command(
    graph, *, num_cores, mxfp6, mos, mdp_config, hw_version, sub_functions, custom_io, retained
):
    """The qaic-compile argument list for one graph (file names relative to the output folder)."""
    args = [
        "qaic-compile",
        "-aic-hw",
        f"-aic-hw-version={hw_version}",
        f"-m={graph}.onnx",
        "-convert-to-fp16",
        f"-aic-num-cores={num_cores}",
        f"-network-specialization-config={graph}.specializations.json",
        f"-aic-binary-dir=qpc/{graph}",
    ]
    if retained:
        args.insert(4, "-retained-state")
    if custom_io:
        args.append(f"-custom-IO-list-file={graph}.custom_io.yaml")
    if sub_functions:
        args.append("-sub-functions")
    if mxfp6:
        args.append("-mxfp6-matmul")
    if mos is not None:
        args.append(f"-mos={mos}")
    if mdp_config is not None:
        args.append(f"-mdp-load-partition-config={mdp_config}")
    return args


def compile_script(commands):
    """Text of compile.sh: one qaic-compile per graph, run from the script's folder, with
    -node-precision-info=GRAPH.npi.yaml when `verify --precision --write-npi` wrote one."""
    lines = [
        "#!/bin/sh",
        "# Written by `python -m codegen export`.",
        "set -e",
        'cd "$(dirname "$0")"',
        "# a graph's node-precision plan, when verify --precision --write-npi wrote it",
        'npi() { if [ -f "$1.npi.yaml" ]; then echo "-node-precision-info=$1.npi.yaml"; fi; }',
    ]
    for c in commands:
        graph = next(a[3:-5] for a in c if a.startswith("-m="))
        lines.append(f"{shlex.join(c)} $(npi {shlex.quote(graph)})")
    return "\n".join(lines) + "\n"


def mdp_partition_config(num_devices, num_cores):
    """QEfficient's tensor-slicing partition config for `mdp_ts_num_devices` devices (what it
    writes as `mdp_ts_{N}.json`): one partition over devices 0…N−1 connected peer to peer,
    `num_cores` each."""
    return {
        "connections": [{"devices": list(range(num_devices)), "type": "p2p"}],
        "partitions": [
            {
                "name": "Partition0",
                "devices": [{"deviceId": d, "numCores": num_cores} for d in range(num_devices)],
            }
        ],
    }


def compiler_files(entries, opts):
    """{file name: text} the compiler needs beside the graphs: compile.sh (one qaic-compile per
    `codegen.folder.manifest.Graph` in `entries`, with `opts`' compiler options: an `ExportOptions`)
    and, with `--num-devices N`, its partition config."""
    files = {}
    mdp = mdp_file(opts.num_devices)
    if mdp:
        files[mdp] = json.dumps(mdp_partition_config(opts.num_devices, opts.num_cores), indent=4)
    commands = [
        compile_command(
            e.name,
            num_cores=opts.num_cores,
            mxfp6=opts.mxfp6,
            mos=opts.mos,
            mdp_config=mdp or opts.mdp_config,
            hw_version=opts.hw_version,
            sub_functions=e.sub_functions,
            custom_io=bool(e.retained_state),
            retained=bool(e.retained_state),
        )
        for e in entries
    ]
    files[COMPILE_SCRIPT] = compile_script(commands)
    return files


def mdp_file(num_devices):
    """The partition config `--num-devices N` writes (QEfficient's name), or None."""
    return f"mdp_ts_{num_devices}.json" if num_devices > 1 else None
