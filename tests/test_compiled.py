"""What Nimble checks of a ``torch.compile``'d module before capturing it (no GPU: nothing is
compiled until a call)."""
from __future__ import annotations

import pytest
import torch

from nimble.record.compiled import check_compiled, is_compiled, module_name
from nimble.errors import InputError


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_a_mode_with_cuda_graphs_of_its_own_is_refused_with_what_to_use(mode):
    compiled = torch.compile(torch.nn.Linear(2, 2), mode=mode)
    with pytest.raises(InputError, match="max-autotune-no-cudagraphs"):
        check_compiled(compiled)


@pytest.mark.parametrize("options", [{}, {"mode": "max-autotune-no-cudagraphs"}])
def test_modes_without_cuda_graphs_are_taken(options):
    compiled = torch.compile(torch.nn.Linear(2, 2), **options)
    check_compiled(compiled)
    assert is_compiled(compiled) and module_name(compiled) == "Linear (compiled)"


def test_the_cudagraphs_option_is_refused_too():
    compiled = torch.compile(torch.nn.Linear(2, 2), options={"triton.cudagraphs": True})
    with pytest.raises(InputError, match="CUDA graphs of its own"):
        check_compiled(compiled)


def test_a_plain_module_is_not_compiled():
    plain = torch.nn.Linear(2, 2)
    check_compiled(plain)
    assert not is_compiled(plain) and module_name(plain) == "Linear"
