"""`python -m codegen export|verify` end to end on the embedded default model, and the
behaviour a user relies on: atomic output, refusal, determinism, one-line errors, artifacts.

One export of the default model's graphs (vision, prefill, decode) and every attention graph
(`--graphs model,attention`: every blocking mode, budgets 70 and 140) is shared by the module.
"""

import dataclasses
import json
import os
import re
import shlex
from pathlib import Path

import blake3
import numpy as np
import onnx
import pytest
from safetensors.numpy import load_file

from codegen.__main__ import main
from codegen.check import structure as checks
from codegen.check.verify import verify
from codegen.export import qaic
from codegen.export.command import ExportOptions, export
from codegen.export.defaults import DEFAULT_CONFIG, default_checkpoint, default_tensors
from weights import save_checkpoint


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The default checkpoint in a private cache folder."""
    folder = tmp_path_factory.mktemp("cache") / "default"
    return default_checkpoint(folder)


@pytest.fixture(scope="module")
def exported(cache, tmp_path_factory):
    """`python -m codegen export` (in process) of the default model, every graph kind; the
    test verifies it on fresh inputs (export's own verify at its end is the same function,
    run by the CLI tests below: not twice here)."""
    out = tmp_path_factory.mktemp("exports") / "default"
    old = os.environ.get("GEMMA4_QAIC_CACHE")
    os.environ["GEMMA4_QAIC_CACHE"] = str(cache.parent)
    try:
        rc = main(
            ["export", "--model", str(cache), "--out", str(out), "--graphs", "model,attention"]
            + ["--no-verify"]
        )
    finally:
        if old is None:
            del os.environ["GEMMA4_QAIC_CACHE"]
        else:
            os.environ["GEMMA4_QAIC_CACHE"] = old
    return rc, out


def small(out, model, **kw):
    """Options of a quick export: one budget, one attention graph, no verify."""
    fields = dict(
        out=out,
        model=model,
        budgets=(70,),
        graphs=("attention",),
        blocking=(("kv", {"num_kv_blocks": 2}),),
    )
    fields.update(kw)
    fields.setdefault("verify", False)
    return ExportOptions(**fields)


def manifest(folder):
    return json.loads((folder / "manifest.json").read_text())


def test_default_export_writes_and_verifies_every_mode(exported):
    rc, out = exported
    assert rc == 0
    m = manifest(out)
    names = {g["name"] for g in m["graphs"]}
    from ref.blocking import DENSE_NAMES
    from ref.blocking import names as blocking_names

    modes = [n for n in blocking_names() if n not in DENSE_NAMES] + ["none"]
    assert names == {"vision", "language"} | {f"attention_{mode}" for mode in modes}
    rows = verify(out, seed=1)  # fresh random inputs, not the export's own
    assert all(ok for *_, ok in rows), [r for r in rows if not r[-1]]
    assert {(g, s) for g, s, *_ in rows} >= {
        ("vision", "vision_70"),
        ("vision", "vision_140"),
        ("language", "prefill_70"),
        ("language", "prefill_140"),
        ("language", "decode"),
    }
    assert max(r[4] for r in rows) < 1e-5
    # checking some specializations gives their rows of the whole check, inputs unchanged (a
    # graph with none of them chosen, vision here, is left out)
    chosen = {"prefill_70"}
    some = verify(out, seed=1, graphs=["vision", "language"], specializations=sorted(chosen))
    assert some == [r for r in rows if r[1] in chosen]


def test_weights_are_the_checkpoint_bytes_hard_linked(exported, cache):
    _, out = exported
    source, linked = cache / "model.safetensors", out / "model.safetensors"
    assert os.stat(source).st_ino == os.stat(linked).st_ino
    m = manifest(out)
    assert m["bytes_copied"] == 0
    assert m["shards"][0]["blake3"] == blake3.blake3(source.read_bytes()).hexdigest()
    assert m["shards"][0]["sha256"] is None  # a plain folder: no sha256 known without a read
    # Oracle: the safetensors library's own reading of the shard.
    tensors = load_file(source)
    raw = linked.read_bytes()
    model = onnx.load(out / "vision.onnx", load_external_data=False)
    assert not [i for i in model.graph.input if i.name in tensors]
    seen = 0
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        ext = {e.key: e.value for e in t.external_data}
        assert ext["location"] == "model.safetensors"
        start, length = int(ext["offset"]), int(ext["length"])
        assert raw[start : start + length] == tensors[t.name].tobytes()
        assert list(t.dims) == list(tensors[t.name].shape)
        seen += 1
    assert seen == len(manifest(out)["graphs"][0]["weights"])
    cast = {n.input[0] for n in model.graph.node if n.name.startswith("cast/")}
    assert cast == {
        t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.BFLOAT16
    }


def test_qaic_artifacts(exported):
    _, out = exported
    m = manifest(out)
    spec = json.loads((out / "vision.specializations.json").read_text())
    assert spec["specializations"][0] == {
        "name": "vision_70",
        "symbols": {"num_patches": "630", "vision_size": "70"},
    }
    # layers 0 and 1 own their caches; 2 and 3 read theirs (KV sharing) and have none
    for graph in ("attention_kv", "language"):
        io = (out / f"{graph}.custom_io.yaml").read_text()
        for i in (0, 1):
            for kind in ("key", "value"):
                assert f"IOName: past_{kind}.{i}\n" in io
                assert f"IOName: past_{kind}.{i}_RetainedState\n" in io
        assert "past_key.2" not in io and "past_key.3" not in io
    language = json.loads((out / "language.specializations.json").read_text())
    assert language["specializations"][1:] == [
        {
            "name": "prefill_140",
            "symbols": {
                "ctx_len": "256",
                "batch_size": "1",
                "seq_len": "128",
                "vision_size": "140",
            },
        },
        {
            "name": "decode",
            "symbols": {"ctx_len": "256", "batch_size": "1", "seq_len": "1", "vision_size": "1"},
        },
    ]
    script = (out / "compile.sh").read_text()
    lines = [line for line in script.splitlines() if line.startswith("qaic-compile")]
    assert len(lines) == len(m["graphs"])
    for line, g in zip(lines, m["graphs"], strict=True):
        assert f"-m={g['name']}.onnx" in line
        assert ("-sub-functions" in line) == bool(g["functions"])
        assert ("-retained-state" in line) == bool(g["retained_state"])
        assert "vision_size" not in line
    attn = next(g for g in m["graphs"] if g["name"] == "attention_kv")
    model = onnx.load(out / "attention_kv.onnx", load_external_data=False)
    declared = {
        v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in list(model.graph.input) + list(model.graph.output)
    }
    for entry in attn["inputs"] + attn["outputs"]:
        assert declared[entry["name"]] == entry["shape"]
    assert [p[1] for p in attn["retained_state"]] == [
        p[0] + "_RetainedState" for p in attn["retained_state"]
    ]


def test_reexport_is_byte_identical(exported, cache, tmp_path):
    _, out = exported
    again = tmp_path / "again"
    export(small(again, cache, budgets=(70, 140), blocking=(("kv", {"num_kv_blocks": 2}),)))
    for name in ("vision.onnx", "attention_kv.onnx"):
        assert (again / name).read_bytes() == (out / name).read_bytes(), name


def test_non_empty_output_refused_then_forced(exported, cache, tmp_path, capsys):
    _, out = exported
    before = sorted(os.listdir(out))
    rc = main(["export", "--model", str(cache), "--out", str(out), "--blocking", "kv"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "not empty" in err[0] and "--force" in err[0]
    assert sorted(os.listdir(out)) == before
    target = tmp_path / "forced"
    target.mkdir()
    (target / "stale.txt").write_text("old")
    export(small(target, cache, budgets=(), force=True))
    assert not (target / "stale.txt").exists()
    assert [g["name"] for g in manifest(target)["graphs"]] == ["attention_kv"]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".forced.")]


README = Path(__file__).parents[3] / "README.md"
CODEGEN = ".venv/bin/python -m codegen "


def readme_blocks(language):
    """The README's fenced blocks of `language`, each a list of its lines."""
    blocks, block = [], None
    for line in README.read_text().splitlines():
        if block is None and line == "```" + language:
            block = []
        elif block is not None and line == "```":
            blocks.append(block)
            block = None
        elif block is not None:
            block.append(line)
    return blocks


