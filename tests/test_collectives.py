"""NCCL collectives inside a recording (no GPU): what the analysis keeps of them.

``allreduce_rank0.json.gz`` is rank 0 of two recording ``y = conv_a(x); all_reduce(y);
relu(y) + conv_b(x)`` under ``torchrun --nproc_per_node=2`` (NCCL 2.28, H200): NCCL's kernel
sits between a wait for and a record of its communicator's event, and points at the
communicator's own 2 MiB allocation and, in place, at ``y``.
"""
from __future__ import annotations

from helpers import FIXTURE_DIR

from nimble.analysis.deps import build_dag, communication_task, reachability
from nimble.engine.arena_layout import (collective_memory, communicator_memory, shared_state,
                                        written_externals)
from nimble.engine.prepared import plan_graph
from nimble.ir.kernel_names import collective_kernel
from nimble.ir.synthetic import random_graph
from nimble.ir.taskgraph import LIBRARY_MEMORY, Access, Buffer, BufferKind, TaskGraph, TaskKind

ALLREDUCE = FIXTURE_DIR / "allreduce_rank0.json.gz"


def _kinds(graph: TaskGraph) -> list[str]:
    return [t.kind if t.kind != TaskKind.KERNEL or not collective_kernel(t.name) else "nccl"
            for t in graph.tasks]


def test_nccl_kernels_are_told_from_every_other_kernel():
    assert collective_kernel("_Z39ncclDevKernel_AllReduce_Sum_f32_RING_LL24ncclDevKernel"
                             "ArgsStorageILm4096EE")
    assert collective_kernel("ncclKernel_AllGather_RING_LL_Sum_int8_t")
    # torch's one-shot all-reduce over symmetric memory: a static template in an anonymous
    # namespace
    assert collective_kernel("_ZN12_GLOBAL__N_1L26one_shot_all_reduce_kernelIN3c108BFloat16ELi16"
                             "ELi2EEEvPPT_S5_S5_mmPPjmm")
    assert collective_kernel("_ZN12_GLOBAL__N_126two_shot_all_reduce_kernelIfLi16ELi2ELb0ELb0EE"
                             "EvPPT_S3_mmPPjmmm")
    for name in ("sm80_xmma_fprop_implicit_gemm_f32f32", "void at::native::elementwise_kernel",
                 "triton_poi_fused_add_0", "nimble_gather", "all_reduce_kernel_of_mine",
                 "_ZN2at6native18reduce_kernelILi512ELi1EEEvv"):
        assert not collective_kernel(name)
    g = TaskGraph.load(ALLREDUCE)
    assert _kinds(g).count("nccl") == 1
    assert [t.id for t in g.tasks if communication_task(t)] == [2, 3, 4]


def test_the_collective_runs_after_its_event_wait_and_before_its_event_record_on_any_schedule():
    g = TaskGraph.load(ALLREDUCE)
    wait, nccl, record = (t.id for t in g.tasks if communication_task(t))
    assert g.tasks[wait].kind == TaskKind.EVENT_WAIT
    assert g.tasks[record].kind == TaskKind.EVENT_RECORD
    reach = reachability(build_dag(g))
    assert reach[wait] >> nccl & 1 and reach[nccl] >> record & 1
    # the chain is what orders the event nodes: they touch no memory
    assert g.tasks[wait].accesses == [] and g.tasks[record].accesses == []
    schedule, _ = plan_graph(g, True, None, None)
    order = {t: k for stream in schedule.streams for k, t in enumerate(stream)}
    stream_of = {t: s for s, stream in enumerate(schedule.streams) for t in stream}
    edges = set(schedule.edges())
    for u, v in ((wait, nccl), (nccl, record)):
        same = stream_of[u] == stream_of[v] and order[u] < order[v]
        assert same or _reaches(edges, u, v), f"{u} -> {v} is not kept by the schedule"


def _reaches(edges: set, u: int, v: int) -> bool:
    frontier, seen = [u], {u}
    while frontier:
        a = frontier.pop()
        for x, y in edges:
            if x == a and y not in seen:
                if y == v:
                    return True
                seen.add(y)
                frontier.append(y)
    return False


def test_collectives_on_disjoint_tensors_are_still_ordered_in_recorded_order():
    g = random_graph(n_tasks=6, n_buffers=6, seed=3)
    for t in g.tasks:
        t.accesses = [Access(t.id % len(g.buffers), 0, 16, True)]
    for t in (g.tasks[1], g.tasks[4]):
        t.name = "ncclDevKernel_AllReduce_Sum_f32_RING_LL"
    g.tasks[1].accesses = [Access(0, 0, 16, True)]
    g.tasks[4].accesses = [Access(5, 0, 16, True)]
    assert (1, 4) in build_dag(g).edges()
    g.tasks[4].name = "sm90_gemm"
    assert (1, 4) not in build_dag(g).edges()


def test_the_communicators_memory_is_neither_privatized_nor_restored_by_the_proof():
    g = TaskGraph.load(ALLREDUCE)
    (comm,) = collective_memory(g)
    b = g.buffers[comm]
    assert b.kind == BufferKind.EXTERNAL and b.name.startswith(LIBRARY_MEMORY)
    assert communicator_memory(g) == [comm]
    assert comm not in written_externals(g)  # a private copy would meet no peer
    assert (b.address, b.size) not in shared_state(g)
    # the same memory written by a library kernel that is no collective is privatized
    for t in g.tasks:
        if t.kind == TaskKind.KERNEL and collective_kernel(t.name):
            t.name = "cudnn_bn_bw_kernel"
    assert comm in written_externals(g)


