"""The watch for profiler runs (nimble.engine.profiler_guard): a real torch profiler run on the
CPU marks CUPTI attached unless TEARDOWN_CUPTI=1; graphs then go to host launch, warning once."""
from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from nimble.engine import profiler_guard
from nimble.engine.weights import EPOCH


@pytest.fixture
def fresh_state(monkeypatch):
    monkeypatch.setattr(profiler_guard, "_state",
                        {"watching": False, "attached": False, "warned": False})
    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    yield profiler_guard._state


def _profile_once() -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        torch.ones(4).sum()


def test_a_profiler_run_marks_cupti_attached_and_moves_the_epoch(fresh_state):
    profiler_guard.watch_profiler()
    assert not profiler_guard.cupti_attached()
    before = EPOCH[0]
    _profile_once()
    assert profiler_guard.cupti_attached()
    assert EPOCH[0] > before
    again = EPOCH[0]
    _profile_once()  # attached once for good: no second epoch move
    assert EPOCH[0] == again


def test_the_legacy_profiler_is_watched_too(fresh_state):
    profiler_guard.watch_profiler()
    with torch.autograd.profiler.profile():
        torch.ones(2) * 2
    assert profiler_guard.cupti_attached()


def test_teardown_cupti_keeps_graphs_as_they_are(fresh_state, monkeypatch):
    monkeypatch.setenv("TEARDOWN_CUPTI", "1")
    profiler_guard.watch_profiler()
    before = EPOCH[0]
    _profile_once()
    assert not profiler_guard.cupti_attached()
    assert EPOCH[0] == before


def test_the_watch_is_installed_once(fresh_state):
    profiler_guard.watch_profiler()
    hook = torch.autograd.profiler._run_on_profiler_start
    fresh_state["watching"] = False
    profiler_guard.watch_profiler()
    assert torch.autograd.profiler._run_on_profiler_start is hook
    assert hook._nimble_watch