def readme_commands():
    """[(argv, lines shown below it)] of every `python -m codegen` command in the README's sh
    blocks, in order; a command's shown lines run to the next command or the block's end."""
    commands = []
    for block in readme_blocks("sh"):
        for line in block:
            if line.startswith(CODEGEN):
                commands.append((shlex.split(line[len(CODEGEN) :]), []))
            elif commands and not line.startswith(("make ", ".venv/")):
                commands[-1][1].append(line)
    return commands


def test_readme_is_short_and_its_links_resolve():
    """At most 200 lines; every relative link in it and in docs/README.md names a file that
    exists, and the docs index names every page in docs/."""
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    index = README.parent / "docs" / "README.md"
    for page in (README, index):
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), (page, target)
    pages = {p.name for p in index.parent.glob("*.md")} - {"README.md"}
    assert pages <= set(re.findall(r"\]\(([\w.-]+\.md)\)", index.read_text()))


def test_readme_tour_runs_as_shown(exported, cache, tmp_path, monkeypatch, capsys):
    """Every `python -m codegen` command the README shows runs here as written (in a folder
    where `export` is `make export`'s folder, and `requests.jsonl` is the README's), exits 0,
    and prints every line the README shows below it. The continuous-batching export is the
    CLI's export with its verify: it ends with verify's table, every output ok."""
    commands = readme_commands()
    tour = ["export", "run", "serve", "verify", "vectors", "plan"]
    assert [argv[0] for argv, _ in commands] == tour
    monkeypatch.setenv("GEMMA4_QAIC_CACHE", str(cache.parent))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "export").symlink_to(exported[1])
    (json_block,) = readme_blocks("json")
    (tmp_path / "requests.jsonl").write_text("\n".join(json_block) + "\n")
    for argv, shown in commands:
        assert main(argv) == 0, argv
        printed = capsys.readouterr().out.splitlines()
        missing = [line for line in shown if line not in printed]
        assert not missing, (argv, missing, printed[-12:])
        if argv[0] == "export":
            head = next(i for i, line in enumerate(printed) if line.split()[-1:] == ["ok"])
            verified = [line.split() for line in printed[head + 1 :] if line.strip()]
            assert {r[0] for r in verified} == {"vision", "language"}
            assert all(r[-1] == "ok" for r in verified) and len(verified) >= 10
            assert manifest(tmp_path / "cb")["options"]["verify"] is True


