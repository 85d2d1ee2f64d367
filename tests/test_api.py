"""The public surface of ``nimble`` (CPU): every exception class a NimbleError."""
from __future__ import annotations

import importlib
import inspect
import pkgutil

import nimble


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
