"""Recorded transformers decoders: GPT-2 and the small Llama of tools/record_fixture.py, fp16,
input ids of batch 1 x 128 tokens.  Every layer is in the recording, its attention among the
ops; the schedule is valid and runs branches side by side, and the arena plan passes the
independent checker while sharing bytes.

The fixtures are recorded on a GPU with transformers installed
(``python3 tools/record_fixture.py gpt2 llama_small --dtype float16``); until they exist the
tests skip, saying so.
"""
from __future__ import annotations

import re

import pytest

from helpers import FIXTURE_DIR, load_tool
from nimble.analysis.deps import build_dag, transitive_reduction
from nimble.analysis.memplan import plan_memory
from nimble.analysis.plan_check import check_plan
from nimble.analysis.schedule import assign_streams, check_schedule
from nimble.ir.taskgraph import TaskGraph


def _tool():
    return load_tool("record_fixture")


#: Per model: its layers (GPT2Config()'s twelve; the small Llama's), the module path of a
#: layer's operations (the wrapper holds the decoder as ``model``), and the fewest tasks its
#: schedule must run side by side (the token and position embeddings and the mask are
#: independent; a Llama layer's query, key and value projections are too).
DECODERS = {
    "gpt2": (12, re.compile(r"^model\.h\.(\d+)\."), 2),
    "llama_small": (_tool().LLAMA_SMALL["num_hidden_layers"],
                    re.compile(r"^model\.layers\.(\d+)\."), 3),
}


def _fixture(name: str) -> TaskGraph:
    path = FIXTURE_DIR / f"{name}_float16.json.gz"
    if not path.exists():
        pytest.skip(f"{path.name} is not recorded yet: on a GPU with transformers, run "
                    "python3 tools/record_fixture.py gpt2 llama_small --dtype float16")
    return TaskGraph.load(path)


@pytest.mark.parametrize("name", DECODERS)
def test_every_layer_and_its_attention_are_recorded_and_resolved(name):
    layers, layer_path, _ = DECODERS[name]
    g = _fixture(name)
    assert g.meta["model"] == name and g.meta["batch"] == 1
    assert [t.id for t in g.kernel_tasks() if t.op < 0] == []
    assert g.unresolved_pointers() == []
    seen = {int(m.group(1)) for op in g.ops if (m := layer_path.match(op.module or ""))}
    assert seen == set(range(layers))
    attention = [op for op in g.ops if "scaled_dot_product" in op.name]
    assert {int(layer_path.match(op.module).group(1)) for op in attention} == set(range(layers))
    assert g.inputs[0].dtype == "int64" and g.inputs[0].shape == [1, 128]


@pytest.mark.parametrize("name", DECODERS)
def test_the_schedule_runs_branches_side_by_side_and_the_plan_passes_the_checker(name):
    _, _, width = DECODERS[name]
    g = _fixture(name)
    dag = build_dag(g)
    schedule = assign_streams(dag, reduced=transitive_reduction(dag))
    check_schedule(dag, schedule)
    assert schedule.width >= width and len(schedule.streams) >= width
    edges = schedule.edges()
    plan = plan_memory(g, edges)
    check_plan(g, edges, plan)
    # the layers' intermediates share bytes
    assert plan.lower_bound_bytes <= plan.arena_bytes < plan.buffer_bytes