def test_device_launch_is_turned_down_with_one_warning(fresh_state):
    assert profiler_guard.device_launch_allowed(True)
    fresh_state["attached"] = True
    with pytest.warns(RuntimeWarning, match="TEARDOWN_CUPTI=1"):
        assert not profiler_guard.device_launch_allowed(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not profiler_guard.device_launch_allowed(True)
        assert not profiler_guard.device_launch_allowed(False)


class _Built:
    def __init__(self, name: str, device_launch: bool) -> None:
        self.name, self.device_launch, self.closed = name, device_launch, False
        self.exec = SimpleNamespace(handle=f"exec-{name}")

    def close(self) -> None:
        self.closed = True


class _Builder:
    def __init__(self, fail_at: int | None = None) -> None:
        self.built: list[_Built] = []
        self.fail_at = fail_at

    def build(self, k, options):
        if k == self.fail_at:
            raise RuntimeError("instantiate refused")
        copy = _Built(f"host{k}", options.device_launch)
        self.built.append(copy)
        return copy


class _Launcher:
    last_stream = None

    def __init__(self) -> None:
        self.exec = None

    def set_exec(self, handle) -> None:
        self.exec = handle


def _prepared(builder, flags):
    builts = [_Built(f"served{k}", d) for k, d in enumerate(flags)]
    return SimpleNamespace(builts=builts, launchers=[_Launcher() for _ in flags],
                           phase_builder=lambda: builder)


def test_device_launchable_phases_are_rebuilt_for_host_launch(fresh_state):
    builder = _Builder()
    prepared = _prepared(builder, [True, False])
    served = list(prepared.builts)
    assert not profiler_guard.host_launch_if_profiled(prepared)  # nothing attached yet
    fresh_state["attached"] = True
    with pytest.warns(RuntimeWarning):
        assert profiler_guard.host_launch_if_profiled(prepared)
    assert prepared.builts[0].name == "host0" and not prepared.builts[0].device_launch
    assert prepared.builts[1] is served[1]  # a host-launch phase stays
    assert served[0].closed and not served[1].closed
    assert prepared.launchers[0].exec == "exec-host0" and prepared.launchers[1].exec is None
    assert not profiler_guard.host_launch_if_profiled(prepared)  # done once


def test_a_failed_rebuild_leaves_the_served_graphs(fresh_state):
    builder = _Builder(fail_at=1)
    prepared = _prepared(builder, [True, True])
    served = list(prepared.builts)
    fresh_state["attached"] = True
    with pytest.raises(RuntimeError, match="refused"):
        profiler_guard.host_launch_if_profiled(prepared)
    assert prepared.builts == served and not any(b.closed for b in served)
    assert all(copy.closed for copy in builder.built)
    assert all(launcher.exec is None for launcher in prepared.launchers)


@pytest.mark.parametrize("env, tool", [
    ({"NV_SANITIZER_INJECTION_PORT_BASE": "49152"}, "compute-sanitizer"),
    ({"CUDA_INJECTION64_PATH": "/opt/nsys/libToolsInjection64.so"},
     "a CUDA tool (libToolsInjection64.so)"),
])
def test_an_injected_cuda_tool_turns_device_launch_down(fresh_state, monkeypatch, env, tool):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert profiler_guard.injected_tool() == tool
    assert profiler_guard.cupti_attached()
    with pytest.warns(RuntimeWarning, match=tool.split(" (")[0]):
        assert not profiler_guard.device_launch_allowed(True)


def test_no_tool_in_a_plain_environment(fresh_state, monkeypatch):
    for name in [n for n in __import__("os").environ if n.startswith("NV_SANITIZER_INJECTION")]:
        monkeypatch.delenv(name)
    monkeypatch.delenv("CUDA_INJECTION64_PATH", raising=False)
    assert profiler_guard.injected_tool() == ""
    assert not profiler_guard.cupti_attached()


class _CallingLauncher(_Launcher):
    """A launcher a Nimble object calls through (its general path), logging the exec each
    call launched."""

    def __init__(self, exec_handle: str) -> None:
        import threading

        super().__init__()
        self.exec, self.lock, self.launched = exec_handle, threading.Lock(), []
        self.unflatten = lambda flat: flat[0]

    def fast_call(self, weights):
        return None  # every call by the general path

    def run_flat(self, inputs):
        self.launched.append(self.exec)
        return [inputs[0] * 2]


class _Weights:
    """Weights that never move: each call after the epoch moved accepts them as they are."""

    def __init__(self) -> None:
        self.epoch = EPOCH[0]

    def moves(self) -> dict:
        return {}

    def accept(self, moves) -> list:
        self.epoch = EPOCH[0]
        return []


def test_a_call_after_a_profiler_run_launches_the_host_launch_rebuild(fresh_state):
    """The API's side of the guard: the call after a profiler run rebuilds the prepared
    device-launchable graph for host launch (warning once) and launches that, and later
    calls keep it."""
    import nimble

    builder = _Builder()
    launcher = _CallingLauncher("exec-served0")
    prepared = SimpleNamespace(builts=[_Built("served0", True)], launchers=[launcher],
                               launcher=launcher, phase_builder=lambda: builder,
                               weights=_Weights(), step=None, bases=[])
    nm = nimble.Nimble(None)  # starts the watch
    nm._prepared = prepared
    nm._serving = SimpleNamespace(plain=True, preparations=lambda: [prepared])
    x = torch.ones(2)
    assert torch.equal(nm(x), x * 2)
    _profile_once()
    with pytest.warns(RuntimeWarning, match="TEARDOWN_CUPTI=1"):
        nm(x)
    nm(x)
    assert launcher.launched == ["exec-served0", "exec-host0", "exec-host0"]
    assert prepared.builts[0].name == "host0" and builder.built[0].device_launch is False


def test_keeping_kernel_binaries_turns_device_launch_down_with_its_own_warning(fresh_state):
    from nimble.engine.weights import EPOCH

    before = EPOCH[0]
    profiler_guard.note_cupti_attached("kept kernel binaries")
    assert profiler_guard.cupti_attached() and EPOCH[0] == before + 1
    with pytest.warns(RuntimeWarning, match="keep_kernel_binaries"):
        assert profiler_guard.device_launch_allowed(True) is False
    profiler_guard.note_cupti_attached("again")
    assert EPOCH[0] == before + 1
