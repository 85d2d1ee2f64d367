"""A saved file whose container or manifest does not hold is a LoadError naming what is wrong,
on any machine and before anything reaches the GPU: ``nimble.load`` reads and checks the whole
file (:mod:`nimble.ir.saved_manifest`) before it asks for a GPU."""
from __future__ import annotations

import pytest
import torch

import nimble
from nimble.errors import LoadError, NoGpuError
from nimble.ir.saved_format import SavedFile
from nimble.ir.saved_manifest import MEMCPY_FIELDS, MEMSET_FIELDS, check_manifest
from nimble.ir.synthetic import branchy_graph

from saved_fixture import saved_file_of



def _small() -> SavedFile:
    return saved_file_of(branchy_graph(seed=1))


def _damaged(how: str) -> bytes:
    data = bytearray(_small().to_bytes())
    if how == "truncated":
        return bytes(data[:-100])
    if how == "appended":
        return bytes(data) + b"\0" * 8
    if how == "mistyped":
        saved = _small()
        saved.manifest["buckets"][0]["nodes"][3]["kernel"] = "3"
        return saved.to_bytes()
    return b"#!/bin/sh\necho not a saved graph\n" * 4


# (A flipped byte: the checksum's error, before any graph is built: test_load_checksum.py.)
@pytest.mark.parametrize("how", ["truncated", "appended", "mistyped", "foreign"])
def test_a_damaged_file_is_a_load_error_before_any_gpu_work(tmp_path, no_gpu_work, how):
    path = tmp_path / "m.nimble"
    path.write_bytes(_damaged(how))
    with pytest.raises(LoadError) as e:
        nimble.load(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_a_sound_file_passes_every_check_and_then_needs_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = _small().write(tmp_path / "m.nimble")
    with pytest.raises(NoGpuError):
        nimble.load(path)


def test_the_first_field_of_the_wrong_type_is_named_by_its_path():
    saved = _small()
    saved.manifest["buckets"][0]["nodes"][3]["kernel"] = "3"
    with pytest.raises(LoadError, match=r"^m\.nimble: buckets\[0\]\.nodes\[3\]\.kernel is a "
                                        r"string \('3'\), not an integer: the file is damaged"):
        check_manifest(saved.manifest, len(saved.blobs), "m.nimble")


def test_a_sound_manifest_passes():
    saved = _small()
    check_manifest(saved.manifest, len(saved.blobs))


def test_an_embedded_image_stored_packed_passes_with_its_size_unpacked():
    saved = _small()
    saved.manifest["binaries"][0].update(packed="lz4", image_size=123456)
    check_manifest(saved.manifest, len(saved.blobs))
    saved.manifest["binaries"][0]["image_size"] = -1
    with pytest.raises(LoadError, match=r"^m\.nimble: binaries\[0\]\.image_size is -1, a "
                                        r"negative count or size"):
        check_manifest(saved.manifest, len(saved.blobs), "m.nimble")


def test_the_check_knows_what_the_driver_writes():
    from nimble.driver import stored

    assert MEMSET_FIELDS == stored._MEMSET_FIELDS and MEMCPY_FIELDS == stored._MEMCPY_FIELDS


# ---- several graphs in one file (a Generator's) --------------------------------------------

def _two_graphs(**generator) -> SavedFile:
    saved = _small()
    m = saved.manifest
    m["buckets"] = [m["buckets"][0], m["buckets"][0]]
    m["graphs"] = [{"name": "prefill/1", "buckets": [0], "instances": 1, "pad": False},
                   {"name": "decode/1", "buckets": [1], "instances": 1, "pad": False}]
    m["generator"] = {"max_cache_len": 64, "prompt_buckets": [16], "batch_sizes": [1],
                      "pad_id": 0, "steps": {"1": {"prefill": "prefill/1",
                                                   "decode": "decode/1"}}, **generator}
    return saved


def test_a_file_of_several_graphs_is_checked_and_refused_by_nimble_load(tmp_path, no_gpu_work):
    saved = _two_graphs()
    check_manifest(saved.manifest, len(saved.blobs))
    path = saved.write(tmp_path / "g.nimble")
    with pytest.raises(LoadError, match="holds 2 graphs .*Generator.load"):
        nimble.load(path)


def test_a_generators_file_passes_its_checks_before_the_gpu(tmp_path, monkeypatch):
    from nimble.generate import Generator

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = _two_graphs().write(tmp_path / "g.nimble")
    with pytest.raises(NoGpuError):
        Generator.load(path)


@pytest.mark.parametrize("change, message", [
    (lambda m: m["graphs"][1].update(buckets=[0]), r"hold buckets \[0, 0\]"),
    (lambda m: m["graphs"][1].update(name="prefill/1"), "name a graph twice"),
    (lambda m: m["graphs"][0].update(buckets=[2]), "graphs\\[0\\].buckets\\[0\\]"),
    (lambda m: m["generator"]["steps"]["1"].update(decode="decode/8"), "names no graph"),
    (lambda m: m["generator"].update(batch_sizes=[1, 2]), "steps has no '2'"),
    (lambda m: m["generator"].update(max_cache_len=0), "max_cache_len"),
])
def test_a_damaged_graph_list_or_generator_is_refused(change, message):
    saved = _two_graphs()
    change(saved.manifest)
    with pytest.raises(LoadError, match=message):
        check_manifest(saved.manifest, len(saved.blobs))


def test_inspect_names_a_generators_graphs(tmp_path, capsys):
    from nimble.cli.main import main

    path = _two_graphs().write(tmp_path / "g.nimble")
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "a Generator: batch sizes [1], prompt buckets [16], cache length 64" in out
    assert "graph prefill/1: buckets [0]" in out and "graph decode/1: buckets [1]" in out


@pytest.mark.parametrize("instances", [0, -1, 1.5, True, "2"])
def test_a_load_for_an_impossible_instance_count_says_so(tmp_path, no_gpu_work, instances):
    from nimble.errors import InputError

    path = _small().write(tmp_path / "m.nimble")
    with pytest.raises(InputError, match="instances must be an int >= 1"):
        nimble.load(path, instances=instances)


# ---- programmatic edges -----------------------------------------------------------------

def _with_programmatic(tmp_path, served, recorded=((0, 1), (1, 3))):
    graph = branchy_graph(seed=1)
    graph.meta["programmatic_edges"] = [list(e) for e in recorded]
    saved = saved_file_of(graph)
    saved.manifest["buckets"][0]["programmatic"] = [list(e) for e in served]
    return saved.write(tmp_path / "m.nimble")


def test_the_programmatic_edges_a_file_serves_are_read_back_where_the_capture_made_them(tmp_path):
    from nimble.engine.saved_reading import read_checked

    saved, _, checksum = read_checked(_with_programmatic(tmp_path, [(0, 1), (1, 3)]))
    checksum.verify()
    assert saved.manifest["buckets"][0]["programmatic"] == [[0, 1], [1, 3]]
    saved, _, checksum = read_checked(_with_programmatic(tmp_path, []))  # none served: no key, as it were
    checksum.verify()
    assert saved.manifest["buckets"][0]["programmatic"] == []


@pytest.mark.parametrize("served,message", [
    ([(2, 3)], r"buckets\[0\]\.programmatic\[0\] makes 2 -> 3 programmatic, an edge the "
               r"recording's capture did not launch so, nor one into a kernel of Nimble's"),
    ([(3, 1)], r"buckets\[0\]\.programmatic\[0\] goes from task 3 back to task 1"),
    ([(0, 10**6)], r"buckets\[0\]\.programmatic\[0\]\[1\]"),
])
def test_a_programmatic_edge_the_capture_did_not_make_is_refused_before_the_gpu(
        tmp_path, no_gpu_work, served, message):
    with pytest.raises(LoadError, match=message):
        nimble.load(_with_programmatic(tmp_path, served))


def test_a_file_may_list_an_edge_into_a_kernel_of_nimbles_that_waits_for_its_predecessor(
        tmp_path):
    """An edge the capture did not launch programmatically, into a kernel the waiting rule
    takes (nimble.ir.waiting_kernels): what a prepare with programmatic launch saves."""
    from nimble.engine.saved_reading import read_checked
    from nimble.ir.taskgraph import Op

    graph = branchy_graph(seed=1)
    kernels = [t.id for t in graph.tasks if t.kind == "kernel"]
    u, v = kernels[0], kernels[1]
    graph.ops.append(Op(len(graph.ops), "nimble::decode_attention"))
    graph.tasks[v].op, graph.tasks[v].name = len(graph.ops) - 1, "attend"
    saved = saved_file_of(graph)
    saved.manifest["buckets"][0]["programmatic"] = [[u, v]]
    back, _, _ = read_checked(saved.write(tmp_path / "w.nimble"))
    assert back.manifest["buckets"][0]["programmatic"] == [[u, v]]


def test_a_files_programmatic_edges_are_built_as_full_dependencies(monkeypatch, caplog):
    """A file that lists programmatic edges (chosen by timing in the saving process) loads
    with every edge a full dependency, and the log says so."""
    from types import SimpleNamespace

    from nimble.engine import loading

    seen = {}
    monkeypatch.setattr(loading, "build_prepared",
                        lambda *a, **kw: seen.update(kw) or SimpleNamespace())
    monkeypatch.setattr(loading, "device_launch_allowed", lambda asked: asked)
    bucket = SimpleNamespace(row={"programmatic": [[0, 1], [4, 7]]}, rec=None, schedule=None,
                             memplan=None, placement=None)
    with caplog.at_level("INFO", logger="nimble"):
        loading._build(None, bucket, None)
    assert seen["programmatic"].served == frozenset() and not seen["programmatic"].trials
    assert "serves 2 edge(s) programmatic; a loaded graph builds 0 of them" in caplog.text
    assert "every other edge as a full dependency" in caplog.text
    caplog.clear()
    bucket.row = {}  # a file saved before programmatic edges were written down
    loading._build(None, bucket, None)
    assert seen["programmatic"].served == frozenset() and not caplog.text


def test_with_load_waiting_edges_a_load_builds_the_files_edges_into_waiting_kernels_alone(
        monkeypatch, caplog):
    """LOAD_WAITING_EDGES (on by default; off, a load builds none): of the edges a file serves programmatic, those
    into one of Nimble's waiting kernels are built so; an edge between Inductor's kernels (the
    withdrawn rule's) stays a full dependency, as does an edge the file does not list."""
    from nimble.engine import loading
    from test_programmatic import _waiting_graph

    graph = _waiting_graph()  # 0 -> 1: into Nimble's GEMV on a constant weight; 0 -> 5: a
    # user's kernel named attend; 0 -> 2: a GEMV whose weight task 0 writes
    row = {"programmatic": [[0, 1], [0, 5], [0, 2]]}
    assert loading.LOAD_WAITING_EDGES  # on by default
    monkeypatch.setattr(loading, "LOAD_WAITING_EDGES", False)
    assert loading.loaded_programmatic(row, graph).served == frozenset()
    monkeypatch.setattr(loading, "LOAD_WAITING_EDGES", True)
    with caplog.at_level("INFO", logger="nimble"):
        assert loading.loaded_programmatic(row, graph).served == {(0, 1)}
    assert "serves 3 edge(s) programmatic; a loaded graph builds 1 of them" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="nimble"):
        assert loading.loaded_programmatic({"programmatic": [[0, 1]]}, graph).served == {(0, 1)}
    assert not caplog.text  # every edge listed is built as listed: nothing to say
    assert loading.loaded_programmatic({}, graph).served == frozenset()


