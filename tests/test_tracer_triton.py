"""The op tracer's record of Inductor's Triton launches (no GPU: a stand-in launcher class)."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from nimble.record import tracer
from nimble.record.raw import TensorSpan
from nimble.record.tracer import ModulePaths, OpTracer, triton_arg_names, triton_arg_writes

HEURISTICS = "torch._inductor.runtime.triton_heuristics"


def test_argument_roles_follow_inductors_names():
    assert not triton_arg_writes("in_ptr0")
    assert triton_arg_writes("out_ptr3") and triton_arg_writes("in_out_ptr0")
    assert triton_arg_writes("ws_ptr")  # a name Nimble does not know: written, to stay safe
    assert triton_arg_writes("in_ptr1", frozenset({"in_ptr1"}))  # listed as mutated


def test_argument_names_come_from_the_kernel_or_its_signature():
    fn = types.SimpleNamespace(arg_names=["in_ptr0", "out_ptr0", "xnumel", "XBLOCK"])
    assert triton_arg_names(types.SimpleNamespace(fn=fn))[:2] == ["in_ptr0", "out_ptr0"]
    meta = {"signature": {"in_out_ptr0": "*fp32", "xnumel": "i32"}}
    assert triton_arg_names(types.SimpleNamespace(fn=None, triton_meta=meta)) == \
        ["in_out_ptr0", "xnumel"]
    assert triton_arg_names(object()) == []


@pytest.fixture
def launcher(monkeypatch):
    """A stand-in for Inductor's ``CachingAutotuner``: each launch adds a graph node and runs
    an ATen op (as a launch that allocates its scratch would)."""
    state = {"nodes": 0, "allocs": 0}

    class CachingAutotuner:
        def __init__(self, name, arg_names, mutated=()):
            self.fn = types.SimpleNamespace(__name__=name, arg_names=arg_names)
            self.mutated_arg_names = list(mutated)

        def run(self, *args, stream):
            torch.empty(4)  # dispatched inside the launch
            state["allocs"] += 1
            state["nodes"] += 1
            return stream

    module = types.ModuleType(HEURISTICS)
    module.CachingAutotuner = CachingAutotuner
    monkeypatch.setitem(sys.modules, HEURISTICS, module)
    # CPU tensors stand for device ones: their span is their address and byte size.
    monkeypatch.setattr(tracer, "tensor_span", lambda t, write: TensorSpan(
        t.data_ptr(), t.numel() * t.element_size(), write))
    return CachingAutotuner, state


def test_each_launch_is_an_op_named_by_its_kernel_with_read_and_written_spans(launcher):
    autotuner, state = launcher
    original = autotuner.run
    a, b, c = torch.zeros(8), torch.zeros(8), torch.zeros(2)
    kernel = autotuner("triton_poi_fused_relu_0", ["in_ptr0", "out_ptr0", "in_out_ptr0", "xnumel"])
    t = OpTracer(lambda: state["nodes"], lambda: state["allocs"], ModulePaths(None))
    with t:
        assert kernel.run(a, b, c, 8, stream=7) == 7
        torch.add(a, 1)
    assert autotuner.run is original  # unpatched on exit
    kernel.run(a, b, c, 8, stream=0)  # not traced
    assert [op.name for op in t.ops] == ["triton_poi_fused_relu_0", "aten::add.Tensor"]
    launch = t.ops[0]
    assert (launch.node_begin, launch.node_end, launch.alloc_begin, launch.alloc_end) == \
        (0, 1, 0, 1)
    assert [(s.start, s.size, s.write) for s in launch.spans] == [
        (a.data_ptr(), 32, False), (b.data_ptr(), 32, True), (c.data_ptr(), 8, True)]


def test_the_launcher_is_restored_when_the_traced_code_raises(launcher):
    autotuner, state = launcher
    original = autotuner.run
    t = OpTracer(lambda: state["nodes"], lambda: state["allocs"], ModulePaths(None))
    with pytest.raises(RuntimeError, match="boom"):
        with t:
            raise RuntimeError("boom")
    assert autotuner.run is original


def test_without_inductor_loaded_nothing_is_patched(monkeypatch):
    monkeypatch.delitem(sys.modules, HEURISTICS, raising=False)
    x = torch.zeros(2)
    t = OpTracer(lambda: 0, lambda: 0, ModulePaths(None))
    with t:
        torch.add(x, 1)
    assert [op.name for op in t.ops] == ["aten::add.Tensor"]
