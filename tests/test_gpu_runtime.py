"""The Nimble API end to end on the GPU: prepare (with its bitwise proof), calls, errors."""
from __future__ import annotations

import pytest

from helpers import zoo_model

pytestmark = pytest.mark.gpu


def test_seed_example_runs_as_written():
    import torch

    import nimble

    model, dummy_input = zoo_model("branchy")
    nm = nimble.Nimble(model)
    nm.prepare(dummy_input, training=False)
    real_input = torch.randn_like(dummy_input)
    out = nm(real_input)
    with torch.no_grad():
        want = model(real_input)
    torch.testing.assert_close(out, want, rtol=1e-3, atol=1e-3)
    assert len(nm.schedule.streams) > 1
    assert isinstance(nm.exec_handle, int) and nm.exec_handle != 0
    nm.close()
    nm.close()


def test_outputs_are_views_unless_copies_asked_for():
    import torch

    import nimble

    model, x = zoo_model("branchy")
    nm = nimble.Nimble(model).prepare(x, options=nimble.PrepareOptions(relaunches=4))
    a = nm(torch.randn_like(x))
    kept = a.clone()
    b = nm(torch.randn_like(x))
    assert a.data_ptr() == b.data_ptr() and not torch.equal(kept, b)
    nm.prepare(x, return_copies=True, options=nimble.PrepareOptions(relaunches=4))
    a = nm(x)
    b = nm(torch.randn_like(x))
    assert a.data_ptr() != b.data_ptr()


def test_strided_inputs_and_side_streams_give_the_same_bits():
    import torch

    import nimble

    model, x = zoo_model("branchy")
    nm = nimble.Nimble(model).prepare(x, return_copies=True,
                                      options=nimble.PrepareOptions(relaunches=4))
    fresh = torch.randn_like(x)
    want = nm(fresh)
    with torch.no_grad():
        torch.testing.assert_close(want, model(fresh), rtol=1e-4, atol=1e-4)
    # A channels-last input takes torch's strided copy instead of the flat driver memcpy.
    strided = fresh.to(memory_format=torch.channels_last)
    assert not strided.is_contiguous()
    assert torch.equal(nm(strided), want)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = nm(fresh)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(got, want)
    assert not torch.equal(nm(torch.randn_like(x)), want)


def test_host_and_device_launchable_graphs_give_the_same_bits():
    import torch

    import nimble

    model, x = zoo_model("branchy")
    on_device = nimble.Nimble(model).prepare(
        x, return_copies=True, options=nimble.PrepareOptions(relaunches=4, keep_recording=True))
    on_host = nimble.Nimble(model).prepare(
        x, return_copies=True,
        options=nimble.PrepareOptions(relaunches=4, device_launch=False,
                                      recording=on_device.recording))
    assert (on_device.launch_mode, on_host.launch_mode) == ("device-launchable", "host")
    for _ in range(3):
        fresh = torch.randn_like(x)
        assert torch.equal(on_device(fresh), on_host(fresh))
        # and both equal the single-stream recording on the same input
        assert torch.equal(on_device(fresh), on_device.recording.replay_reference([fresh])[0])


def test_wrong_inputs_are_typed_errors():
    import torch

    import nimble
    from nimble.errors import InputError, NimbleError

    model, x = zoo_model("branchy")
    nm = nimble.Nimble(model)
    with pytest.raises(NimbleError, match="prepare"):
        nm(x)
    nm.prepare(x, options=nimble.PrepareOptions(relaunches=2))
    with pytest.raises(InputError, match="prepared for"):
        nm(torch.randn(2, 3, 64, 64, device="cuda"))
    with pytest.raises(InputError, match="prepared for"):
        nm(x.double())
    with pytest.raises(InputError, match="prepared for"):
        nm(x.cpu())
    with pytest.raises(InputError, match="input"):
        nm(x, x)
    with pytest.raises(InputError, match="not a tensor"):
        nm(x.cpu().numpy())
    with pytest.raises(NimbleError, match="training"):
        nm.prepare(x, training=True)


