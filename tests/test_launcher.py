"""The per-call path (nimble.engine.launcher) on stand-in driver bindings and CPU tensors: which calls
take the bound fast path, what reaches the driver, and what is left to the general path."""
import threading
from types import SimpleNamespace

import pytest
import torch

from nimble import driver

from nimble.engine import launcher as launcher_module
from nimble.driver import calls
from nimble.errors import CudaError, InputError, NimbleError
from nimble.engine.launcher import TAKE_GENERAL_PATH, InputSlot, Launcher
from nimble.engine.weights import EPOCH


class FakeEvent:
    handle = "event"
    closed = False

    def close(self):
        self.closed = True


@pytest.fixture
def fake(monkeypatch):
    """Stand-in bindings logging every driver call; ``state.codes`` queues launch results and
    ``state.raw`` is the caller's current raw stream handle."""
    state = SimpleNamespace(log=[], codes=[], raw=[7], lock=None, held=[])

    def note_lock(name):
        if state.lock is not None:  # a test watching a launcher's lock: was it held?
            state.held.append((name, state.lock.locked()))

    def logged(name, result=(0,)):
        def fn(*args):
            state.log.append((name, *args))
            note_lock(name)
            return result
        return fn

    def launch(exec_handle, stream):
        state.log.append(("cuGraphLaunch", exec_handle, stream))
        note_lock("cuGraphLaunch")
        return (state.codes.pop(0) if state.codes else 0,)

    bindings = SimpleNamespace(
        cuGraphLaunch=launch, cuMemcpyDtoDAsync=logged("cuMemcpyDtoDAsync"),
        cuStreamWriteValue64=logged("cuStreamWriteValue64"),
        cuEventRecord=logged("cuEventRecord"), cuStreamWaitEvent=logged("cuStreamWaitEvent"),
        cuCtxSetCurrent=logged("cuCtxSetCurrent"),
        cuGetErrorName=lambda code: (0, b"CUDA_ERROR_LAUNCH_FAILED"),
        CUresult=SimpleNamespace(CUDA_SUCCESS=0))
    monkeypatch.setattr(calls, "_drv", bindings)
    monkeypatch.setattr(driver.Event, "create", staticmethod(lambda timing: FakeEvent()))
    monkeypatch.setattr(driver, "stream", lambda raw: f"stream{raw}")
    monkeypatch.setattr(launcher_module, "_raw_stream_getter",
                        lambda index: lambda: state.raw[0])
    return state


def make_launcher(leaf=True, inputs=1):
    slots = [InputSlot(tensor=torch.zeros(2, 3), address=0x100 * (i + 1), nbytes=24,
                       shape=torch.Size([2, 3]), dtype=torch.float32, dense=True,
                       cell=0x9000 + 8 * i) for i in range(inputs)]
    out = torch.ones(2)
    spec = SimpleNamespace(is_leaf=lambda: leaf)
    launch = Launcher("exec", slots, torch.device("cpu"), [out], spec, context="ctx")
    if not leaf:
        launch._unflatten = lambda flat: ("wrapped", flat[0])
    return launch, out


def driver_calls(state, name):
    return [entry[1:] for entry in state.log if entry[0] == name]


def test_a_plain_call_writes_a_new_address_once_and_launches_on_the_callers_stream(fake):
    launch, out = make_launcher()
    weights = SimpleNamespace(epoch=EPOCH[0])
    fast = launch.fast_call(weights)
    x = torch.randn(2, 3)
    assert fast((x,)) is out
    assert fast((x,)) is out  # the cell holds x already: no second write
    y = torch.randn(2, 3)
    assert fast((y,)) is out
    assert driver_calls(fake, "cuStreamWriteValue64") == [
        ("stream7", 0x9000, x.data_ptr(), 0), ("stream7", 0x9000, y.data_ptr(), 0)]
    assert driver_calls(fake, "cuGraphLaunch") == [("exec", "stream7")] * 3
    assert not driver_calls(fake, "cuEventRecord")  # the first call had no stream before it


def test_a_call_on_another_stream_waits_for_the_previous_calls_stream_first(fake):
    launch, _ = make_launcher()
    fast = launch.fast_call(SimpleNamespace(epoch=EPOCH[0]))
    x = torch.randn(2, 3)
    fast((x,))
    fake.raw[0] = 8
    fast((x,))
    fast((x,))
    assert driver_calls(fake, "cuEventRecord") == [("event", "stream7")]
    assert driver_calls(fake, "cuStreamWaitEvent") == [("stream8", "event", 0)]
    assert driver_calls(fake, "cuGraphLaunch") == [("exec", "stream7")] + [("exec", "stream8")] * 2
    assert launch.last_stream == "stream8"


@pytest.mark.parametrize("case", ["dtype", "shape", "strided", "subclass", "count", "not tensor"])
def test_any_other_input_is_left_to_the_general_path_before_any_driver_call(fake, case):
    launch, _ = make_launcher()
    fast = launch.fast_call(SimpleNamespace(epoch=EPOCH[0]))
    x = torch.randn(2, 3)
    inputs = {"dtype": (x.double(),), "shape": (torch.randn(3, 2),),
              "strided": (torch.randn(3, 2).t(),), "subclass": (torch.nn.Parameter(x),),
              "count": (x, x), "not tensor": (x.numpy(),)}[case]
    assert fast(inputs) is TAKE_GENERAL_PATH
    assert fake.log == []


