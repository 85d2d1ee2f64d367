"""Weights a prepared graph reads: the change watch, moves, and what cannot be followed (CPU)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from nimble.errors import WeightsChangedError
from nimble.ir.taskgraph import Buffer, BufferKind, TaskGraph
from nimble.engine.weights import EPOCH, Weights, named_weights, watch_modules


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).eval()


def _graph_of(model) -> TaskGraph:
    """A TaskGraph whose param buffers are the model's storages, as the recorder makes them."""
    g = TaskGraph()
    seen = set()
    for name, t in named_weights(model).items():
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            g.buffers.append(Buffer(len(g.buffers), BufferKind.PARAM, st.nbytes(),
                                    st.data_ptr(), name))
    return g


def test_every_weight_is_bound_and_its_storage_held():
    model = _model()
    w = Weights(model, _graph_of(model))
    names = {b.name for b in w.bindings}
    assert names == set(named_weights(model))
    weight = model[0].weight
    held = w.held[next(b.buffer for b in w.bindings if b.name == "0.weight")]
    model[0].weight = nn.Parameter(torch.zeros(8, 8))
    del weight
    assert held.data_ptr() and held.nbytes() == 8 * 8 * 4  # still alive: the graph may read it


def test_the_watch_sees_assignment_apply_and_load_state_dict_assign():
    watch_modules()
    watch_modules()  # idempotent: one wrapper, not two
    assert getattr(nn.Module._apply, "_nimble_watch", False)
    model = _model()
    for change in (lambda: setattr(model[0], "bias", nn.Parameter(torch.zeros(8))),
                   lambda: model.double().float(),
                   lambda: model.load_state_dict(_model().state_dict(), assign=True),
                   lambda: model[1].register_buffer("extra", torch.zeros(1))):
        before = EPOCH[0]
        change()
        assert EPOCH[0] > before


def test_moved_weights_of_the_same_layout_are_followed():
    model = _model()
    w = Weights(model, _graph_of(model))
    assert w.moves() == {}
    model.load_state_dict(_model().state_dict(), assign=True)
    moves = w.moves()
    assert set(moves) == {b.buffer for b in w.bindings}
    bases = [0] * 16
    for bid, (delta, storage) in moves.items():
        bases[bid] = storage.data_ptr() - delta
    w.check_inside(bases, moves)
    released = w.accept(moves)
    assert len(released) == len(moves)
    assert w.moves() == {}  # the new places are now the bound ones
    assert not w.stale()


def test_in_place_updates_are_not_moves():
    model = _model()
    w = Weights(model, _graph_of(model))
    model.load_state_dict(_model().state_dict())  # copies into the same memory
    with torch.no_grad():
        model[0].weight.mul_(2)
    assert w.moves() == {}


@pytest.mark.parametrize("change,what", [
    (lambda m: m.half(), "float16"),
    (lambda m: setattr(m[0], "weight", nn.Parameter(torch.zeros(4, 8))), r"\(4, 8\)"),
    (lambda m: setattr(m[0], "weight", nn.Parameter(torch.zeros(8, 8).t())), "strides"),
    (lambda m: m[1].__delattr__("running_mean") or m[1].register_buffer("running_mean", None),
     "no longer has"),
])
def test_a_weight_that_changed_layout_or_vanished_is_a_typed_error(change, what):
    model = _model()
    w = Weights(model, _graph_of(model))
    change(model)
    with pytest.raises(WeightsChangedError, match=what):
        w.moves()
