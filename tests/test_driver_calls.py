"""The per-call path's checked driver functions (nimble.driver.calls), on stand-in bindings."""
from types import SimpleNamespace

import pytest

from nimble.driver import calls
from nimble.errors import CudaError


@pytest.fixture
def fake_bindings(monkeypatch):
    codes = []  # what the next calls of the fake cuGraphLaunch return
    seen = []

    def launch(exec_handle, stream):
        seen.append((exec_handle, stream))
        return (codes.pop(0),)

    fake = SimpleNamespace(
        cuGraphLaunch=launch,
        cuGetErrorName=lambda code: (0, b"CUDA_ERROR_LAUNCH_FAILED" if code == 719 else b"?"),
        CUresult=SimpleNamespace(CUDA_SUCCESS=0))
    monkeypatch.setattr(calls, "_drv", fake)
    return codes, seen


def test_a_status_call_passes_its_arguments_and_returns_nothing_on_success(fake_bindings):
    codes, seen = fake_bindings
    launch = calls.checked_status("cuGraphLaunch")
    codes.append(0)
    assert launch("exec", "stream") is None
    assert seen == [("exec", "stream")]


def test_a_failed_status_call_raises_naming_the_call_and_the_error(fake_bindings):
    codes, _ = fake_bindings
    launch = calls.checked_status("cuGraphLaunch")
    codes.append(719)
    with pytest.raises(CudaError, match="cuGraphLaunch failed with CUDA_ERROR_LAUNCH_FAILED") as e:
        launch(1, 2)
    assert (e.value.call, e.value.code, e.value.name) == \
        ("cuGraphLaunch", 719, "CUDA_ERROR_LAUNCH_FAILED")
