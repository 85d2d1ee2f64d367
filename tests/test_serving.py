"""Serving without a GPU: prepare()'s bucket and instance arguments, the examples of the buckets,
the dispatch of a call to its bucket (and to a larger one with padding), the choice of a model
instance, the layout of buckets sharing one arena, and the prepare report."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

import nimble
from helpers import FIXTURE_DIR
from test_launcher import driver_calls, fake  # noqa: F401 - fake: the stand-in bindings
from nimble.engine.arena_layout import own_layout, shared_layout
from nimble.engine.build import buffer_bases
from nimble.engine.preparation import _check_pad_outputs
from nimble.engine.prepared import plan_graph
from nimble.engine.serving import (Bucket, BucketCost, InstanceCost, InstancePool, MemoryReport,
                                   PrepareReport, Serving, bucket_examples, padded_bucket,
                                   resized)
from nimble.errors import InputError
from nimble.ir.alignment import ALIGNMENT
from nimble.ir.taskgraph import TaskGraph


def _model():
    return torch.nn.Linear(4, 3).eval()


# ---- prepare()'s arguments: refused before anything is recorded ------------------------------

@pytest.mark.parametrize("kwargs, words", [
    (dict(), "exactly one of example_inputs and buckets"),
    (dict(example_inputs=torch.zeros(2, 4), buckets=[torch.zeros(1, 4)]),
     "exactly one of example_inputs and buckets"),
    (dict(buckets=[torch.zeros(1, 4)], batch_sizes=[1, 2]), "batch_sizes resizes dim 0"),
    (dict(example_inputs=torch.zeros(2, 4), batch_sizes=[2, 4, 2]), "both have input shapes"),
    (dict(buckets=[torch.zeros(1, 4), torch.zeros(1, 4)]), "both have input shapes"),
    (dict(example_inputs=torch.zeros(2, 4), instances=0), "instances must be an int >= 1"),
    (dict(example_inputs=torch.zeros(2, 4), instances=2.0), "instances must be an int >= 1"),
    (dict(example_inputs=torch.zeros(2, 4), instances=True), "instances must be an int >= 1"),
    (dict(example_inputs=torch.zeros(2, 4), batch_sizes=[]), "batch_sizes must be positive"),
    (dict(example_inputs=torch.zeros(2, 4), batch_sizes=[0, 2]), "batch_sizes must be positive"),
    (dict(example_inputs=torch.zeros(()), batch_sizes=[1, 2]), "input 0 has shape ()"),
    (dict(buckets=[]), "holds no example"),
    (dict(buckets=[(torch.zeros(1, 4), "x")]), "got a str"),
    (dict(example_inputs=torch.zeros(0, 4)), r"input 0 has shape \(0, 4\), no elements \(a batch"),
    (dict(buckets=[torch.zeros(2, 4), (torch.zeros(3, 4), torch.zeros(3, 0))]),
     r"input 1 has shape \(3, 0\), no elements: "),
])
def test_prepare_refuses_serving_arguments_that_do_not_fit(kwargs, words):
    with pytest.raises(InputError, match=words):
        nimble.Nimble(_model()).prepare(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(batch_sizes=[1, 2]), dict(instances=2), dict(pad=True),
                                    dict(batch_sizes=[2], pad=True)])
def test_buckets_instances_and_padding_are_for_inference_only(kwargs):
    with pytest.raises(InputError, match=r"training=True\) takes one example and one instance"):
        nimble.Nimble(_model().train()).prepare(torch.zeros(2, 4), training=True, **kwargs)


def test_padding_needs_the_batch_on_dim_0_of_every_input():
    with pytest.raises(InputError, match=r"batch on dim 0.*inputs of bucket 0.*\(2, 4\), \(3, 4\)"):
        nimble.Nimble(_model()).prepare((torch.zeros(2, 4), torch.zeros(3, 4)), batch_sizes=None,
                                       pad=True)


def test_padding_needs_the_batch_on_dim_0_of_every_output():
    planned = SimpleNamespace(rec=SimpleNamespace(
        static_inputs=[torch.zeros(4, 8)],
        graph=SimpleNamespace(outputs=[SimpleNamespace(shape=[4, 10]),
                                       SimpleNamespace(shape=[10])])))
    with pytest.raises(InputError, match=r"outputs of bucket 2.*\(4, 10\), \(10,\)"):
        _check_pad_outputs(planned, 2)
    planned.rec.graph.outputs = [SimpleNamespace(shape=[10, 4])]  # a batch moved off dim 0
    with pytest.raises(InputError, match="bucket 0's inputs"):
        _check_pad_outputs(planned, 0)
    planned.rec.graph.outputs = [SimpleNamespace(shape=[4, 10]), SimpleNamespace(shape=[4])]
    _check_pad_outputs(planned, 0)


def test_the_examples_of_batch_sizes_take_the_rows_cyclically():
    x = torch.arange(6.0).reshape(3, 2)
    ids = torch.tensor([[7], [8], [9]])
    examples = bucket_examples((x, ids), None, [1, 5], instances=1, pad=True, training=False)
    assert [tuple(e[0].shape) for e in examples] == [(1, 2), (5, 2)]
    assert examples[1][1].flatten().tolist() == [7, 8, 9, 7, 8]
    assert torch.equal(examples[1][0][3], x[0])
    assert isinstance(resized(x, 2), torch.Tensor)  # a tensor stays a tensor
    assert bucket_examples(x, None, None, instances=3, pad=False, training=False) == [x]


# ---- dispatch ---------------------------------------------------------------------------------

def test_a_padded_batch_runs_in_the_smallest_larger_bucket():
    keys = [((1, 3, 8),), ((8, 3, 8),), ((4, 3, 8),), ((16, 3, 8),)]
    assert padded_bucket(keys, ((3, 3, 8),)) == (((4, 3, 8),), 3)
    assert padded_bucket(keys, ((5, 3, 8),)) == (((8, 3, 8),), 5)
    assert padded_bucket(keys, ((17, 3, 8),)) is None  # larger than every bucket
    assert padded_bucket(keys, ((3, 3, 9),)) is None  # another shape besides the batch
    assert padded_bucket(keys, ((3, 3),)) is None
    two = [((4, 2), (4, 5))]
    assert padded_bucket(two, ((3, 2), (3, 5))) == (two[0], 3)
    assert padded_bucket(two, ((3, 2), (2, 5))) is None  # rows differ between inputs
    assert padded_bucket(two, ((3, 2),)) is None
    assert padded_bucket([((4,),)], ((),)) is None


class _FakeLauncher:
    """What Serving.call uses of a launcher: its lock, the held run, the output structure."""

    def __init__(self, name: str, lock: threading.Lock) -> None:
        self.name, self.lock, self.calls = name, lock, []
        self.unflatten = list
        self.fail = None

    def run_flat_held(self, inputs, rows=None):
        assert self.lock.locked()
        self.calls.append((tuple(tuple(x.shape) for x in inputs), rows))
        if self.fail:
            raise self.fail
        return [self.name]


def _serving(shapes: list, instances: int, pad: bool) -> Serving:
    locks = [threading.Lock() for _ in range(instances)]
    buckets = []
    for k, key in enumerate(shapes):
        graphs = [SimpleNamespace(launcher=_FakeLauncher(f"b{k}i{j}", locks[j]),
                                  memplan=SimpleNamespace(arena_bytes=100 * (k + 1)))
                  for j in range(instances)]
        buckets.append(Bucket(key, graphs))
    layout = shared_layout([TaskGraph()] * len(shapes),
                           [SimpleNamespace(arena_bytes=100 * (k + 1)) for k in range(len(shapes))])
    return Serving(buckets, [SimpleNamespace(size=layout.size)] * instances, layout, pad,
                   PrepareReport())


def test_a_call_runs_in_the_bucket_of_its_shapes_and_pads_only_when_asked():
    serving = _serving([((1, 4),), ((8, 4),), ((2, 4),)], instances=1, pad=True)
    assert serving.primary is serving.buckets[2].instances[0]  # the largest plan
    assert serving.call((torch.zeros(8, 4),)) == ["b1i0"]
    assert serving.call((torch.zeros(5, 4),)) == ["b1i0"]
    assert serving.buckets[1].instances[0].launcher.calls == [(((8, 4),), None),
                                                               (((5, 4),), 5)]
    with pytest.raises(InputError, match=r"shapes \[\(9, 4\)\]; the model was prepared for "
                                         r"\[\[\(1, 4\)\], \[\(8, 4\)\], \[\(2, 4\)\]\]"):
        serving.call((torch.zeros(9, 4),))
    with pytest.raises(InputError, match="prepared with 1 input"):
        serving.call((torch.zeros(8, 4), torch.zeros(8, 4)))
    with pytest.raises(InputError, match="input 0 is a list"):
        serving.call(([1, 2],))
    with pytest.raises(InputError, match=r"input 0 \(of the list passed\) is a int, not a tensor"):
        serving.call([1, 2, 3])  # nm([1, 2, 3]): one thing, not a tensor, not three inputs
    plain = _serving([((1, 4),), ((8, 4),)], instances=1, pad=False)
    with pytest.raises(InputError, match=r"prepare with pad=True"):
        plain.call((torch.zeros(5, 4),))
    assert not plain.plain and _serving([((1, 4),)], 1, False).plain


def test_a_failed_call_gives_its_instance_back():
    serving = _serving([((2, 4),)], instances=1, pad=False)
    launcher = serving.buckets[0].instances[0].launcher
    launcher.fail = InputError("wrong dtype")
    with pytest.raises(InputError, match="wrong dtype"):
        serving.call((torch.zeros(2, 4),))
    launcher.fail = None
    assert serving.call((torch.zeros(2, 4),)) == ["b0i0"]  # the lock was released


def test_the_serving_call_leaves_weights_that_moved_and_tuples_to_the_general_path():
    from nimble.engine.launcher import TAKE_GENERAL_PATH
    from nimble.engine.weights import EPOCH

    serving = _serving([((2, 4),)], instances=2, pad=False)
    weights = SimpleNamespace(epoch=EPOCH[0])
    serve = serving.fast_call(weights)
    assert serve((torch.zeros(2, 4),)) in (["b0i0"], ["b0i1"])
    assert serve(((torch.zeros(2, 4),),)) is TAKE_GENERAL_PATH
    weights.epoch = EPOCH[0] - 1
    assert serve((torch.zeros(2, 4),)) is TAKE_GENERAL_PATH


# ---- the instance pool ------------------------------------------------------------------------

def test_a_thread_keeps_its_instance_while_it_is_free_and_takes_another_when_busy():
    locks = [threading.Lock() for _ in range(3)]
    pool = InstancePool(locks)
    first = pool.acquire()
    pool.release(first)
    assert pool.acquire() == first  # its own again
    other = pool.acquire()  # its own is held (by itself): another
    assert other != first and locks[first].locked() and locks[other].locked()
    pool.release(first)
    pool.release(other)


def test_threads_spread_over_free_instances():
    locks = [threading.Lock() for _ in range(4)]
    pool = InstancePool(locks)
    got, ready, go = [], threading.Barrier(4), threading.Event()

    def worker():
        k = pool.acquire()
        got.append(k)
        ready.wait()  # all four hold one at once
        go.wait()
        pool.release(k)
    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    while len(got) < 4:
        time.sleep(0.001)
    go.set()
    for t in threads:
        t.join(10)
    assert sorted(got) == [0, 1, 2, 3]


def test_a_call_waits_for_its_own_instance_when_every_instance_is_busy():
    locks = [threading.Lock() for _ in range(2)]
    pool = InstancePool(locks)
    own, got, first_done, all_busy = [], [], threading.Event(), threading.Event()

    def caller():
        k = pool.acquire()
        pool.release(k)
        own.append(k)
        first_done.set()
        all_busy.wait()
        got.append(pool.acquire())
    thread = threading.Thread(target=caller)
    thread.start()
    first_done.wait(10)
    for lock in locks:  # someone else holds both
        lock.acquire()
    all_busy.set()
    thread.join(0.2)
    assert thread.is_alive() and not got  # blocked
    locks[1 - own[0]].release()  # not the one it waits for
    thread.join(0.2)
    assert thread.is_alive() and not got
    locks[own[0]].release()
    thread.join(10)
    assert got == own
    pool.release(got[0])


# ---- buckets sharing one arena ----------------------------------------------------------------

def _planned(name: str):
    graph = TaskGraph.load(FIXTURE_DIR / f"{name}.json.gz")
    _, plan = plan_graph(graph, False, None, None)
    return graph, plan


def test_buckets_share_the_largest_plans_region_and_keep_their_states_apart():
    planned = [_planned(n) for n in ("googlenet_float16", "branchy", "mobilenet_v2")]
    graphs, plans = [g for g, _ in planned], [p for _, p in planned]
    layout = shared_layout(graphs, plans)
    assert layout.shared_bytes == max(p.arena_bytes for p in plans)
    base = 1 << 40
    for graph, plan, state in zip(graphs, plans, layout.states):
        bases = buffer_bases(graph, plan, base)
        for bid in plan.offsets:  # every planned buffer inside the shared region
            size = graph.buffers[bid].size
            assert base <= bases[bid] and bases[bid] + size <= base + layout.shared_bytes
        assert state.plan_bytes == plan.arena_bytes
        assert state.cells_at >= layout.shared_bytes and state.cells_at % 8 == 0
        assert state.rng_at == state.cells_at + 8 * len(graph.inputs)
    spans = [(s.cells_at, s.end) for s in layout.states]
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # disjoint, in order
    states = sum(end - start for start, end in spans)
    assert layout.size - ALIGNMENT - layout.shared_bytes - states < 8 * len(graphs)  # alignment
    assert layout.state_bytes == layout.size - layout.shared_bytes
    assert layout.size < sum(p.arena_bytes for p in plans)


def test_one_bucket_is_laid_out_as_a_graph_alone():
    graph, plan = _planned("branchy")
    alone = own_layout(graph, plan)
    layout = shared_layout([graph], [plan])
    assert layout.states == [alone] and layout.size == alone.size


def test_the_private_copies_of_library_memory_are_part_of_a_buckets_state():
    graph, plan = _planned("resnet50_train")
    layout = shared_layout([graph, graph], [plan, plan])
    first, second = layout.states
    assert first.private and set(first.private) == set(second.private)
    for bid, at in second.private.items():
        assert at % ALIGNMENT == 0 and at >= first.end
        assert at + graph.buffers[bid].size <= second.end


# ---- reports ----------------------------------------------------------------------------------

def test_the_prepare_report_sums_the_stages_over_buckets_and_instances():
    report = PrepareReport(
        buckets=[BucketCost(((1, 4),), {"capture": 1.0, "build": 0.5}),
                 BucketCost(((8, 4),), {"capture": 2.0, "build": 0.25, "timing": 3.0})],
        instances=[InstanceCost(1, ((1, 4),), 0.1, 0.2, 4),
                   InstanceCost(1, ((8, 4),), 0.3, 0.4, 4)],
        arena_seconds=0.01, total=9.0)
    assert report.stage_totals() == pytest.approx({
        "capture": 3.0, "build": 0.75, "timing": 3.0, "instance_build": 0.4,
        "instance_proof": 0.6, "arena": 0.01})


def test_the_memory_report_counts_every_instance():
    report = MemoryReport(shared_bytes=1000, state_bytes=600, instance_bytes=[1600, 1600],
                          outside_bytes=50)
    assert report.total_bytes == 3250


# ---- the staged preparation, its stages stood in for --------------------------------------------

class _Stages:
    """Stand-ins for recording, building and proving that note what ran."""

    def __init__(self, monkeypatch, fail_at: tuple[int, int] | None = None) -> None:
        from nimble import driver
        from nimble.engine import preparation

        self.planned, self.built, self.proven, self.copies_proven = [], [], [], []
        self.arenas, self.orders, self.closed = [], [], []
        self.fail_at = fail_at
        monkeypatch.setattr(preparation, "_plan", self.plan)
        monkeypatch.setattr(preparation, "build_prepared", self.build)
        monkeypatch.setattr(preparation, "prove", self.prove)
        monkeypatch.setattr(preparation, "prove_copy", self.prove_copy)
        monkeypatch.setattr(preparation, "CallOrder", self.order)
        monkeypatch.setattr(driver.DeviceMemory, "allocate", self.allocate)

    def plan(self, model, example, *args):
        batch = example.shape[0]
        self.planned.append(batch)
        return SimpleNamespace(rec=SimpleNamespace(static_inputs=[example], graph=TaskGraph()),
                               memplan=SimpleNamespace(arena_bytes=1000 * batch),
                               seconds={"capture": 0.5}, schedule=None, priorities=None,
                               trials=None, ordering=[])

    def build(self, model, rec, schedule, plan, *, seconds, region, late_edges, **_):
        instance = self.arenas.index(region.arena)
        batch = rec.static_inputs[0].shape[0]
        if (instance, batch) == self.fail_at:
            raise nimble.BuildError("a stand-in failure")
        built = SimpleNamespace(
            key=(instance, batch), region=region, late_edges=list(late_edges) or [(instance, 1)],
            given_late_edges=list(late_edges), seconds=seconds, backfill=[], memplan=plan,
            priorities=None, prefetch=[], programmatic=frozenset(),
            builts=[SimpleNamespace(device_launch_refusal="")],
            graph=SimpleNamespace(meta={}, tasks=[]), built_nodes=lambda phase: [],
            launcher=SimpleNamespace(lock=region.order.lock), recording=None, kernel_owners=[],
            kernel_facts={})
        built.close = lambda: self.closed.append(built.key)
        self.built.append(built)
        return built

    def prove(self, candidate, rec, relaunches, fuzz, progress=None):
        self.proven.append((candidate.key, relaunches, fuzz))
        candidate.seconds["verify_served"] = 0.25

    def prove_copy(self, copy, rec, relaunches):
        self.copies_proven.append((copy.key, relaunches))
        return {"launches": relaunches}

    def order(self):
        order = SimpleNamespace(lock=threading.Lock())
        order.close = lambda: self.closed.append(("order", self.orders.index(order)))
        self.orders.append(order)
        return order

    def allocate(self, size):
        arena = SimpleNamespace(size=size)
        arena.close = lambda: self.closed.append(("arena", self.arenas.index(arena)))
        self.arenas.append(arena)
        return arena


def _prepare_serving(batches, instances):
    from nimble.engine.preparation import prepare_serving

    examples = [torch.zeros(b, 4) for b in batches]
    return prepare_serving(None, examples, instances=instances, pad=False, training=False,
                           use_multi_stream=True, max_streams=None,
                           options=nimble.PrepareOptions(), quiet=True)


def test_each_bucket_is_recorded_once_and_copied_for_the_other_instances(monkeypatch):
    stages = _Stages(monkeypatch)
    serving = _prepare_serving([1, 8, 2], instances=3)
    assert stages.planned == [1, 8, 2]  # one recording and plan per bucket, not per instance
    assert [b.key for b in stages.built] == [(j, b) for j in range(3) for b in (1, 8, 2)]
    assert stages.proven == [((0, b), 100, True) for b in (1, 8, 2)]  # the full proof
    assert stages.copies_proven == [((j, b), 4) for j in (1, 2) for b in (1, 8, 2)]
    for built in stages.built:  # each instance its own arena and lock; copies as the first
        j, b = built.key
        assert built.region.arena is stages.arenas[j] and built.region.order is stages.orders[j]
        assert built.given_late_edges == ([] if j == 0 else [(0, 1)])
    assert len({a.size for a in stages.arenas}) == 1 and len(stages.arenas) == 3
    assert serving.primary.key == (0, 8) and serving.instances == 3
    assert [b.input_shapes for b in serving.buckets] == [((1, 4),), ((8, 4),), ((2, 4),)]
    report = serving.report
    assert all(set(c.seconds) == {"capture", "build", "verify_served"}  # each stage once
               for c in report.buckets)
    assert all("verify" in b.instances[0].seconds for b in serving.buckets)  # prepare_seconds
    assert [(c.instance, c.input_shapes[0][0], c.proof_launches) for c in report.instances] == \
        [(j, b, 4) for j in (1, 2) for b in (1, 8, 2)]
    assert stages.closed == []


def test_a_failed_prepare_frees_everything_it_built(monkeypatch):
    stages = _Stages(monkeypatch, fail_at=(1, 8))
    with pytest.raises(nimble.BuildError, match="stand-in"):
        _prepare_serving([1, 8, 2], instances=2)
    graphs = sorted(k for k in stages.closed if not isinstance(k[0], str))
    assert graphs == [(0, 1), (0, 2), (0, 8), (1, 1)]  # instance 0 whole, instance 1 so far
    assert ("arena", 0) in stages.closed and ("arena", 1) in stages.closed
    assert ("order", 0) in stages.closed and ("order", 1) in stages.closed


def test_a_recording_given_to_prepare_serves_one_bucket_only(monkeypatch):
    from nimble.engine.preparation import prepare_serving

    with pytest.raises(InputError, match="one recording, of one shape"):
        prepare_serving(None, [torch.zeros(1, 4), torch.zeros(2, 4)], instances=1, pad=False,
                        training=False, use_multi_stream=True, max_streams=None,
                        options=nimble.PrepareOptions(recording=object()), quiet=True)


# ---- a padded call on stand-in driver bindings ------------------------------------------------


def _bucket_launcher():
    from nimble.engine.launcher import InputSlot, Launcher

    slot = InputSlot(tensor=torch.zeros(4, 3), address=0x100, nbytes=48, shape=(4, 3),
                     dtype=torch.float32, dense=True, cell=0x9000)
    out = torch.arange(8.0).reshape(4, 2)
    return Launcher("exec", [slot], torch.device("cpu"), [out],
                    SimpleNamespace(is_leaf=lambda: True), context="ctx"), slot, out


def test_a_padded_call_fills_the_first_rows_points_the_cell_at_its_slot_and_returns_them(fake):
    launcher, slot, out = _bucket_launcher()
    with launcher.lock:
        got = launcher.run_flat_held((torch.ones(3, 3),), rows=3)
    assert slot.tensor[:3].eq(1).all() and slot.tensor[3].eq(0).all()  # the last row kept
    [got_out] = got
    assert got_out.shape == (3, 2) and got_out.data_ptr() == out.data_ptr()
    assert driver_calls(fake, "cuStreamWriteValue64") == [("stream7", 0x9000, 0x100, 0)]
    assert len(driver_calls(fake, "cuGraphLaunch")) == 1
    with launcher.lock:  # the cell names its slot already: nothing written
        launcher.run_flat_held((torch.full((2, 3), 2.0),), rows=2)
    assert len(driver_calls(fake, "cuStreamWriteValue64")) == 1
    assert slot.tensor[:2].eq(2).all() and slot.tensor[2].eq(1).all()
    launcher.return_copies = True
    with launcher.lock:
        [copy] = launcher.run_flat_held((torch.ones(1, 3),), rows=1)
    assert copy.shape == (1, 2) and copy.data_ptr() != out.data_ptr()
    with launcher.lock, pytest.raises(InputError, match=r"input 0 is \(3, 4\)"):
        launcher.run_flat_held((torch.ones(3, 4),), rows=3)


def test_a_held_call_of_the_whole_bucket_is_a_plain_call(fake):
    launcher, slot, out = _bucket_launcher()
    x = torch.randn(4, 3)
    with launcher.lock:
        [got] = launcher.run_flat_held((x,))
    assert got is out
    assert driver_calls(fake, "cuStreamWriteValue64") == [("stream7", 0x9000, x.data_ptr(), 0)]


def test_an_empty_example_is_refused_before_recording_for_training_and_by_record_itself():
    from nimble.record.recorder import record

    with pytest.raises(InputError, match=r"input 0 has shape \(0, 4\), no elements \(a batch"):
        nimble.Nimble(_model().train()).prepare(torch.zeros(0, 4), training=True)
    with pytest.raises(InputError, match=r"input 0 has shape \(0, 4\), no elements"):
        record(_model(), torch.zeros(0, 4))
