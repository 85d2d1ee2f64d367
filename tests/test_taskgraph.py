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


def test_a_task_read_at_once_equals_the_task_read_field_by_field():
    """The reader's fast path (every field of the exact type json.loads makes, no paths built)
    gives the task the field-by-field reader gives, on every task of every recorded fixture;
    a row with any field of another type is left to the field-by-field reader."""
    import gzip
    import json

    from helpers import FIXTURE_DIR
    from nimble.ir import taskgraph as tg

    count = 0
    for path in sorted(FIXTURE_DIR.glob("*.json.gz")):
        for k, row in enumerate(json.loads(gzip.decompress(path.read_bytes()))["tasks"]):
            assert tg._plain_task(row) == tg._task_fields(row, f"tasks[{k}]"), (path.name, k)
            count += 1
    assert count > 10000
    row = {"id": 3, "kind": "kernel", "grid": [1, 2, 3], "params": "00ff",
           "pointers": [["size", 1, 2, 3]], "fields": {"dst": 5}, "duration_us": 2}
    assert tg._plain_task(row) == tg._task_fields(row, "t")
    for key, wrong in (("id", True), ("grid", [1, 2]), ("grid", None), ("params", "zz"),
                       ("duration_us", False), ("fields", {"x": [1]}), ("op", None),
                       ("pointers", [[1.5, 1, 2, 3]]), ("param_layout", [[0, 8.0]])):
        assert tg._plain_task({**row, key: wrong}) is None, key
