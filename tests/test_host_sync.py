"""Where a forward synchronised with the host: the frame named, and the capture error's words.

The capture itself runs on the GPU (tests/test_gpu_host_sync.py, tests/test_gpu_transformers.py);
here the frame selection runs on tracebacks and frame lists shaped like those a failing capture
gives: the model's code, a library it calls, then torch's and Nimble's own frames around the
C++ call that refused to synchronise.
"""
from __future__ import annotations

import traceback

import pytest

from nimble.errors import CaptureError
from nimble.record.host_sync import (TORCH_SYNC_MESSAGES, SyncSite, capture_failure,
                                     exception_site, library_roots, sync_errors_raised, sync_site)

TORCH = "/env/site-packages/torch"
NIMBLE = "/src/nimble"
SKIP = (TORCH, NIMBLE)


def _frames(*entries: tuple[str, int, str]) -> list[traceback.FrameSummary]:
    return [traceback.FrameSummary(f, line, fn, lookup_line=False, line="")
            for f, line, fn in entries]


def test_names_the_library_line_that_synchronised_inside_the_models_forward():
    frames = _frames(
        (f"{NIMBLE}/record/capture.py", 250, "_capture_traced"),
        (f"{NIMBLE}/record/recorder.py", 172, "forward"),
        (f"{TORCH}/nn/modules/module.py", 1775, "_call_impl"),
        ("/home/user/model.py", 12, "forward"),
        ("/env/site-packages/transformers/masking_utils.py", 776,
         "find_packed_sequence_indices"),
        (f"{TORCH}/utils/_python_dispatch.py", 300, "__torch_dispatch__"),
        (f"{NIMBLE}/record/tracer.py", 180, "__torch_dispatch__"),
        (f"{TORCH}/_ops.py", 841, "__call__"),
    )
    site = sync_site(frames, SKIP)
    assert site == SyncSite("/env/site-packages/transformers/masking_utils.py", 776,
                            "find_packed_sequence_indices")


def test_names_the_models_line_when_it_calls_torch_directly():
    frames = _frames(
        (f"{TORCH}/nn/modules/module.py", 1775, "_call_impl"),
        ("/home/user/model.py", 12, "forward"),
        (f"{TORCH}/_tensor.py", 40, "wrapped"),
        ("<frozen importlib._bootstrap>", 1, "_call_with_frames_removed"),
    )
    assert sync_site(frames, SKIP).file == "/home/user/model.py"


def test_a_package_beside_torch_is_not_torch():
    # torchvision lies beside torch, its path starts with torch's: it is not torch's own code
    frames = _frames(("/env/site-packages/torchvision/ops/boxes.py", 41, "nms"),
                     (f"{TORCH}/_ops.py", 841, "__call__"))
    assert sync_site(frames, SKIP).file == "/env/site-packages/torchvision/ops/boxes.py"


def test_no_frame_outside_torch_and_nimble_names_nothing():
    frames = _frames((f"{NIMBLE}/record/capture.py", 250, "_capture_traced"),
                     (f"{TORCH}/cuda/graphs.py", 260, "__exit__"))
    assert sync_site(frames, SKIP) is None
    assert sync_site([], SKIP) is None


def _forward_that_syncs():
    raise RuntimeError(f"{TORCH_SYNC_MESSAGES[0]}")  # the line the error must name


def _defined_in(path: str, source: str) -> dict:
    """The names ``source`` defines, as if it were the file ``path`` (a library's frames)."""
    names: dict = {}
    exec(compile(source, path, "exec"), names)
    return names


def test_exception_site_passes_over_an_error_raised_again_from_torch_alone():
    # a capture that fails raises once in the model, and again from torch when it ends; Nimble
    # catches the second
    end_capture = _defined_in(f"{TORCH}/cuda/graphs.py", (
        "def end_capture(forward):\n"
        "    try:\n"
        "        forward()\n"
        "    except RuntimeError:\n"
        "        raise RuntimeError('operation failed due to a previous error during capture')\n"
    ))["end_capture"]
    capture = _defined_in(f"{NIMBLE}/record/capture.py", (
        "def capture(end_capture, forward):\n"
        "    try:\n"
        "        end_capture(forward)\n"
        "    except RuntimeError as e:\n"
        "        return e\n"
    ))["capture"]
    error = capture(end_capture, _forward_that_syncs)
    assert "previous error" in str(error)
    site = exception_site(error, SKIP)
    assert site.file == __file__ and site.function == "_forward_that_syncs"
    assert site.code == 'raise RuntimeError(f"{TORCH_SYNC_MESSAGES[0]}")  # the line the error must name'
    assert site.line == _forward_that_syncs.__code__.co_firstlineno + 1


