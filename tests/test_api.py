"""The public surface of ``nimble`` (CPU): the options object and the old keywords, every
exception class a NimbleError, the result types importable from the package without loading
torch."""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import nimble
from nimble.api import _options_with

ROOT = Path(__file__).resolve().parents[1]


def _modules():
    for info in pkgutil.walk_packages(nimble.__path__, "nimble."):
        if not info.name.endswith("__main__"):  # running it is the command line
            yield importlib.import_module(info.name)


def test_every_exception_class_of_the_package_is_a_nimble_error():
    found = {obj for module in _modules() for obj in vars(module).values()
             if inspect.isclass(obj) and issubclass(obj, BaseException)
             and obj.__module__.startswith("nimble")}
    assert {"MemPlanError", "ScheduleError", "InputError", "CudaError"} <= {c.__name__
                                                                           for c in found}
    # A private class (the command line's _Fail) is caught inside the package, never raised on.
    outside = sorted(c.__qualname__ for c in found
                     if not issubclass(c, nimble.NimbleError) and not c.__name__.startswith("_"))
    assert not outside, f"not NimbleError subclasses: {outside}"


def test_errors_keep_their_builtin_bases():
    from nimble.analysis.memplan import MemPlanError
    from nimble.analysis.schedule import ScheduleError

    assert issubclass(MemPlanError, ValueError) and issubclass(ScheduleError, ValueError)
    assert issubclass(nimble.InputError, ValueError)


def test_the_result_types_are_importable_from_nimble():
    from nimble.debug.divergence import Divergence
    from nimble.debug.step_through import Snapshot
    from nimble.debug.timeline import Timeline
    from nimble.record.recorder import Recording

    assert (nimble.Timeline, nimble.Snapshot, nimble.Divergence, nimble.Recording) == \
        (Timeline, Snapshot, Divergence, Recording)
    for name in nimble.__all__:
        assert getattr(nimble, name) is not None, name
    assert set(nimble.RESULT_TYPES) <= set(dir(nimble))
    with pytest.raises(AttributeError):
        nimble.NoSuchThing  # noqa: B018


def test_importing_nimble_loads_no_torch_and_its_result_types_load_on_use():
    r = subprocess.run([sys.executable, "-c", (
        "import sys, nimble\n"
        "nimble.Nimble, nimble.PrepareOptions, nimble.PhaseView, nimble.TaskGraph\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'cuda')))\n"
        "nimble.Timeline\n"
        "print('nimble.debug.timeline' in sys.modules)\n")],
        capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["[]", "True"]


def test_prepare_options_are_frozen_with_documented_defaults():
    options = nimble.PrepareOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.relaunches = 3  # type: ignore[misc]
    assert (options.proof_launches(training=False), options.proof_launches(training=True)) == \
        (100, 20)
    assert nimble.PrepareOptions(relaunches=4).proof_launches(training=True) == 4
    assert (options.backfill_on(training=True), options.backfill_on(training=False)) == \
        (True, False)
    assert nimble.PrepareOptions(backfill=False).backfill_on(training=True) is False
    doc = nimble.PrepareOptions.__doc__
    assert all(f"{f.name} :" in doc for f in dataclasses.fields(nimble.PrepareOptions))


def test_prepare_documents_every_parameter():
    doc = nimble.Nimble.prepare.__doc__
    assert "Parameters\n        ----------" in doc
    for name in inspect.signature(nimble.Nimble.prepare).parameters:
        if name != "self":
            assert f"{name} :" in doc or f"**{name}" in doc, name


def test_the_old_switch_keywords_still_work_with_a_deprecation_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _options_with(None, {}) == nimble.PrepareOptions()
    base = nimble.PrepareOptions(verify=False)
    with pytest.warns(DeprecationWarning, match=r"PrepareOptions\(relaunches=4\)"):
        got = _options_with(base, {"relaunches": 4})
    assert got == nimble.PrepareOptions(verify=False, relaunches=4)
    with pytest.raises(TypeError, match="no_such_switch"):
        _options_with(None, {"no_such_switch": 1})


def test_a_switch_passed_to_prepare_warns_at_the_callers_line():
    import torch

    model = torch.nn.Linear(2, 2).eval()
    with pytest.warns(DeprecationWarning) as warned, pytest.raises(nimble.NimbleError):
        nimble.Nimble(model).prepare(torch.zeros(2), relaunches=4)  # on the CPU: refused
    assert warned[0].filename == __file__


def test_prepare_takes_the_user_choices_as_keywords_and_the_switches_as_options():
    params = inspect.signature(nimble.Nimble.prepare).parameters
    assert list(params)[:2] == ["self", "example_inputs"]
    keywords = {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY}
    assert keywords == {"buckets", "batch_sizes", "instances", "pad", "training",
                        "use_multi_stream", "max_streams", "return_copies", "quiet", "options",
                        "average_gradients"}
    assert params["training"].default is False
