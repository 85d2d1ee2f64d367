"""Debugging tools on the GPU: the measured timeline (nimble.debug.timeline) and step-through
(nimble.debug.step_through)."""
from __future__ import annotations


import pytest

from debug_zoo import WIDE, ZOO_DTYPES, check_tools_on_zoo_model
from helpers import zoo_model

pytestmark = pytest.mark.gpu


def test_branchy_timeline_measures_every_task_and_shows_concurrency():
    import torch

    import nimble

    model, x = zoo_model("branchy")
    nm = nimble.Nimble(model).prepare(x, options=nimble.PrepareOptions(relaunches=4))
    fresh = torch.randn_like(x)
    want = nm(fresh).clone()
    timeline = nm.trace(fresh)
    n = len(nm.graph.tasks)
    assert len(timeline.times) == n
    assert all(0.0 <= start <= end for start, end in timeline.times)
    [phase] = timeline.summary()["phases"]
    assert phase["streams"] == len(nm.schedule.streams) > 1
    assert phase["concurrency"] > 1.0  # branches really ran side by side
    assert 0 < timeline.plain_us and 0 < timeline.instrumented_us
    # the prepared graph is untouched and still right
    assert torch.equal(nm(fresh), want)
    slices = [e for e in timeline.to_chrome()["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == n


@pytest.mark.parametrize("name,dtype", [("branchy", "float32"), ("googlenet", "float16")])
def test_a_timeline_joined_from_stamp_groups_covers_every_task_once(name, dtype):
    """Three instrumented runs, each stamping a third of the tasks: every task gets its times
    from one of them, the joined run spans about what one run takes, and it agrees with the
    single-run timeline on which streams ran."""
    import torch

    import nimble

    model, x = zoo_model(name)
    model, x = model.to(getattr(torch, dtype)), x.to(getattr(torch, dtype))
    nm = nimble.Nimble(model).prepare(x, options=nimble.PrepareOptions(relaunches=4))
    joined = nm.trace(x, start_stamps=False, groups=3)
    whole = nm.trace(x, start_stamps=False)
    n = len(nm.graph.tasks)
    assert joined.meta["groups"] == 3 and len(joined.times) == n
    assert all(0.0 <= start <= end for start, end in joined.times)
    # every task stamped: only roots may end at 0 µs, and none ends after the run could have
    assert sum(end > 0.0 for _, end in joined.times) >= n - len(nm.schedule.streams)
    [j], [w] = joined.summary()["phases"], whole.summary()["phases"]
    assert j["streams"] == w["streams"]
    assert 0.5 * w["makespan_us"] < j["makespan_us"] < 2.0 * w["makespan_us"]


def test_a_removed_sync_edge_shows_in_the_trace_as_a_broken_dependency():
    import dataclasses

    import torch

    import nimble
    from nimble.analysis.deps import build_dag
    from nimble.debug.timeline import record_timeline

    model, x = zoo_model("branchy")
    nm = nimble.Nimble(model).prepare(x, options=nimble.PrepareOptions(relaunches=4))
    state = nm.engine
    dag_edges = build_dag(nm.graph).edges()
    clean = nm.trace(x)
    assert clean.overlapped(dag_edges) == []
    # A sync edge whose consumer waited on it alone: removed, it leaves the consumer
    # is free to start that much earlier, while its producer still runs.
    times, s = clean.times, nm.schedule
    preds: dict[int, list[int]] = {}
    for u, v in s.edges():
        preds.setdefault(v, []).append(u)

    def slack(edge) -> float:
        u, v = edge
        others = [times[w][1] for w in preds[v] if w != u]
        return times[u][1] - max(others, default=times[v][0] - 1e9)
    # The GPU may still run the consumer after the producer (other work can hold the SMs), so
    # the sync edges that most hold their consumers back are tried in turn: the trace must show
    # a broken dependency for one of them.
    candidates = sorted(s.sync_edges, key=slack, reverse=True)[:6]
    assert slack(candidates[0]) > 5.0, "branchy has a sync edge that alone holds its consumer"
    seen = []
    for victim in candidates:
        faulty = dataclasses.replace(s, sync_edges=[e for e in s.sync_edges if e != victim])
        broken = record_timeline(dataclasses.replace(state, schedule=faulty), [x])
        u, v = victim
        seen.append(f"{victim}: consumer started {broken.times[v][0]:.1f} µs, producer ended "
                    f"{broken.times[u][1]:.1f} µs")
        if broken.overlapped([victim]):
            break
    else:
        raise AssertionError("no removed sync edge showed up as overlap: " + "; ".join(seen))
    torch.cuda.synchronize()


def test_a_training_step_is_traced_phase_by_phase():
    import torch

    import nimble

    tv = pytest.importorskip("torchvision")
    model = tv.models.resnet18(num_classes=10).cuda().train()
    x = torch.randn(8, 3, 32, 32, device="cuda")
    nm = nimble.Nimble(model).prepare(x, training=True, options=nimble.PrepareOptions(relaunches=2))
    rows = nm.trace().summary()["phases"]
    assert [r["name"] for r in rows] == ["forward", "backward"]
    assert all(r["makespan_us"] > 0 for r in rows)


def test_step_through_reads_an_intermediate_and_leaves_the_outputs_alone():
    import torch

    import nimble

    model, x = zoo_model("branchy")
    nm = nimble.Nimble(model).prepare(x, options=nimble.PrepareOptions(relaunches=4))
    fresh = torch.randn_like(x)
    out = nm(fresh)
    kept = out.clone()
    g = nm.graph
    out_buffer = g.outputs[0].buffer
    last_writer = max(t.id for t in g.tasks
                      if any(a.buffer == out_buffer and a.write for a in t.accesses))
    snap = nm.run_until(task=last_writer, inputs=[fresh])
    got = snap.tensor(out_buffer, out.dtype, list(out.shape), g.outputs[0].offset)
    assert torch.equal(got, kept.cpu())  # the sub-graph computed the output's final value
    assert torch.equal(out, kept)  # and the caller's output view is as it was
    # an earlier op's result matches eager's for the same input
    first_conv = next(o for o in g.ops if o.name.startswith("aten::convolution"))
    snap = nm.run_until(op=first_conv.index, inputs=[fresh])
    conv = model.stem[0][0]
    with torch.no_grad():
        eager = torch.nn.functional.conv2d(fresh, conv.weight, conv.bias, padding=conv.padding)
    size = eager.numel() * eager.element_size()
    written = [b for b in snap.op_outputs(first_conv.index) if b.numel() == size]
    assert written, "the convolution's output range is among its written accesses"
    torch.testing.assert_close(written[0].view(eager.dtype).view(eager.shape), eager.cpu())


def test_every_stop_of_a_walk_repeats_bit_for_bit_and_equals_its_own_sub_graph():
    """A walk's stops (one whole copy of the graph, pruned to each stop's tasks) give the bytes
    a graph built of exactly those tasks gives, twice in a row, after an eager run of the model
    in the same process (as ``first_divergence`` does).  A copy with the other nodes switched
    off (``cuGraphNodeSetEnabled``) failed this on the H200 in some processes: it ran switched-off
    nodes in about every other launch."""
    import torch

    import nimble
    from nimble.debug.step_through import StepThrough, run_until, select_tasks

    model, x = zoo_model("resnet50")
    nm = nimble.Nimble(model).prepare(x, options=nimble.PrepareOptions(relaunches=4))
    with torch.no_grad():
        model(x)
    state, g = nm.engine, nm.graph
    stepper = StepThrough(state, 0)
    bad = []
    try:
        for op in sorted({t.op for t in g.tasks if t.op >= 0}):
            targets = select_tasks(g, op=op)
            read = {a.buffer for a in g.ops[op].accesses if a.write}
            runs = [run_until(state, targets, [x], read, stepper) for _ in range(2)]
            runs.append(run_until(state, targets, [x], read, None))
            if any(not torch.equal(runs[0].buffers[b], r.buffers[b])
                   for r in runs[1:] for b in read):
                bad.append(f"op {op} {g.ops[op].name} {g.ops[op].module}")
    finally:
        stepper.close()
    assert not bad, bad[:5]


def test_a_group_of_stops_reads_what_each_stop_alone_reads():
    """The walk's shared runs (nimble.debug.stop_groups) on a real graph: each member's output
    bytes, read from its group's one run, equal those of a run up to that op alone."""
    import torch

    import nimble
    from nimble.debug.eager_twins import align, eager_ops
    from nimble.debug.step_through import StepThrough, run_until, select_tasks
    from nimble.debug.stop_groups import walk_groups

    model, x = zoo_model("googlenet")
    nm = nimble.Nimble(model).prepare(x, options=nimble.PrepareOptions(relaunches=4))
    state, g = nm.engine, nm.graph
    with torch.no_grad():
        aligned = align(g, eager_ops(model, (x,)))
    stepper = StepThrough(state, 0)

    def written(ops):
        return {a.buffer for op in ops for a in g.ops[op].accesses if a.write}

    def run_group(ops):
        tasks = [t for op in ops for t in select_tasks(g, op=op)]
        return run_until(state, tasks, [x], written(ops), stepper)
    try:
        grouped = walk_groups(state, aligned, run_group)
        with_tasks = {t.op for t in g.tasks}
        ops = [op.index for op in aligned if op.pairs and op.index in with_tasks]
        groups = [group for group in grouped.plan(ops) if len(group) > 1]
        assert len(groups) >= 10, len(groups)
        bad = []
        for group in groups:
            shared = grouped.run(group)
            for op in group:
                alone = run_until(state, select_tasks(g, op=op), [x], written([op]), stepper)
                for a, _ in aligned[op].pairs:
                    if not torch.equal(shared.buffer(a.buffer)[a.offset:a.end],
                                       alone.buffer(a.buffer)[a.offset:a.end]):
                        bad.append((group, op))
    finally:
        stepper.close()
    assert not bad, bad[:5]


def _compare_with_a_weight_read_elsewhere(nm, x):
    """``(nm.first_divergence(x), the first op reading the weight)`` while one weight's buffer
    is read through the address of another weight of the same size (put back afterwards)."""
    g, state = nm.graph, nm.engine
    params = [b for b in g.buffers if b.kind == "param" and b.size >= 4096]
    victim = next(b for b in params if any(o.size == b.size for o in params if o.id != b.id))
    other = next(o for o in params if o.size == victim.size and o.id != victim.id)
    reader = min(t.op for t in g.tasks if any(a.buffer == victim.id for a in t.accesses))
    saved = state.bases[victim.id]
    state.bases[victim.id] = state.bases[other.id]
    try:
        return nm.first_divergence(x, quiet=True), reader
    finally:
        state.bases[victim.id] = saved


def test_the_nan_hunt_and_the_bisect_name_the_op_a_fault_was_put_in():
    import torch

    import nimble

    model, x = zoo_model("branchy")
    nm = nimble.Nimble(model).prepare(x, options=nimble.PrepareOptions(relaunches=4))
    assert nm.first_divergence(x) is None
    g = nm.graph
    # a weight read through the wrong pointer: the first op reading it diverges
    found, reader = _compare_with_a_weight_read_elsewhere(nm, x)
    assert found is not None and found.op == reader, found
    # a NaN weight: the hunt names the first op that reads it
    conv = model.stem[0][0]
    with torch.no_grad():
        conv.weight[0, 0, 0, 0] = float("nan")
    found = nm.first_divergence(x, nonfinite=True)
    first_conv = next(o.index for o in g.ops if o.name.startswith("aten::convolution"))
    assert found is not None and found.op == first_conv, found


def test_ops_that_drift_from_the_eager_chain_are_judged_on_the_graphs_own_inputs(monkeypatch):
    """Every eager output made 1.0 off, as if rounding had built up: each op then differs from
    the chain, is run again alone on what the graph gave it (after a run of every task before
    it), agrees, and the walk goes on to the end.  A weight read through the wrong pointer is
    still named: run alone, the op gets the true weight from the eager run."""
    import nimble
    import nimble.debug.divergence as divergence
    import nimble.debug.eager_twins as eager_twins

    model, x = zoo_model("branchy")
    nm = nimble.Nimble(model).prepare(x, options=nimble.PrepareOptions(relaunches=4))
    real_eager, real_alone = eager_twins.eager_ops, divergence.isolated_difference
    judged = []

    def drifted(model, inputs, keep_inputs=False):
        ops = real_eager(model, inputs, keep_inputs)
        for op in ops:
            op.outputs = [t + 1.0 if t.is_floating_point() else t for t in op.outputs]
        return ops

    def alone(op, before, after):
        judged.append(op.index)
        return real_alone(op, before, after)
    monkeypatch.setattr(eager_twins, "eager_ops", drifted)
    monkeypatch.setattr(divergence, "isolated_difference", alone)
    assert nm.first_divergence(x, quiet=True) is None
    g = nm.graph
    compared = {o.index for o in g.ops for t in g.tasks if t.op == o.index}
    assert len(judged) >= len(compared) // 2, (len(judged), len(compared))
    found, reader = _compare_with_a_weight_read_elsewhere(nm, x)
    assert found is not None and found.op == reader, found
    assert "graph's own inputs" in found.detail


def test_the_bisect_names_the_op_whose_kernel_writes_its_output_elsewhere_after_prepare():
    """A fault put in after prepare: one convolution kernel's output pointer is turned to another
    intermediate buffer, so its own output keeps stale bytes and someone else's is overwritten.
    On fresh inputs the compare against eager names that convolution, the first op to go wrong."""
    import torch

    import nimble

    model, x = zoo_model("branchy")
    nm = nimble.Nimble(model).prepare(x, options=nimble.PrepareOptions(relaunches=4))
    nm(x)
    g = nm.graph
    fresh = torch.randn_like(x)
    assert nm.first_divergence(fresh, quiet=True) is None
    convs = [o.index for o in g.ops if o.name.startswith("aten::convolution")]
    victim_op = convs[len(convs) // 2]
    writers = [t for t in g.tasks if t.op == victim_op and t.kind == "kernel"]
    task, row = next((t, p) for t in reversed(writers) for p in t.pointers
                     if p.buffer >= 0 and g.buffers[p.buffer].kind == "intermediate"
                     and any(a.buffer == p.buffer and a.write for a in t.accesses))
    size, bases = g.buffers[row.buffer].size, nm.buffer_addresses
    mine = (bases[row.buffer], bases[row.buffer] + size)
    elsewhere = next(b.id for b in g.buffers if b.kind == "intermediate" and b.size >= size
                     and all(a.buffer != b.id for a in task.accesses)
                     and (bases[b.id] >= mine[1] or bases[b.id] + size <= mine[0]))
    nm(x)  # the arena now holds another input's values: the clean walk's are gone
    # every word of the kernel's parameters that names its output (a library kernel may carry
    # the address more than once)
    rows = [(p, p.buffer, p.offset) for p in task.pointers if p.buffer == row.buffer]
    low = min(offset for _, _, offset in rows)
    for p, _, offset in rows:
        p.buffer, p.offset = elsewhere, offset - low
    try:
        found = nm.first_divergence(fresh, quiet=True)
    finally:
        for p, buffer, offset in rows:
            p.buffer, p.offset = buffer, offset
    assert found is not None and found.op == victim_op, (found, task.short_name, len(rows))
    assert task.id in found.tasks
    assert nm.first_divergence(fresh, quiet=True) is None  # put back, all agree again


@pytest.mark.parametrize("name,dtype", [c for c in ZOO_DTYPES if c[0] not in WIDE])
def test_on_every_zoo_model_the_tools_trace_every_task_find_no_divergence_and_name_a_nan(
        name, dtype):
    """Every zoo model but the two widest (those are tests/test_gpu_debug_tools_wide.py's):
    :func:`debug_zoo.check_tools_on_zoo_model`."""
    check_tools_on_zoo_model(name, dtype)