def test_failed_export_leaves_nothing(cache, tmp_path, monkeypatch):
    def refuse(model):
        raise checks.CheckError("injected")

    monkeypatch.setattr(checks, "allowed_ops", refuse)
    with pytest.raises(checks.CheckError, match="injected"):
        export(small(tmp_path / "out", cache))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "args, words",
    [
        (["--budgets", "71"], ["budget 71", "70, 140"]),
        (["--budgets", "140", "--ctx-len", "140"], ["vision_size 140", "ctx_len 140"]),
        (["--blocking", "diagonal"], ["diagonal"]),
        (["--blocking", "kv:num_kv_blocks=x"], ["integer"]),
        (["--graphs", "attention", "--blocking", "q:num_kv_blocks=2"], ["num_kv_blocks"]),
        (["--prefill-blocking", "diagonal"], ["diagonal"]),
        (["--decode-blocking", "kv:num_kv_blocks=x"], ["integer"]),
        (["--decode-blocking", "kv:num_q_blocks=2"], ["num_q_blocks"]),
        (["--prefill-blocking", "kv_batch_fold"], ["batch_fold"]),
        (["--graphs", "everything"], ["everything"]),
        (["--weights", "somewhere"], ["somewhere"]),
        (["--kv-dtype", "int3"], ["int3"]),
        (["--model", "{missing}"], ["not a folder"]),
        (["--model", "{garbage}"], ["model.safetensors"]),
    ],
)
def test_bad_input_is_one_line_exit_2_no_output(args, words, cache, tmp_path, capsys):
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "config.json").write_text(json.dumps(DEFAULT_CONFIG))
    (garbage / "model.safetensors").write_bytes(b"\xff" * 20)
    args = [a.format(missing=tmp_path / "missing", garbage=garbage) for a in args]
    if "--model" not in args:
        args += ["--model", str(cache)]
    out = tmp_path / "out"
    rc = main(["export", "--out", str(out), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1, err
    for word in words:
        assert word in err[0], err[0]
    assert not out.exists()
    assert sorted(os.listdir(tmp_path)) == ["garbage"]


def test_weights_as_inputs_with_weight_spec(cache, tmp_path):
    out = tmp_path / "inputs"
    export(small(out, cache, weights="inputs"))
    assert all(ok for *_, ok in verify(out))
    model = onnx.load(out / "vision.onnx", load_external_data=False)
    spec = json.loads((out / "vision.weights.json").read_text())
    meta = {p.key: p.value for p in model.metadata_props}
    assert json.loads(meta["com.qti.aisw.extdata"]) == spec
    assert set(spec) == {"model_name", "model_id", "files", "inputs"}
    assert spec["files"] == [{"path": "model.safetensors", "format": "safetensors"}]
    tensors = default_tensors()
    graph_inputs = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    for entry in spec["inputs"]:
        assert entry["location"] == {"file": "model.safetensors", "key": entry["name"]}
        assert entry["name"] in tensors
        assert graph_inputs[entry["name"]] == onnx.TensorProto.BFLOAT16
    assert not model.graph.initializer or all(
        t.data_location != onnx.TensorProto.EXTERNAL for t in model.graph.initializer
    )


def test_no_subfunctions_inlines_the_same_math(exported, cache, tmp_path):
    out = tmp_path / "inline"
    export(small(out, cache, sub_functions=False, graphs=("model", "attention")))
    rows = verify(out)
    assert all(ok for *_, ok in rows)
    # one function per distinct layer: the vision layer; a sliding and a full attention layer;
    # sliding and full decoder layers, each owning its cache or sharing one
    for name, count in (("vision", 1), ("attention_kv", 2), ("language", 4)):
        inline = onnx.load(out / f"{name}.onnx", load_external_data=False)
        fns = onnx.load(exported[1] / f"{name}.onnx", load_external_data=False)
        assert not inline.functions and len(fns.functions) == count
        assert len(inline.graph.node) > len(fns.graph.node)
        assert "-sub-functions" not in (out / "compile.sh").read_text()


def test_vision_only_checkpoint_exports_vision_alone(tmp_path):
    prefix = "model.vision_tower."
    tensors = {n[len(prefix) :]: a for n, a in default_tensors().items() if n.startswith(prefix)}
    folder = tmp_path / "vision_only"
    save_checkpoint(folder, dict(DEFAULT_CONFIG["vision_config"]), tensors)
    out = tmp_path / "out"
    # no language graph reads the soft tokens, so no ctx_len bounds the budget; verified
    # below (export's own verify is the same function: not twice)
    export(ExportOptions(out=out, model=folder, budgets=(70, 280), ctx_len=256, verify=False))
    m = manifest(out)
    assert [g["name"] for g in m["graphs"]] == ["vision"]
    assert m["graphs"][0]["outputs"][0]["name"] == "pooled"
    assert m["graphs"][0]["outputs"][0]["shape"] == ["vision_size", 32]
    assert all(ok for *_, ok in verify(out))


def test_legacy_specializations_and_custom_io_format():
    specs = [{"name": "Prefill", "symbols": {"batch_size": 1, "seq_len": 32, "ctx_len": 128}}]
    legacy = json.loads(qaic.specializations_json(specs, legacy=True))
    assert legacy == {"specializations": [{"batch_size": "1", "seq_len": "32", "ctx_len": "128"}]}
    named = json.loads(qaic.specializations_json(specs))
    assert named["specializations"][0]["name"] == "Prefill"
    text = qaic.custom_io_yaml([("past_key.0", "past_key.0_RetainedState")], "mxint8")
    assert text.count("Precision: mxint8") == 2
    assert qaic.custom_io_yaml([("a", "a_RetainedState")], "fp16").count("Precision: float16") == 2
    with pytest.raises(ValueError, match="int3"):
        qaic.custom_io_yaml([], "int3")
    cmd = qaic.compile_command(
        "g",
        num_cores=4,
        mxfp6=True,
        mos=2,
        mdp_config=None,
        hw_version="ai100",
        sub_functions=False,
        custom_io=False,
        retained=False,
    )
    assert "-mxfp6-matmul" in cmd and "-mos=2" in cmd and "-aic-num-cores=4" in cmd
    assert not any("retained" in c or "custom-IO" in c for c in cmd)


def test_verify_reports_a_mismatch(cache, tmp_path, capsys):
    out = tmp_path / "out"
    export(small(out, cache, budgets=()))
    model = onnx.load(out / "attention_kv.onnx", load_external_data=False)
    # Feed layer 0's v_proj where k_proj belongs: same shape, other values.
    k = "model.language_model.layers.0.self_attn.k_proj.weight"
    v = k.replace("k_proj", "v_proj")
    cast = next(n for n in model.graph.node if n.op_type == "Cast" and n.input[0] == k)
    cast.input[0] = v
    (out / "attention_kv.onnx").write_bytes(model.SerializeToString())
    assert main(["verify", str(out)]) == 1
    captured = capsys.readouterr()
    assert "MISMATCH" in captured.out and "mismatch" in captured.err


def test_default_checkpoint_is_written_once(tmp_path):
    folder = default_checkpoint(tmp_path / "d")
    stamp = os.stat(folder / "model.safetensors").st_mtime_ns
    assert default_checkpoint(tmp_path / "d") == folder
    assert os.stat(folder / "model.safetensors").st_mtime_ns == stamp
    tensors = load_file(folder / "model.safetensors")
    again = default_tensors()
    assert set(tensors) == set(again)
    for name, arr in again.items():
        assert np.array_equal(tensors[name].view(np.uint16), arr.view(np.uint16)), name


def test_sharded_checkpoint_links_every_shard(tmp_path):
    folder = tmp_path / "sharded"
    save_checkpoint(folder, DEFAULT_CONFIG, default_tensors(), max_shard_bytes=40_000)
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) > 1
    out = tmp_path / "out"
    export(small(out, folder))
    m = manifest(out)
    assert sorted(s["file"] for s in m["shards"]) == shards and m["bytes_copied"] == 0
    for name in shards:
        assert os.stat(out / name).st_ino == os.stat(folder / name).st_ino
    assert (out / "model.safetensors.index.json").is_file()
    used = set()
    for g in m["graphs"]:
        model = onnx.load(out / g["file"], load_external_data=False)
        used |= {
            e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"
        }
    assert len(used) > 1
    assert all(ok for *_, ok in verify(out))


def test_shards_in_subfolders_with_one_base_name(tmp_path):
    folder = tmp_path / "nested"
    save_checkpoint(folder, DEFAULT_CONFIG, default_tensors(), max_shard_bytes=40_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    moved = {}
    for i, shard in enumerate(sorted(set(index["weight_map"].values()))):
        (folder / f"part{i}").mkdir()
        (folder / shard).rename(folder / f"part{i}" / "shard.safetensors")
        moved[shard] = f"part{i}/shard.safetensors"
    index["weight_map"] = {n: moved[f] for n, f in index["weight_map"].items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    out = tmp_path / "out"
    export(small(out, folder))
    assert sorted(s["file"] for s in manifest(out)["shards"]) == sorted(moved.values())
    for name in moved.values():
        assert os.stat(out / name).st_ino == os.stat(folder / name).st_ino
    assert all(ok for *_, ok in verify(out))


def test_tower_saved_without_model_prefix(tmp_path):
    tensors = {
        n.removeprefix("model."): a
        for n, a in default_tensors().items()
        if n.startswith(("model.vision_tower.", "model.embed_vision."))
    }
    folder = tmp_path / "unprefixed"
    save_checkpoint(folder, DEFAULT_CONFIG, tensors)
    out = tmp_path / "out"
    export(small(out, folder))
    (graph,) = manifest(out)["graphs"]
    assert graph["outputs"][0]["name"] == "vision_embeds"
    assert "embed_vision.embedding_projection.weight" in graph["weights"]
    assert all(ok for *_, ok in verify(out))


def test_help_documents_every_option(capsys):
    assert main(["export", "--help"]) == 0
    text = capsys.readouterr().out
    flags = {
        "model": "--model",
        "out": "--out",
        "budgets": "--budgets",
        "blocking": "--blocking",
        "attention_layers": "--attention-layers",
        "batch_size": "--batch-size",
        "seq_len": "--seq-len",
        "ctx_len": "--ctx-len",
        "weights": "--weights",
        "sub_functions": "--no-subfunctions",
        "legacy_specializations": "--legacy-specializations",
        "kv_dtype": "--kv-dtype",
        "num_cores": "--num-cores",
        "mxfp6": "--mxfp6",
        "mos": "--mos",
        "mdp_config": "--mdp-config",
        "hw_version": "--hw-version",
        "hash_shards": "--no-hash",
        "force": "--force",
        "verify": "--no-verify",
        "graphs": "--graphs",
        "prefill_blocking": "--prefill-blocking",
        "decode_blocking": "--decode-blocking",
        "sliding_ring": "--sliding-ring",
        "full_batch_size": "--full-batch-size",
        "num_devices": "--num-devices",
        "phases": "--prefill-only",
        "split_programs": "--split-programs",
        "vision_tiles": "--vision-tiles",
        "audio_budgets": "--audio-budgets",
        "audio_clips": "--audio-clips",
        "clip_fp16": "--clip-fp16",
        "comp_ctx_lengths_prefill": "--comp-ctx-lengths-prefill",
        "comp_ctx_lengths_decode": "--comp-ctx-lengths-decode",
        "moe_prefill": "--moe-prefill",
        "moe_decode": "--moe-decode",
        "assistant": "--assistant",
        "num_speculative_tokens": "--num-speculative-tokens",
    }
    assert set(flags) == {f.name for f in dataclasses.fields(ExportOptions)}
    for flag in [*flags.values(), "--decode-only"]:
        assert flag in text


def test_export_options_left_out_take_export_options_defaults(monkeypatch, tmp_path):
    """The command line sets only what it is given: every other option is ExportOptions'
    default (codegen.export.options holds the values both read), so the two cannot drift apart."""
    import codegen.export.command

    seen = {}

    def capture(opts):
        seen["opts"] = opts
        raise ValueError("captured")

    monkeypatch.setattr(codegen.export.command, "export", capture)
    assert main(["export", "--out", str(tmp_path / "o")]) == 2
    opts = seen["opts"]
    assert opts == ExportOptions(out=tmp_path / "o", blocking=opts.blocking)
    assert main(["export", "--out", str(tmp_path / "o"), "--seq-len", "64", "--no-verify"]) == 2
    assert (seen["opts"].seq_len, seen["opts"].verify, seen["opts"].ctx_len) == (64, False, 256)


@pytest.mark.parametrize(
    ("options", "names", "why"),
    [
        ({}, ["vision", "language"], None),
        (dict(split_programs=True), ["vision", "prefill", "decode"], "--split-programs"),
        (dict(phases=("prefill",)), ["vision", "prefill"], "--prefill-only"),
        (dict(prefill_blocking=("qkv", {"num_kv_blocks": 2})), ["vision", "prefill", "decode"],
         "prefill blocking 'qkv' plans its blocks"),
        (dict(decode_blocking=("kv_headpar", {"num_kv_blocks": 2})),
         ["vision", "prefill", "decode"], "decode blocking 'kv_headpar'"),
        (dict(full_batch_size=2, decode_blocking=("kv_batch_fold", {"num_kv_blocks": 2})),
         ["vision", "prefill", "decode"], "decode blocking 'kv_batch_fold'"),
    ],
)  # fmt: skip
def test_one_language_program_where_the_phases_share_a_graph(cache, options, names, why):
    """By default prefill and decode are one `language` program (prefill and decode
    specializations of one graph, one retained state); two programs where a phase's blocking
    plans its blocks from the step's sizes, on --split-programs, or in a one-phase export,
    each named by its reason."""
    from codegen.export.specs import _language_options, graph_specs, one_program
    from codegen.graphs import text_config
    from weights import open_checkpoint

    checkpoint = open_checkpoint(cache)
    opts = ExportOptions(out=None, budgets=(70,), **options)
    assert [s.name for s in graph_specs(checkpoint, opts)] == names
    cfg = text_config(checkpoint.config)
    asked = _language_options(opts, cfg, False, 0)
    split = one_program(opts, asked, False)
    assert split is None if why is None else split.startswith(why), split


def test_moe_pairs_that_take_other_paths_stay_two_programs():
    """MoE: one program only with one mode in both phases that is not nsp (its chunks are cut
    from the step's token count); QEfficient's default pair, prefill nsp and decode gather,
    stays two programs."""
    from codegen.graphs.language import one_program_refusal

    dense = ("none", {})
    assert one_program_refusal(dense, dense, "gather", "gather", False) is None
    assert one_program_refusal(dense, dense, "dense", "dense", False) is None
    assert "take different paths" in one_program_refusal(dense, dense, "nsp", "gather", False)
    assert "nsp cuts its chunks" in one_program_refusal(dense, dense, "nsp", "nsp", False)
    assert "folds the batch" in one_program_refusal(dense, dense, "dense", "dense", True)
