"""Resource-aware kernel priorities (nimble.analysis.resources, nimble.engine.priority_trials):
what bounds each kernel, its occupancy on an SM, the candidate priorities, and their measured
pick at prepare on stand-in bindings (no GPU)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from helpers import FIXTURE_DIR, fixture_ids
from nimble.analysis import resources
from nimble.analysis.deps import task_durations
from nimble.analysis.priorities import priority_levels
from nimble.analysis.resources import Bound, SmLimits, family_bound, resident_blocks
from nimble.analysis.schedule import phase_spans
from nimble.engine import prepared as prepared_module
from nimble.engine.prepared import plan_graph
from nimble.engine.priority_trials import PriorityTrial, pick_priorities
from nimble.ir.taskgraph import Access, Task, TaskGraph, TaskKind
# The stand-in bindings and the two-phase graph the builder's own tests use.
from test_rebuild import (PRIORITIES, bindings, recorded_builds, served_builder,  # noqa: F401
                          served_input, served_recording)

H100 = SmLimits()


@pytest.mark.parametrize("name, bound", [
    ("sm90_xmma_fprop_implicit_gemm_f32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize128x64", "compute"),
    ("sm80_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize32x64x64_stage4", "compute"),
    ("sm90_xmma_wgrad_indexed_implicit_gemm_f32f32_tf32f32_f32_nhwckrsc", "compute"),
    ("cutlass::Kernel2", "compute"),
    ("nvjet_sm90_hsh_64x64_64x13_4x2_h_bz_bias_NNT", "compute"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x", "compute"),
    ("implicit_convolve_sgemm", "compute"),
    ("triton_tem_fused_mm_3", "compute"),
    ("at::native::vectorized_elementwise_kernel", "memory"),
    ("cudnn::bn_fw_inf_1C11_kernel_NCHW", "memory"),
    ("at::native::_GLOBAL__N__0f1a8107_8_Shape_cu_49f7391c::CatArrayBatchedCopy", "memory"),
    ("at::native::_GLOBAL__N__834c9086_16_AveragePool2d_cu_fb804076::avg_pool2d_out", "memory"),
    ("cudnn::engines_precompiled::nchwToNhwcKernel", "memory"),
    ("at::native::_GLOBAL__N__a30dace1_DepthwiseConv2d_cu_99594870::conv_depthwise2d", "memory"),
    ("cublasLt::splitKreduce_kernel", "memory"),
    ("scal_kernel", "memory"),
    ("cublasLt::epilogue::impl::globalKernel", "memory"),
    ("internal::gemvx::kernel", "memory"),
    ("triton_poi_fused__native_batch_norm_legit_no_training_convolution_relu_3", "memory"),
    ("at::native::reduce_kernel", "memory"),
    ("my_own_kernel", "other"),
])
def test_a_kernel_name_tells_what_bounds_it(name, bound):
    assert family_bound(name) == bound


@pytest.mark.parametrize("name", [n for n in fixture_ids() if "inductor" not in n])
def test_every_kernel_of_the_recorded_zoo_has_a_known_family(name):
    graph = TaskGraph.load(FIXTURE_DIR / f"{name}.json.gz")
    unknown = {t.short_name for t, p in zip(graph.tasks, resources.profile_tasks(graph))
               if p.bound == Bound.OTHER}
    assert not unknown


def _kernel(t: int, name: str, threads: int = 256, shared: int = 0, moved: int = 0) -> Task:
    return Task(t, TaskKind.KERNEL, short_name=name, grid=(264, 1, 1), block=(threads, 1, 1),
                shared_mem=shared, accesses=[Access(0, 0, moved, True)] if moved else [])


def test_a_kernel_of_no_known_family_is_memory_bound_when_it_moves_bytes_near_dram_speed():
    # 2 MB in 1 µs is 2000 GB/s, above 30% of the H100's 3350 GB/s; in 10 µs it is not
    graph = TaskGraph(tasks=[_kernel(0, "mine", moved=2 * 10**6),
                             _kernel(1, "mine", moved=2 * 10**6),
                             Task(2, TaskKind.MEMSET)])
    got = resources.profile_tasks(graph, H100, durations=[1.0, 10.0, 1.0])
    assert [p.bound for p in got] == [Bound.MEMORY, Bound.OTHER, Bound.MEMORY]
    assert [p.bound for p in resources.profile_tasks(graph, H100)][:2] == [Bound.OTHER] * 2
    assert got[2].occupancy is None and got[0].blocks == 264 and got[0].threads == 256


@pytest.mark.parametrize("threads, shared, registers, blocks, limited_by", [
    (256, 0, None, 8, "threads"),  # 64 warps per SM over 8 per block
    (32, 0, None, 32, "blocks"),  # one warp each: the 32-block limit
    (1024, 0, None, 2, "threads"),
    (128, 100 * 1024, None, 2, "shared memory"),  # 228 KiB over 100 KiB + 1 KiB reserved
    (128, 120 * 1024, None, 1, "shared memory"),
    (128, 0, 64, 8, "registers"),  # 2048 registers a warp, 32 warps' worth, 4 warps a block
    (128, 228 * 1024, None, 0, "launch"),  # over the 227 KiB one block may have
])
def test_occupancy_on_an_sm_of_the_h100(threads, shared, registers, blocks, limited_by):
    got = resident_blocks(threads, shared, H100, registers)
    assert (got.resident_blocks, got.limited_by) == (blocks, limited_by)
    assert got.occupancy == pytest.approx(blocks * -(-threads // 32) / 64)


def test_a_block_taking_most_of_an_sm_has_a_large_footprint():
    graph = TaskGraph(tasks=[_kernel(0, "cutlass::Kernel2", 128, 120 * 1024),
                             _kernel(1, "cutlass::Kernel2", 128, 48 * 1024),
                             _kernel(2, "cutlass::Kernel2", 1024, 0)])
    assert [p.large for p in resources.profile_tasks(graph, H100)] == [True, False, False]


def test_the_limits_come_from_the_device_s_attributes():
    h100 = {"shared_per_sm": 233472, "shared_per_block": 232448,
            "shared_reserved_per_block": 1024, "registers_per_sm": 65536,
            "threads_per_sm": 2048, "blocks_per_sm": 32, "sm_count": 132,
            "memory_clock_khz": 2619000, "bus_bits": 5120}
    got = resources.limits_from_attributes(h100)
    assert got.shared_per_sm == 228 * 1024 and got.shared_per_block == 227 * 1024
    assert got.dram_gbps == pytest.approx(3352.32)
    assert set(resources.DEVICE_ATTRIBUTES) == set(h100)


def test_a_marked_task_goes_one_level_below_its_slack_level_and_the_lowest_stays_lowest():
    # 0 -> 1 -> 3 is the critical path (10 + 10 + 10); task 2 (1 µs) has all but 1 µs of slack
    edges = [(0, 1), (0, 2), (1, 3), (2, 3)]
    durations = [10.0, 10.0, 1.0, 10.0]
    plain = priority_levels(4, edges, durations, 3)
    assert plain == [0, 0, 2, 0]
    assert priority_levels(4, edges, durations, 3, secondary=[0, 1, 1, 0]) == [0, 1, 2, 0]
    with pytest.raises(ValueError, match="0 or 1"):
        priority_levels(4, edges, durations, 3, secondary=[0, 2, 0, 0])
    with pytest.raises(ValueError, match="0 or 1"):
        priority_levels(4, edges, durations, 3, secondary=[0, 1])


@pytest.fixture(scope="module")
def nasnet():
    graph = TaskGraph.load(FIXTURE_DIR / "nasnetalarge.json.gz")
    durations = task_durations(graph)
    schedule, _ = plan_graph(graph, True, None, "pool", durations)
    n = len(graph.tasks)
    return graph, schedule, durations, phase_spans(schedule.phases, n)


def test_on_nasnetalarge_each_candidate_moves_only_the_kernels_it_marks(nasnet):
    graph, schedule, durations, spans = nasnet
    n = len(graph.tasks)
    profiles = resources.profile_tasks(graph, H100, durations)
    trials = resources.plan_trials(n, schedule.edges(), durations, 6, profiles, spans)
    assert [t.rule for t in trials] == ["large_last", "compute_last"]
    plain = priority_levels(n, schedule.edges(), durations, 6, spans)
    for t in trials:
        marks = resources.RULES[t.rule]
        moved = [k for k in range(n) if t.levels[k] != plain[k]]
        assert moved and len(moved) == t.changed <= t.marked
        assert all(marks(profiles[k]) and t.levels[k] == plain[k] + 1 for k in moved)
    again = resources.plan_trials(n, schedule.edges(), durations, 6, profiles, spans)
    assert again == trials  # deterministic


def test_a_graph_whose_kernels_are_all_alike_gets_no_candidate(nasnet):
    graph, schedule, durations, spans = nasnet
    n = len(graph.tasks)
    memory_only = [resources.Profile(Bound.MEMORY, 1, 1, 0, None)] * n
    assert resources.plan_trials(n, schedule.edges(), durations, 6, memory_only, spans) == []
    with pytest.raises(ValueError, match="profiles"):
        resources.plan_trials(n, schedule.edges(), durations, 6, memory_only[1:], spans)


# ---- the measured pick at prepare ------------------------------------------------------------

def _trial(priorities: list[int], rule: str = "large_last") -> PriorityTrial:
    return PriorityTrial(resources.ResourceTrial(rule, (), 1, 1), priorities)


def test_prepare_builds_each_phase_with_the_priorities_that_differ_in_it_and_keeps_the_fastest(
        recorded_builds, bindings, monkeypatch):
    faster = [0, -1, -2, 0, -2, -1]  # task 4 (phase 1) one level down
    same = list(PRIORITIES)

    refreshed = []

    def launch(before, stream, refresh=None):
        # the graph whose task 4 has the trial's priority runs faster
        def timed(built, count):
            refresh()
            refreshed.append(slot.tensor.clone())
            return count * (1.0 if bindings.priority[built.nodes[1]] == -2 else 2.0)
        return timed
    monkeypatch.setattr(prepared_module, "_after_phases", launch)
    builder = served_builder()
    rec, slot = served_recording(builder), served_input()
    builts: list = []
    launchers, _ = prepared_module._build_phases(
        builder, rec, [slot], [torch.zeros(1)], torch.device("cpu"), None, None, builts,
        priority_trials=[_trial(faster), _trial(same, "compute_last")])
    specs = [spec for _, spec in recorded_builds]
    assert [s.span for s in specs] == [range(0, 3), range(3, 6), range(3, 6)]
    assert specs[2].priorities == faster  # phase 0 has no difference: built once
    assert builder.priorities == faster
    assert rec.graph.meta["resource_order"] == [
        {"phase": 1, "plain_ms": 2.0, "trials": [{"rule": "large_last", "ms": 1.0,
                                                  "changed": 1}],
         "kept": "large_last"}]
    assert [bindings.priority[n] for n in builts[1].nodes] == faster[3:]
    assert len(launchers) == 2
    # every timed launch read the recording's own inputs (an input's bytes are reused after
    # its last reader, so a launch with no call behind it would read what the last one left)
    assert refreshed and all(torch.equal(x, torch.arange(1024.0)) for x in refreshed)
    for built in builts:
        built.close()


class _Built:
    def __init__(self, priorities):
        self.priorities, self.closed = priorities, False

    def close(self):
        self.closed = True


@dataclass
class _Builder:
    spans: list
    priorities: list | None

    def build(self, phase):
        return _Built(self.priorities)


def test_the_slack_priorities_stay_when_no_candidate_gains_enough():
    builder = _Builder(spans=[range(0, 2), range(2, 4)], priorities=[0, 0, 0, 1])
    plain = _Built(builder.priorities)
    built, report = pick_priorities(builder, 1, plain, [_trial([0, 0, 0, 2])],
                                    lambda b, count: 1.0 * count)
    assert built is plain and not plain.closed
    assert report.kept is None and report.changed == (1,) and builder.priorities == [0, 0, 0, 1]


def test_a_phase_no_candidate_changes_is_not_timed_and_no_priorities_refuse_the_trials():
    builder = _Builder(spans=[range(0, 2), range(2, 4)], priorities=[0, 0, 0, 1])
    plain = _Built(builder.priorities)
    assert pick_priorities(builder, 0, plain, [_trial([0, 0, 0, 2])],
                           lambda b, count: pytest.fail("timed")) == (plain, None)
    with pytest.raises(ValueError, match="with priorities"):
        pick_priorities(_Builder(spans=[range(0, 4)], priorities=None), 0, plain,
                        [_trial([0, 0, 0, 2])], lambda b, count: 1.0)


def test_a_rule_named_in_the_options_serves_its_priorities_unmeasured():
    from nimble.engine.priority_trials import forced_rule

    plain = [0, 0, 0, 1]
    ordering = [_trial([0, 0, 1, 1], "large_last"), _trial([1, 0, 1, 1], "compute_last")]
    assert forced_rule("compute_last", ordering, plain) == [1, 0, 1, 1]
    assert forced_rule("large_last", ordering[1:], plain) == plain  # changes nothing here


def test_the_options_refuse_an_unknown_rule_and_ordering_without_priorities():
    import nimble
    from nimble.errors import InputError

    with pytest.raises(InputError, match="a rule is one of large_last, compute_last"):
        nimble.PrepareOptions(resource_order="smallest_first")
    with pytest.raises(InputError, match="leave priorities=True"):
        nimble.PrepareOptions(resource_order=True, priorities=False)
    assert nimble.PrepareOptions(priorities=False).resource_order is False


def test_without_the_option_or_without_priorities_nothing_is_planned():
    from nimble.engine.priority_trials import planned_ordering

    def untimed():
        pytest.fail("timed")
    assert planned_ordering(False, None, None, untimed, [0, 1], (0, -5)) == ([0, 1], [])
    assert planned_ordering("large_last", None, None, untimed, None, (0, -5)) == (None, [])


def test_a_kernel_s_registers_and_static_shared_memory_count_toward_its_footprint():
    # 128 threads with 40 KiB of dynamic shared memory: 5 blocks an SM; with 80 KiB more of
    # static shared memory, one; with 255 registers a thread (8192 a warp, 8 warps an SM), two
    graph = TaskGraph(tasks=[_kernel(0, "cutlass::Kernel2", 128, 40 * 1024)])
    alone, = resources.profile_tasks(graph, H100)
    static, = resources.profile_tasks(graph, H100, static_shared=[80 * 1024])
    registers, = resources.profile_tasks(graph, H100, registers=[255])
    assert alone.occupancy.resident_blocks == 5 and not alone.large
    assert static.occupancy.resident_blocks == 1 and static.large
    assert static.shared_mem == 120 * 1024
    assert (registers.occupancy.resident_blocks, registers.occupancy.limited_by) == \
        (2, "registers")
    with pytest.raises(ValueError, match="static shared memory"):
        resources.profile_tasks(graph, H100, static_shared=[0, 0])