def test_reading_a_file_times_its_mapping_and_its_checks_apart(tmp_path):
    from nimble.engine.saved_reading import read_checked

    seconds: dict = {}
    _, _, checksum = read_checked(_small().write(tmp_path / "m.nimble"), seconds)
    assert set(seconds) == {"read_file", "read_check"} and all(v >= 0 for v in seconds.values())
    checksum.verify()  # left hashing: the load waits for it later


def test_a_file_that_sums_over_the_ranks_loads_with_the_model_on_the_rank_that_saved_it(
        tmp_path, no_gpu_work):
    """A graph of Nimble's peer sums reads the table of the ranks' buffers as the model's
    weight: its file loads only with model= and on its rank, each refusal before any GPU
    work, saying what to do; its manifest's ranks are checked like any field."""
    saved = _small()
    saved.manifest["peer_sums"] = {"rank": 1, "ranks": 2}
    check_manifest(saved.manifest, len(saved.blobs))
    path = saved.write(tmp_path / "rank1.nimble")
    with pytest.raises(LoadError, match="load it with model= \\(the model made on this rank"):
        nimble.load(path)
    with pytest.raises(LoadError, match="rank 1's of 2, and this process is no process group: "
                                        "load each rank's file on that rank"):
        nimble.load(path, model=torch.nn.Linear(2, 2))
    saved.manifest["peer_sums"] = {"rank": 2, "ranks": 2}
    with pytest.raises(LoadError, match=r"peer_sums\.rank is 2, not below ranks \(2\)"):
        check_manifest(saved.manifest, len(saved.blobs), "m.nimble")


def test_a_rank_loads_only_its_own_file(monkeypatch):
    import torch.distributed as dist

    from nimble.engine.loading import check_ranks

    manifest = {"peer_sums": {"rank": 0, "ranks": 2}}
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(dist, "get_rank", lambda *a: 1)
    with pytest.raises(LoadError, match="rank 0's of 2, and this process is rank 1 of 2"):
        check_ranks(manifest, object(), "f")
    monkeypatch.setattr(dist, "get_rank", lambda *a: 0)
    check_ranks(manifest, object(), "f")
    check_ranks({}, None, "f")  # a graph of no collectives: nothing to check