def test_moved_weights_another_thread_and_a_closed_graph_take_the_general_path(fake):
    launch, _ = make_launcher()
    weights = SimpleNamespace(epoch=EPOCH[0])
    fast = launch.fast_call(weights)
    x = torch.randn(2, 3)
    weights.epoch -= 1  # the process-wide epoch moved since this graph accepted its weights
    assert fast((x,)) is TAKE_GENERAL_PATH
    weights.epoch += 1
    seen = []
    worker = threading.Thread(target=lambda: seen.append(fast((x,))))
    worker.start()
    worker.join()
    assert seen == [TAKE_GENERAL_PATH]  # its context is made current by the general path
    launch.close()
    assert fast((x,)) is TAKE_GENERAL_PATH
    assert fake.log == []
    with pytest.raises(NimbleError, match="closed"):
        launch.run_flat((x,))


def test_a_failed_launch_raises_naming_the_call(fake):
    launch, _ = make_launcher()
    fast = launch.fast_call(SimpleNamespace(epoch=EPOCH[0]))
    fake.codes.append(719)
    with pytest.raises(CudaError, match="cuGraphLaunch failed with CUDA_ERROR_LAUNCH_FAILED"):
        fast((torch.randn(2, 3),))
    assert not launch.lock.locked()


def test_several_inputs_and_a_structured_output(fake):
    launch, out = make_launcher(leaf=False, inputs=2)
    fast = launch.fast_call(SimpleNamespace(epoch=EPOCH[0]))
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    assert fast((x, y)) == ("wrapped", out)
    assert fast((x, y.double())) is TAKE_GENERAL_PATH
    assert driver_calls(fake, "cuStreamWriteValue64") == [
        ("stream7", 0x9000, x.data_ptr(), 0), ("stream7", 0x9008, y.data_ptr(), 0)]


def test_the_general_path_joins_streams_the_same_way_and_rejects_bad_inputs(fake):
    launch, out = make_launcher()
    x = torch.randn(2, 3)
    assert launch.run_flat((x,)) == [out]
    fake.raw[0] = 9
    assert launch.run_flat((torch.randn(2, 3),)) == [out]
    assert driver_calls(fake, "cuStreamWaitEvent") == [("stream9", "event", 0)]
    with pytest.raises(InputError, match="prepared for"):
        launch.run_flat((x.double(),))
    # nm([1, 2, 3]) hands the list's items over: what is wrong is that one is not a tensor
    with pytest.raises(InputError, match=r"input 0 \(of the list passed\) is a int, not a tensor"):
        launch.run_flat([1, 2, 3])
    with pytest.raises(InputError, match="prepared with 1 input"):
        launch.run_flat((x, x))


def test_no_fast_path_for_random_graphs_copies_or_slots_without_cells(fake):
    launch, _ = make_launcher()
    launch.return_copies = True
    assert launch.fast_call(SimpleNamespace(epoch=EPOCH[0])) is None
    bare, _ = make_launcher()
    bare._slots = (bare.slots[0]._replace(cell=0),)
    assert bare.fast_call(SimpleNamespace(epoch=EPOCH[0])) is None


def test_reading_cells_or_phases_changes_nothing_and_host_writes_cells_makes_calls_write_again(
        fake, monkeypatch):
    import nimble

    launch, _ = make_launcher()
    built = SimpleNamespace(span=range(0, 4), exec=SimpleNamespace(handle=5))
    engine = SimpleNamespace(launcher=launch, launchers=[launch], builts=[built], step=None)
    monkeypatch.setattr(nimble.Nimble, "engine", property(lambda self: engine))
    nm = nimble.Nimble(None)
    x = torch.randn(2, 3)
    launch.run_flat((x,))
    assert nm.input_cells == [0x9000]
    [phase] = nm.phases
    assert (phase.name, phase.tasks, phase.exec_handle, phase.input_cells) == \
        ("inference", range(0, 4), 5, [0x9000])
    launch.run_flat((x,))
    assert driver_calls(fake, "cuStreamWriteValue64") == [("stream7", 0x9000, x.data_ptr(), 0)]
    nm.host_writes_cells()  # a C host wrote the cell: the next call writes it again
    launch.run_flat((x,))
    assert driver_calls(fake, "cuStreamWriteValue64") == \
        [("stream7", 0x9000, x.data_ptr(), 0)] * 2


@pytest.mark.parametrize("path", ["fast, one input", "fast, two inputs", "general",
                                  "general, strided", "general, padded rows"])
def test_every_cell_write_and_launch_holds_the_call_order_lock(fake, path):
    """Calls from several threads are serialized by the lock their launchers share
    (:class:`CallOrder`): a write or launch outside it interleaves with another thread's."""
    launch, _ = make_launcher(inputs=2 if "two" in path else 1)
    fake.lock = launch.lock
    x = [torch.randn(2, 3) for _ in launch.slots]
    if path.startswith("fast"):
        fast = launch.fast_call(SimpleNamespace(epoch=EPOCH[0]))
        launch.run_flat(tuple(x))  # the first call of the thread takes the general path
        fake.held.clear()
        fast(tuple(y.clone() for y in x))
        fake.raw[0] = 8  # another stream: the switch's event record and wait too
        fast(tuple(x))
    elif path == "general, padded rows":
        with launch.lock:
            launch.run_flat_held((torch.randn(1, 3),), rows=1)
    else:
        launch.run_flat((torch.randn(3, 2).t(),) if "strided" in path else tuple(x))
        fake.raw[0] = 9
        launch.run_flat(tuple(x))
    names = [name for name, _ in fake.held]
    assert "cuGraphLaunch" in names and "cuStreamWriteValue64" in names, fake.held
    assert all(held for _, held in fake.held), fake.held
    assert not launch.lock.locked()
