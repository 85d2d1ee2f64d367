"""Resource-aware kernel priorities on the GPU (PrepareOptions(resource_order=...)): the device's
SM limits, a kept candidate built into the kernel nodes and proven, a rule served unmeasured."""
from __future__ import annotations

import pytest

from helpers import zoo_model

pytestmark = pytest.mark.gpu


def test_the_sm_limits_come_from_the_device():
    import torch

    from nimble.engine.priority_trials import device_limits

    limits = device_limits()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    assert limits.sm_count == props.multi_processor_count
    assert 0 < limits.shared_per_block <= limits.shared_per_sm
    assert limits.threads_per_sm >= 1024 and limits.blocks_per_sm >= 16
    assert limits.registers_per_sm >= 64 * 1024 and limits.dram_gbps > 500


def _slack_and(options, model, x):
    """The model prepared with the slack priorities (keeping its recording), then with
    ``options`` on the same recording."""
    import dataclasses

    import nimble

    plain = nimble.Nimble(model).prepare(
        x, return_copies=True, options=nimble.PrepareOptions(relaunches=4, keep_recording=True))
    assert "resource_order" not in plain.graph.meta
    nm = nimble.Nimble(model).prepare(
        x, return_copies=True,
        options=dataclasses.replace(options, relaunches=4, recording=plain.recording))
    return plain, nm


def test_a_kept_candidate_is_built_into_the_kernel_nodes_and_proven(monkeypatch):
    """googlenet has convolutions with large and small footprints beside pooling and
    concatenation: with the timing stood in so that the first candidate wins, prepare keeps
    it, every kernel node carries its priority, and the graph (proven at prepare) gives the
    slack priorities' bits."""
    import torch

    import nimble
    from nimble import driver
    from nimble.engine import prepared as prepared_module

    def first_candidate_fastest(before, stream, refresh=None):
        seen: list[int] = []

        def launch(built, count):
            if id(built) not in seen:
                seen.append(id(built))
            k = seen.index(id(built))  # 0: the plain graph, launched first
            return count * (10.0 if k == 0 else float(k))
        return launch
    monkeypatch.setattr(prepared_module, "_after_phases", first_candidate_fastest)
    model, x = zoo_model("googlenet")
    plain, nm = _slack_and(nimble.PrepareOptions(resource_order=True), model, x)
    (report,) = nm.graph.meta["resource_order"]
    assert report["phase"] == 0 and report["plain_ms"] == 10.0
    assert report["trials"] and report["kept"] == report["trials"][0]["rule"]
    ours, theirs = nm.kernel_priorities, plain.kernel_priorities
    assert sum(a != b for a, b in zip(ours, theirs)) == report["trials"][0]["changed"] > 0
    # as the plain graph launches: device-launchable, unless a profiler earlier in the process
    # made every graph a host launch (nimble.engine.profiler_guard)
    assert nm.launch_mode == plain.launch_mode
    built = nm.engine.built
    for t in built.span:
        if nm.graph.tasks[t].kind == "kernel":
            assert driver.kernel_priority(built.nodes[t - built.span.start]) == ours[t]
    for _ in range(3):
        fresh = torch.randn_like(x)
        assert torch.equal(nm(fresh), plain(fresh))


def test_a_rule_named_in_the_options_moves_only_its_kernels_one_step_down():
    import nimble
    from nimble.analysis import resources
    from nimble.engine.priority_trials import device_limits
    from nimble.errors import InputError

    model, x = zoo_model("googlenet")
    plain, nm = _slack_and(nimble.PrepareOptions(resource_order="compute_last"), model, x)
    assert "resource_order" not in nm.graph.meta  # served as named, nothing measured
    profiles = resources.profile_tasks(nm.graph, device_limits())
    ours, theirs = nm.kernel_priorities, plain.kernel_priorities
    moved = [t for t in range(len(ours)) if ours[t] != theirs[t]]
    assert moved
    assert all(profiles[t].bound == resources.Bound.COMPUTE and ours[t] == theirs[t] + 1
               for t in moved)
    with pytest.raises(InputError, match="a rule is one of"):
        nimble.Nimble(model).prepare(x, options=nimble.PrepareOptions(
            recording=plain.recording, resource_order="smallest_first"))


def test_the_occupancy_worked_out_is_never_above_the_driver_s():
    """Every kernel of googlenet: the resident blocks worked out from its launch, its
    registers and static shared memory (read from the driver) are at least what the driver's
    occupancy calculator gives (which may also round shared memory up and choose a smaller
    shared-memory carveout), and equal for some."""
    import nimble
    from nimble import driver
    from nimble.analysis import resources
    from nimble.engine.priority_trials import device_limits, kernel_resources
    from nimble.record.decode import kernel_function

    model, x = zoo_model("googlenet")
    nm = nimble.Nimble(model).prepare(x, options=nimble.PrepareOptions(
        relaunches=1, fuzz=False, keep_recording=True))
    rec = nm.recording
    functions = kernel_resources(rec.graph, rec.nodes)
    assert any(f.registers > 0 for f in functions)
    profiles = resources.profile_tasks(rec.graph, device_limits(),
                                       registers=[f.registers for f in functions],
                                       static_shared=[f.static_shared for f in functions])
    same = kernels = 0
    for task, node, p in zip(rec.graph.tasks, rec.nodes, profiles):
        if task.kind != "kernel":
            continue
        func = kernel_function(driver.kernel_node_params(node))
        theirs = driver.max_active_blocks(func, p.threads, task.shared_mem)
        ours = p.occupancy.resident_blocks
        assert ours >= theirs, (task.id, task.short_name, ours, theirs, p.occupancy.limited_by)
        kernels += 1
        same += ours == theirs
    print(f"{same} of {kernels} kernels: the driver's occupancy equals the one worked out")
    assert kernels and same