def test_a_tensor_from_before_the_recording_that_a_collective_reduces_stays_shared():
    g = TaskGraph.load(ALLREDUCE)
    bid = len(g.buffers)
    g.buffers.append(Buffer(bid, BufferKind.EXTERNAL, 4096, 0x7000_0000, "block@0x70000000"))
    nccl = next(t for t in g.tasks if collective_kernel(t.name))
    nccl.accesses.append(Access(bid, 0, 4096, True))
    assert bid in collective_memory(g) and bid not in communicator_memory(g)
    assert bid not in written_externals(g)  # the bucket stays where the model keeps it
    assert (0x7000_0000, 4096) in shared_state(g)  # and the proof restores it per launch


def test_the_recorded_launch_keeps_its_short_argument_buffer():
    g = TaskGraph.load(ALLREDUCE)
    nccl = next(t for t in g.tasks if collective_kernel(t.name))
    assert nccl.fields.get("args") == "extra"
    assert nccl.param_layout == [(0, len(nccl.params))] and len(nccl.params) == 192
    assert {p.location for p in nccl.pointers if p.buffer >= 0} == {0, 104, 112}


def test_a_training_step_with_collectives_is_refused_with_what_to_do():
    import pytest

    from nimble.engine.collectives import check_training_collectives
    from nimble.errors import InputError

    g = TaskGraph.load(ALLREDUCE)
    check_training_collectives(g, training=False)  # inference with collectives is served
    with pytest.raises(InputError, match="collectives inside its forward or backward"):
        check_training_collectives(g, training=True)
    train = TaskGraph.load(FIXTURE_DIR / "resnet50_train.json.gz")
    check_training_collectives(train, training=True)  # no collective: nothing to refuse


def test_a_data_parallel_wrapper_inside_a_model_is_refused_for_training_before_recording():
    import pytest
    import torch

    from nimble.engine.preparation import check_mode
    from nimble.errors import InputError

    class DistributedDataParallel(torch.nn.Module):  # the name is what is checked: no GPU here
        def __init__(self, module):
            super().__init__()
            self.module = module

    class FullyShardedDataParallel(DistributedDataParallel):
        pass

    inner = torch.nn.Linear(2, 2).train()
    # a DDP given to Nimble is unwrapped first (tests/test_data_parallel.py); one inside is not
    with pytest.raises(InputError, match="holds a DistributedDataParallel.*Nimble\\(ddp\\)"):
        check_mode(torch.nn.Sequential(DistributedDataParallel(inner)).train(), training=True)
    with pytest.raises(InputError, match="does not support FullyShardedDataParallel"):
        check_mode(FullyShardedDataParallel(inner).train(), training=True)
    check_mode(inner, training=True)
    check_mode(DistributedDataParallel(inner).eval(), training=False)  # inference is served


def test_a_device_launch_refused_for_nccls_event_nodes_says_what_to_set():
    from nimble.engine.collectives import refusal_reason

    driver_says = "CUDA_GRAPH_INSTANTIATE_NODE_OPERATION_NOT_SUPPORTED"
    reason = refusal_reason(TaskGraph.load(ALLREDUCE), driver_says)
    assert "NCCL_GRAPH_MIXING_SUPPORT=0" in reason and driver_says in reason
    plain = TaskGraph.load(FIXTURE_DIR / "resnet50.json.gz")
    assert refusal_reason(plain, driver_says) == driver_says
    assert refusal_reason(TaskGraph.load(ALLREDUCE), "") == ""


def test_several_instances_of_a_graph_with_collectives_are_refused():
    import pytest

    from nimble.engine.collectives import check_instances
    from nimble.errors import InputError

    g = TaskGraph.load(ALLREDUCE)
    check_instances(g, 1)
    with pytest.raises(InputError, match="instances=2 .* prepare one instance"):
        check_instances(g, 2)
    check_instances(TaskGraph.load(FIXTURE_DIR / "resnet50.json.gz"), 4)


def test_a_graph_whose_collectives_are_peer_sums_through_the_models_table_can_be_saved():
    """Nimble's peer sum reads only the model's table and the arena: its graph's file binds the
    table of the model it is loaded with.  NCCL's kernel, or a peer sum whose table is memory
    of this process no tensor of the model names, cannot be written down."""
    from nimble.engine.saving import collectives_through_the_model
    from nimble.ir.taskgraph import Task

    def graph(name: str, table_kind: str) -> TaskGraph:
        g = TaskGraph()
        g.buffers = [Buffer(0, table_kind, 16, 0x1000), Buffer(1, "intermediate", 64, 0x2000),
                     Buffer(2, "intermediate", 64, 0x3000)]
        g.tasks = [Task(0, TaskKind.KERNEL, name="gemv_kernel",
                        accesses=[Access(1, 0, 64, True)]),
                   Task(1, TaskKind.KERNEL, name=name, accesses=[
                       Access(1, 0, 64, False), Access(2, 0, 64, True), Access(0, 0, 16, False)])]
        return g
    assert collectives_through_the_model(graph("nimble_peer_sum_kernel", "param"))
    assert not collectives_through_the_model(graph("nimble_peer_sum_kernel", "external"))
    assert not collectives_through_the_model(graph(
        "_Z39ncclDevKernel_AllReduce_Sum_f32_RING_LL24ncclDevKernelArgsStorageILm4096EE",
        "param"))
    assert not collectives_through_the_model(graph("triton_poi_fused_add_0", "param"))
    assert not collectives_through_the_model(TaskGraph.load(ALLREDUCE))  # a recorded NCCL