def test_a_synchronisation_while_handling_another_error_names_its_own_line():
    def forward():
        try:
            {}["missing"]
        except KeyError:
            _forward_that_syncs()

    site = exception_site(_caught(forward), SKIP)
    assert site.function == "_forward_that_syncs"


def test_library_roots_are_torch_and_nimble():
    import os

    import torch

    import nimble

    roots = library_roots()
    assert os.path.dirname(torch.__file__) in roots
    assert os.path.dirname(nimble.__file__) in roots
    assert exception_site(_caught(_forward_that_syncs), roots).file == __file__


def _caught(fn) -> BaseException:
    try:
        fn()
    except RuntimeError as e:
        return e
    raise AssertionError("expected an error")


def test_a_synchronisation_says_where_and_what_to_do():
    site = SyncSite("/home/user/model.py", 12, "forward", "return x * float(x.sum().item())")
    error = RuntimeError(f"{TORCH_SYNC_MESSAGES[0]}\nmore detail")
    e = capture_failure(error, "forward", "Syncs", site)
    assert isinstance(e, CaptureError)
    assert str(e) == (
        "the forward of Syncs cannot be captured into a CUDA graph: it synchronises with the host "
        "at /home/user/model.py:12 (in forward): return x * float(x.sum().item()). A forward "
        "must not synchronise with the host (.item(), .cpu(), printing a tensor, data-dependent "
        "Python control flow) and must keep its work on the GPU.")


def test_a_synchronisation_raised_again_by_the_capture_is_still_named_one():
    try:
        try:
            raise RuntimeError(TORCH_SYNC_MESSAGES[0])
        except RuntimeError:
            raise RuntimeError("operation failed due to a previous error during capture")
    except RuntimeError as e:
        message = str(capture_failure(e, "backward", "Net", None))
    assert "backward of Net cannot be captured into a CUDA graph: it synchronises with the host" \
        in message
    assert "no line outside torch and Nimble" in message


def test_another_capture_failure_keeps_its_first_line_and_the_site():
    site = SyncSite("/home/user/model.py", 30, "forward")
    error = RuntimeError("CUDA error: operation not permitted when stream is capturing\n"
                         "CUDA kernel errors might be asynchronously reported")
    message = str(capture_failure(error, "forward", "Net", site))
    assert message.startswith(
        "the forward of Net cannot be captured into a CUDA graph: CUDA error: operation not "
        "permitted when stream is capturing; raised at /home/user/model.py:30 (in forward). ")
    assert "asynchronously" not in message


def test_a_failure_with_no_line_of_the_users_names_the_last_op_traced_before_it():
    error = RuntimeError("CUDA error: operation failed due to a previous error during capture")
    message = str(capture_failure(error, "backward", "Net", None,
                                  "aten::convolution_backward in layer1.0.conv2"))
    assert ("operation failed due to a previous error during capture; raised (no line outside "
            "torch and Nimble on the call's stack; the last op traced before it: "
            "aten::convolution_backward in layer1.0.conv2). A backward must not") in message
    # a backward broken so may also be one tied to gradient-accumulation nodes made earlier
    assert "gradient-accumulation nodes were made earlier on another stream" in message
    assert "gradient-accumulation" not in str(capture_failure(error, "forward", "Net", None))
    site = SyncSite("/home/user/model.py", 30, "forward")
    assert "last op" not in str(capture_failure(error, "forward", "Net", site, "aten::mm"))


def test_the_sync_mode_is_error_inside_and_the_users_after_a_failure(monkeypatch):
    import torch

    modes: list = [1]  # the user's own "warn"
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: modes[-1])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    with pytest.raises(RuntimeError):
        with sync_errors_raised():
            assert modes[-1] == "error"
            raise RuntimeError(TORCH_SYNC_MESSAGES[0])
    assert modes == [1, "error", 1]


def test_a_copy_to_the_host_refused_under_capture_is_a_host_sync():
    error = RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture "
                         "unless the CPU tensor is pinned. ...")
    message = str(capture_failure(error, "forward", "Net", None))
    assert "it synchronises with the host (no line outside torch and Nimble" in message
