"""``torch.compile(model, backend="nimble")`` on the CPU: the entry point that registers the
backend, and the ``options=`` / ``mode=`` it parses (:mod:`nimble.compile_backend.options`).
The regions Dynamo's graphs become: test_compile_backend.py."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib import metadata

import pytest

torch = pytest.importorskip("torch")

from nimble.compile_backend import backend as registered, parse_options  # noqa: E402
from nimble.engine.options import PrepareOptions  # noqa: E402
from nimble.errors import InputError  # noqa: E402


# ---- registration -----------------------------------------------------------------------------

def test_the_installed_entry_point_finds_the_backend_without_importing_nimble(tmp_path):
    try:
        metadata.distribution("nimble-gpu")
    except metadata.PackageNotFoundError:
        pytest.skip("nimble-gpu is not installed: python -m pip install --no-build-isolation "
                    "--no-deps -e .")
    code = textwrap.dedent("""
        import sys
        import torch
        from torch._dynamo.backends.registry import list_backends, lookup_backend
        assert "nimble" in list_backends(), list_backends()
        assert "nimble" not in sys.modules
        found = lookup_backend("nimble")
        print(type(found).__module__, type(found).__name__)
    """)
    # Run elsewhere than the checkout: a stale nimble_gpu.egg-info there would shadow the
    # installed metadata.
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert done.returncode == 0, (
        f"{done.stderr[-2000:]}\n(entry points are read at install: re-run python -m pip "
        "install --no-build-isolation --no-deps -e .)")
    assert done.stdout.split() == ["nimble.compile_backend.backend", "NimbleBackend"]


def test_the_entry_point_names_the_object_this_package_exports():
    from torch._dynamo.backends.registry import lookup_backend

    found = [ep for ep in metadata.entry_points(group="torch_dynamo_backends")
             if ep.name == "nimble"]
    if not found:
        pytest.skip("nimble-gpu's entry points are not installed here")
    assert found[0].value == "nimble.compile_backend:backend"
    assert lookup_backend("nimble") is registered


# ---- options ------------------------------------------------------------------------------------

def test_prepare_options_fields_and_the_backends_own_keys_are_taken():
    parsed = parse_options({"relaunches": 10, "fuzz": False, "max_shapes": 3,
                            "fallback": True, "return_copies": False, "max_streams": 4})
    assert parsed.prepare == PrepareOptions(relaunches=10, fuzz=False)
    assert (parsed.max_shapes, parsed.fallback, parsed.return_copies, parsed.max_streams) == \
        (3, True, False, 4)
    assert parsed.inductor == {"triton.cudagraphs": False}


def test_every_prepare_options_field_is_an_option_of_the_backend():
    """A field added to PrepareOptions is taken by the backend too (prefetch_l2 was not)."""
    import dataclasses

    from nimble.compile_backend.options import known_keys

    # a recording made beforehand is of a module, not of a graph Dynamo hands over
    fields = {f.name for f in dataclasses.fields(PrepareOptions)} - {"recording"}
    assert fields <= set(known_keys()), fields - set(known_keys())
    assert parse_options({"prefetch_l2": True}).prepare == PrepareOptions(prefetch_l2=True)


def test_no_options_are_the_defaults():
    parsed = parse_options(None)
    assert parsed.prepare == PrepareOptions()
    assert parsed.return_copies and not parsed.fallback and parsed.max_shapes == 8


def test_a_misspelt_option_names_the_nearest_key():
    with pytest.raises(InputError, match="'relaunches'"):
        parse_options({"relaunchs": 10})
    with pytest.raises(InputError, match="no option 'colour'"):
        parse_options({"colour": 1})


@pytest.mark.parametrize("options, says", [
    ({"max_shapes": True}, "max_shapes takes int"),
    ({"fuzz": "no"}, "fuzz takes bool"),
    ({"relaunches": 2.5}, "relaunches takes int or None"),
    ({"max_shapes": 0}, "at least one"),
    ({"recording": object()}, "records every graph"),
    ({"resource_order": "backwards"}, "a rule is one of"),
    ({"inductor": {"triton.cudagraphs": True}}, "cannot be captured"),
])
def test_a_wrong_value_is_an_input_error(options, says):
    with pytest.raises(InputError, match=says):
        parse_options(options)


def test_a_mode_sets_inductor_as_that_mode_without_its_cuda_graphs():
    assert parse_options(None, "reduce-overhead").inductor == {"triton.cudagraphs": False}
    for mode in ("max-autotune", "max-autotune-no-cudagraphs"):
        patches = parse_options(None, mode).inductor
        assert patches["max_autotune"] and patches["triton.cudagraphs"] is False
    with pytest.raises(InputError, match="the modes are default, reduce-overhead"):
        parse_options(None, "fastest")
