"""The per-call path's checked driver functions (nimble.driver.calls), on stand-in bindings."""
from types import SimpleNamespace

import pytest

from nimble.driver import calls
from nimble.errors import CudaError


@pytest.fixture
def fake_bindings(monkeypatch):
    codes = []  # what the next calls of the fake cuGraphLaunch return
    seen = []

    def launch(exec_handle, stream):
        seen.append((exec_handle, stream))
        return (codes.pop(0),)

    fake = SimpleNamespace(
        cuGraphLaunch=launch,
        cuGetErrorName=lambda code: (0, b"CUDA_ERROR_LAUNCH_FAILED" if code == 719 else b"?"),
        CUresult=SimpleNamespace(CUDA_SUCCESS=0))
    monkeypatch.setattr(calls, "_drv", fake)
    return codes, seen


def test_a_status_call_passes_its_arguments_and_returns_nothing_on_success(fake_bindings):
    codes, seen = fake_bindings
    launch = calls.checked_status("cuGraphLaunch")
    codes.append(0)
    assert launch("exec", "stream") is None
    assert seen == [("exec", "stream")]


def test_a_failed_status_call_raises_naming_the_call_and_the_error(fake_bindings):
    codes, _ = fake_bindings
    launch = calls.checked_status("cuGraphLaunch")
    codes.append(719)
    with pytest.raises(CudaError, match="cuGraphLaunch failed with CUDA_ERROR_LAUNCH_FAILED") as e:
        launch(1, 2)
    assert (e.value.call, e.value.code, e.value.name) == \
        ("cuGraphLaunch", 719, "CUDA_ERROR_LAUNCH_FAILED")


@pytest.fixture
def fake_graphs(monkeypatch):
    """Stand-in bindings holding graphs as sets of node names; a clone's node is ``name'``."""
    graphs = {1: {"a", "b", "c"}}
    destroyed = []

    def clone(graph):
        graphs[len(graphs) + 1] = {n + "'" for n in graphs[graph]}
        return 0, len(graphs)

    def find_in_clone(node, clone_graph):
        return (0, node + "'") if node + "'" in graphs[clone_graph] else (500, None)

    def destroy_node(node):
        for nodes in graphs.values():
            nodes.discard(node)
        return (0,)

    fake = SimpleNamespace(
        cuGraphClone=clone, cuGraphNodeFindInClone=find_in_clone, cuGraphDestroyNode=destroy_node,
        cuGraphDestroy=lambda graph: destroyed.append(graph) or (0,),
        cuGetErrorName=lambda code: (0, b"CUDA_ERROR_NOT_FOUND"),
        CUresult=SimpleNamespace(CUDA_SUCCESS=0))
    monkeypatch.setattr(calls, "_drv", fake)
    return graphs, destroyed


def test_a_graph_copied_without_some_nodes_keeps_the_others_and_leaves_the_original(fake_graphs):
    from nimble.driver import Graph

    graphs, destroyed = fake_graphs
    original = Graph(1)
    copy = original.copy_without(["b"])
    assert graphs[copy.handle] == {"a'", "c'"}
    assert graphs[1] == {"a", "b", "c"}
    copy.close()
    assert destroyed == [copy.handle]


def test_a_failed_removal_frees_the_copy_and_names_the_call(fake_graphs):
    from nimble.driver import Graph

    graphs, destroyed = fake_graphs
    original = Graph(1)
    with pytest.raises(CudaError, match="cuGraphNodeFindInClone failed"):
        original.copy_without(["a", "missing"])
    assert destroyed == [2]  # the half-pruned clone, not the original
    assert graphs[1] == {"a", "b", "c"}


