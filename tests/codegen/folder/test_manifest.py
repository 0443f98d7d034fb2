"""`codegen.folder.manifest`: manifest.json read back as the records export wrote, another format
refused by name, an older folder's missing keys given their old meaning."""

import json

import pytest

from codegen.export.defaults import default_checkpoint
from codegen.folder import manifest
from codegen.folder.manifest import FORMAT, MANIFEST, VerifyError
from tests.util import folder_copy, small_export


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return default_checkpoint(tmp_path_factory.mktemp("default") / "model")


@pytest.fixture(scope="module")
def exported(checkpoint, tmp_path_factory):
    return small_export(checkpoint, tmp_path_factory)


@pytest.fixture(scope="module")
def split(checkpoint, tmp_path_factory):
    """An export with prefill and decode as two programs, as every export before the
    language program wrote them."""
    return small_export(checkpoint, tmp_path_factory, split_programs=True)


def _copy_with(exported, tmp_path, change):
    """A copy of the export whose parsed manifest.json `change` edited in place."""
    folder = folder_copy(exported, tmp_path)
    data = json.loads((folder / MANIFEST).read_text())
    change(data)
    (folder / MANIFEST).write_text(json.dumps(data))
    return folder


# the keys and their order manifest.json has been written with (readers of the file rely on them)
TOP = ["format", "source", "opset", "options", "shards", "bytes_copied", "graphs"]
GRAPH = ["name", "file", "kind", "options", "weights_mode", "clip_fp16", "weight_spec"]
GRAPH += ["sub_functions", "functions", "nodes", "onnx_bytes", "trace_s", "inputs", "outputs"]
GRAPH += ["weights", "specializations", "retained_state"]


def test_a_real_manifest_round_trips_byte_for_byte(exported):
    text = (exported / MANIFEST).read_text()
    data = json.loads(text)
    assert text == json.dumps(data, indent=2) + "\n"
    assert list(data) == [*TOP, "retained_layout", "assistant"]
    assert list(data["shards"][0]) == ["file", "bytes", "copied", "sha256", "blake3"]
    assert all(list(g) == GRAPH for g in data["graphs"])
    assert list(data["graphs"][0]["inputs"][0]) == ["name", "dtype", "shape", "shapes"]
    loaded = manifest.load(exported)
    assert [g.kind for g in loaded.graphs] == ["vision", "language"]
    assert loaded.to_json() == text


@pytest.mark.parametrize("found", ["gemma4-qaic-export/0", None, 1])
def test_another_format_is_refused_by_name(exported, tmp_path, found):
    folder = _copy_with(exported, tmp_path, lambda d: d.update(format=found))
    with pytest.raises(VerifyError) as e:
        manifest.load(folder)
    assert f"{MANIFEST} format {found!r}: expected {FORMAT!r}" in str(e.value)


def test_a_manifest_that_is_not_an_object_is_refused(tmp_path):
    (tmp_path / MANIFEST).write_text("[]")
    with pytest.raises(VerifyError, match=f"format None: expected {FORMAT!r}"):
        manifest.load(tmp_path)


def _older(data):
    """What an export before the upgraded keys wrote."""
    del data["retained_layout"], data["assistant"]
    for shard in data["shards"]:
        del shard["sha256"], shard["blake3"]
    for g in data["graphs"]:
        del g["weight_spec"], g["clip_fp16"]
        for key in ("tiles", "full_batch_size", "folded_cache", "drafts"):
            g["options"].pop(key, None)


def test_an_older_folder_loads_with_the_old_meaning(split, tmp_path):
    now = manifest.load(split)
    old = manifest.load(_copy_with(split, tmp_path, _older))
    assert old.retained_layout is None and now.retained_layout is not None
    assert old.assistant is None
    assert all(s.digest is None for s in old.shards)
    assert all(g.weight_spec is None and g.clip_fp16 is None for g in old.graphs)
    vision, prefill, decode = old.graphs
    assert vision.options["tiles"] == (1, 1)
    for g in (prefill, decode):
        assert g.options["full_batch_size"] is None and g.options["folded_cache"] is False
        assert g.options["drafts"] == 0  # no speculate graph: the ring of W slots
    # what the older folder did record keeps its order; the upgraded keys follow
    upgraded = ["full_batch_size", "folded_cache", "drafts"]
    recorded = [k for k in now.graphs[2].options if k not in upgraded]
    assert list(decode.options) == recorded + upgraded


@pytest.mark.parametrize("where", ["manifest", "graph"])
def test_an_unknown_key_is_named(exported, tmp_path, where):
    def change(data):
        (data if where == "manifest" else data["graphs"][0])["surprise"] = 1

    with pytest.raises(VerifyError, match="unknown key 'surprise'"):
        manifest.load(_copy_with(exported, tmp_path, change))


def test_a_missing_key_is_named(exported, tmp_path):
    folder = _copy_with(exported, tmp_path, lambda d: d["graphs"][0].pop("nodes"))
    with pytest.raises(VerifyError, match="'nodes'"):
        manifest.load(folder)