def test_the_common_call_is_bound_once_and_every_other_call_takes_the_general_path():
    """After the first call, a plain call runs a path with everything bound once
    (``Launcher.fast_call``); a wrong input, a strided one, one wrapped in a tuple, another
    stream, and a closed graph still get what the general path gives them."""
    import torch

    import nimble
    from nimble.errors import InputError, NimbleError

    model, x = zoo_model("branchy")
    nm = nimble.Nimble(model).prepare(x, options=nimble.PrepareOptions(relaunches=2))
    fresh = torch.randn_like(x)
    want = nm(fresh).clone()
    assert callable(nm._fast)
    assert torch.equal(nm(fresh), want) and torch.equal(nm((fresh,)), want)
    with pytest.raises(InputError, match="prepared for"):
        nm(x.double())
    with pytest.raises(InputError, match="input"):
        nm(x, x)
    assert torch.equal(nm(fresh.to(memory_format=torch.channels_last)), want)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = nm(fresh).clone()
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(got, want)
    other = torch.randn_like(x)
    assert not torch.equal(nm(other), want)  # a new address is written into the cell
    assert torch.equal(nm(fresh), want)
    nm.close()
    with pytest.raises(NimbleError, match="prepare"):
        nm(fresh)


@pytest.mark.usefixtures("failed_proofs_saved_aside")
def test_a_missed_relocation_is_caught_by_the_proof(monkeypatch):
    """Leave one reader's pointer at the recorded address: the poisoned run must fail loudly."""
    from nimble.engine import build
    from nimble.errors import VerificationError
    from nimble.api import Nimble
    from nimble import PrepareOptions

    model, x = zoo_model("branchy")
    real = build.relocate_params
    missed = []

    def leaky(task, bases):
        block = bytearray(real(task, bases))
        if not missed:
            reads = {a.buffer for a in task.accesses if not a.write}
            for p in task.pointers:
                if p.buffer in reads and bases[p.buffer] != p.value - p.offset:
                    block[p.location:p.location + 8] = p.value.to_bytes(8, "little")
                    missed.append((task.id, p.buffer))
                    break
        return bytes(block)

    monkeypatch.setattr(build, "relocate_params", leaky)
    with pytest.raises(VerificationError, match="differs"):
        Nimble(model).prepare(x, options=PrepareOptions(relaunches=2))
    assert missed


# ``nimble bench`` prepares (and so verifies) every zoo model in both modes; these cover the
# shapes that matter without doubling the suite's GPU time.
@pytest.mark.parametrize("name,multi", [("inception_v3", True), ("inception_v3", False),
                                        ("resnet50", True), ("gemm_chains", True),
                                        ("nasnetalarge", True)])
def test_zoo_model_prepares_and_verifies_bitwise(name, multi):
    import torch

    import nimble

    model, x = zoo_model(name)
    nm = nimble.Nimble(model).prepare(x, use_multi_stream=multi,
                                      options=nimble.PrepareOptions(relaunches=100))
    out = nm(x)
    with torch.no_grad():
        want = model(x)
    torch.testing.assert_close(out, want, rtol=2e-3, atol=2e-3)
    if multi and name in ("inception_v3", "googlenet", "nasnetalarge", "gemm_chains"):
        assert len(nm.schedule.streams) > 1
    assert nm.memplan.arena_bytes <= nm.memplan.buffer_bytes
    assert nm.launch_mode == "device-launchable"
    nm.close()


class _TwoInputs:
    """A model with two inputs of sizes that are not multiples of 16 bytes."""

    @staticmethod
    def create():
        import torch
        from torch import nn

        class TwoInputs(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.linear = nn.Linear(105, 10)

            def forward(self, a, b):
                return self.linear(a.flatten(1)), torch.tanh(b) * 2

        return TwoInputs().cuda().eval()


def test_inputs_of_any_size_and_alignment_are_gathered_exactly():
    import torch

    import nimble

    model = _TwoInputs.create()
    a, b = torch.randn(1, 3, 7, 5, device="cuda"), torch.randn(13, device="cuda")
    nm = nimble.Nimble(model).prepare((a, b), return_copies=True,
                                      options=nimble.PrepareOptions(relaunches=8))
    assert all(nm.input_cells)  # 420 and 52 bytes: the gather's byte path
    copied = nimble.Nimble(model).prepare(
        (a, b), return_copies=True,
        options=nimble.PrepareOptions(relaunches=8, gather_inputs=False))
    assert not any(copied.input_cells)
    big = torch.randn(2 * 105 + 1, device="cuda")
    unaligned_a = big[1:106].view(1, 3, 7, 5)  # 4 bytes past a 16-byte boundary
    unaligned_b = torch.randn(14, device="cuda")[1:]
    assert unaligned_a.data_ptr() % 16 and unaligned_b.data_ptr() % 16
    for x, y in ((a, b), (unaligned_a, unaligned_b), (torch.randn_like(a), torch.randn_like(b))):
        got, want = nm(x, y), copied(x.clone(), y.clone())
        with torch.no_grad():
            eager = model(x, y)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)