def test_a_clone_names_its_own_node_for_each_node_asked_and_a_failure_frees_it(fake_graphs):
    from nimble.driver import Graph

    graphs, destroyed = fake_graphs
    original = Graph(1)
    copy, nodes = original.clone(["c", "a"])
    assert graphs[copy.handle] == {"a'", "b'", "c'"} and nodes == ["c'", "a'"]
    with pytest.raises(CudaError, match="cuGraphNodeFindInClone failed"):
        original.clone(["a", "missing"])
    assert destroyed == [3]  # the failed clone alone


def test_late_edges_go_to_the_driver_as_one_call_and_no_pairs_make_no_call(monkeypatch):
    from nimble import driver

    calls_made = []
    fake = SimpleNamespace(
        cuGraphAddDependencies=lambda *args: calls_made.append(args) or (0,),
        cuGetErrorName=lambda code: (0, b"CUDA_ERROR_INVALID_VALUE"),
        CUresult=SimpleNamespace(CUDA_SUCCESS=0))
    monkeypatch.setattr(calls, "_drv", fake)
    driver.add_dependencies("graph", [])
    assert calls_made == []
    driver.add_dependencies("graph", [("a", "x"), ("a", "y")])
    assert calls_made == [("graph", ["a", "a"], ["x", "y"], None, 2)]


def test_a_refused_late_edge_raises_naming_the_call(monkeypatch):
    from nimble import driver

    fake = SimpleNamespace(
        cuGraphAddDependencies=lambda *args: (1,),
        cuGetErrorName=lambda code: (0, b"CUDA_ERROR_INVALID_VALUE"),
        CUresult=SimpleNamespace(CUDA_SUCCESS=0))
    monkeypatch.setattr(calls, "_drv", fake)
    with pytest.raises(CudaError, match="cuGraphAddDependencies failed with "
                                        "CUDA_ERROR_INVALID_VALUE"):
        driver.add_dependencies("graph", [("a", "x")])


@pytest.fixture
def fake_captured_graph(monkeypatch):
    """Stand-in bindings holding one captured graph of three nodes, under raw handle 7."""
    nodes = {7: ["n0", "n1", "n2"]}

    class CUgraph:
        def __init__(self, raw):
            self.raw = raw

    def get_nodes(graph, count):
        if graph.raw not in nodes:
            return (400, None, 0)
        held = nodes[graph.raw]
        return (0, held[:count] + [None] * (count - len(held)) if count else None, len(held))

    fake = SimpleNamespace(
        CUgraph=CUgraph, cuGraphGetNodes=get_nodes,
        cuGetErrorName=lambda code: (0, b"CUDA_ERROR_INVALID_HANDLE"),
        CUresult=SimpleNamespace(CUDA_SUCCESS=0))
    monkeypatch.setattr(calls, "_drv", fake)
    return nodes


def test_a_borrowed_graph_is_read_through_its_raw_handle(fake_captured_graph):
    from nimble import driver

    assert driver.borrowed_graph(7).raw == 7
    assert driver.node_count_of(7) == 3
    assert driver.graph_nodes_of(7) == ["n0", "n1", "n2"]


def test_reading_an_unknown_raw_graph_raises_naming_the_call(fake_captured_graph):
    from nimble import driver

    with pytest.raises(CudaError, match="cuGraphGetNodes failed with CUDA_ERROR_INVALID_HANDLE"):
        driver.graph_nodes_of(8)


def test_every_driver_function_the_package_calls_is_exported_by_nimble_driver():
    """``driver.X`` anywhere outside ``nimble/driver/`` must exist: a missing export fails only
    when the GPU path reaches it (the event nodes' rebuild did, on two GPUs)."""
    import re
    from pathlib import Path

    import nimble.driver

    root = Path(nimble.driver.__file__).resolve().parent.parent
    missing = sorted({f"{p.relative_to(root.parent)}: driver.{m.group(1)}"
                      for p in root.rglob("*.py") if "driver" not in p.relative_to(root).parts
                      for m in re.finditer(r"\bdriver\.([A-Za-z_]\w*)", p.read_text())
                      if not hasattr(nimble.driver, m.group(1))})
    assert not missing, missing
