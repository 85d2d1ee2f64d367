import gzip
import json

import pytest

from nimble import Access, TaskGraph
from nimble.ir.synthetic import branchy_graph, random_graph
from nimble.ir.taskgraph import FORMAT_VERSION

from helpers import FIXTURE_PATHS, fixture_ids


@pytest.mark.parametrize("make", [branchy_graph, lambda: random_graph(40, seed=3)])
def test_round_trip_gzip_and_plain(tmp_path, make):
    g = make()
    for name in ("g.json.gz", "g.json"):
        path = g.save(tmp_path / name)
        assert TaskGraph.load(path).to_json() == g.to_json()
    with gzip.open(tmp_path / "g.json.gz", "rt") as f:
        assert json.load(f)["version"] == FORMAT_VERSION


def test_rejects_other_versions_and_formats():
    data = branchy_graph().to_json()
    with pytest.raises(ValueError, match="version"):
        TaskGraph.from_json({**data, "version": FORMAT_VERSION + 1})
    with pytest.raises(ValueError, match="not a Nimble TaskGraph"):
        TaskGraph.from_json({**data, "format": "other"})


def test_validate_catches_out_of_range_access():
    g = branchy_graph()
    size = g.buffers[0].size
    g.tasks[0].accesses.append(Access(0, size - 4, 8, False))
    with pytest.raises(ValueError, match="leaves buffer"):
        g.validate()


@pytest.mark.parametrize("path", FIXTURE_PATHS, ids=fixture_ids())
def test_fixture_loads_and_is_consistent(path):
    g = TaskGraph.load(path)
    assert g.tasks and g.buffers and g.ops
    assert all(0 <= t.op < len(g.ops) for t in g.kernel_tasks()), "every kernel attributed to an op"
    assert g.unresolved_pointers() == []
    assert g.inputs and g.outputs


def test_align_up_rounds_to_the_one_alignment():
    from nimble.ir.alignment import ALIGNMENT, align_up

    assert ALIGNMENT == 512
    assert [align_up(n) for n in (0, 1, 511, 512, 513)] == [0, 512, 512, 512, 1024]
    assert align_up(17, 8) == 24 and align_up(-1) == 0