def test_a_c_host_drives_the_exec_handle_through_the_input_cells():
    import torch

    import nimble
    from nimble import driver

    model, x = zoo_model("branchy")
    nm = nimble.Nimble(model).prepare(x, options=nimble.PrepareOptions(relaunches=4))
    fresh = torch.randn_like(x)
    want = nm(fresh).clone()
    view = nm(torch.randn_like(x))  # the arena's output bytes, rewritten by every launch
    # What a C host does with the raw handles: point the cell at its tensor, launch the exec.
    drv = driver.bindings()
    stream = drv.CUstream(torch.cuda.current_stream().cuda_stream)
    driver.call("cuStreamWriteValue64", stream, nm.input_cells[0], fresh.data_ptr(), 0)
    driver.call("cuGraphLaunch", drv.CUgraphExec(nm.exec_handle), stream)
    torch.cuda.synchronize()
    assert torch.equal(view, want)


def test_memory_at_chosen_low_bits_is_usable_and_freed_once():
    import torch

    from nimble import driver

    driver.ensure_context()
    low = 0x7F8E_0000_0004 % (1 << 32)
    memory = driver.LowBitsMemory.allocate(3 << 20, 0x7F8E_0000_0004, torch.cuda.current_device())
    assert memory.address % (1 << 32) == low and memory.size == 3 << 20
    assert (memory.address, 3 << 20) in driver.nimble_memory()  # no library's, to a recording
    data = bytes(range(256)) * 16
    driver.copy_to_device(memory.address + (3 << 20) - len(data), data)  # its last bytes
    assert driver.copy_to_host(memory.address + (3 << 20) - len(data), len(data)) == data
    memory.close()
    memory.close()
    assert memory.closed
    assert (memory.address, 3 << 20) not in driver.nimble_memory()


def test_buffers_kept_at_their_low_bits_run_right():
    """Buffers that a word may point into or merely resemble (``low_word_buffers``) live at their
    recorded address plus a multiple of 4 GiB; the graph over them proves and runs right."""
    import torch

    from nimble.record.recorder import record
    from nimble.api import Nimble
    from nimble import PrepareOptions

    model, x = zoo_model("branchy")
    rec = record(model, (x,), quiet=True)
    g = rec.graph
    chosen = [b.id for b in g.buffers if b.kind in ("intermediate", "scratch")][::3]
    assert chosen
    g.meta["low_word_buffers"] = chosen
    nm = Nimble(model).prepare(x, options=PrepareOptions(recording=rec, relaunches=4))
    bases = nm.buffer_addresses
    assert all(bases[b] % (1 << 32) == g.buffers[b].address % (1 << 32) for b in chosen)
    assert all(bases[b] != g.buffers[b].address for b in chosen)
    for _ in range(3):
        x2 = torch.randn_like(x)
        with torch.no_grad():
            want = model(x2)
        torch.testing.assert_close(nm(x2), want, rtol=1e-4, atol=1e-4)


def test_kernels_run_at_priorities_from_their_slack_and_give_the_same_bits():
    """Every kernel node carries the priority computed for it, the exec stays
    device-launchable with node priorities on, and the answer is the one without them."""
    import warnings

    import torch

    import nimble
    from nimble import driver

    model, x = zoo_model("branchy")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no refused device-launchable exec
        nm = nimble.Nimble(model).prepare(
            x, return_copies=True, options=nimble.PrepareOptions(relaunches=4, keep_recording=True))
    plain = nimble.Nimble(model).prepare(
        x, return_copies=True,
        options=nimble.PrepareOptions(relaunches=4, priorities=False, recording=nm.recording))
    assert nm.launch_mode == "device-launchable" and plain.kernel_priorities is None
    least, greatest = driver.stream_priority_range()
    priorities = nm.kernel_priorities
    assert priorities is not None and len(priorities) == len(nm.graph.tasks)
    assert all(greatest <= p <= least for p in priorities)
    assert min(priorities) == greatest  # the critical path runs at the top priority
    built = nm.engine.built
    kernels = [t for t in built.span if nm.graph.tasks[t].kind == "kernel"]
    assert kernels
    for t in kernels:
        assert driver.kernel_priority(built.nodes[t - built.span.start]) == priorities[t]
    for _ in range(3):
        fresh = torch.randn_like(x)
        assert torch.equal(nm(fresh), plain(fresh))
        assert torch.equal(nm(fresh), nm.recording.replay_reference([fresh])[0])
