"""``nimble save`` on a machine without a GPU: every wrong use ends in one line and status 2,
the missing GPU said first where the use is right."""
from __future__ import annotations

import pytest

from nimble.cli.main import main


@pytest.mark.parametrize("argv, message", [
    (["save", "resnet50", "--generate"], "--generate takes a causal LM"),
    (["save", "gpt2_tiny", "--generate", "--no-weights"], "drop --no-weights and --instances"),
    (["save", "gpt2_tiny", "--generate", "--instances", "2"], "drop --no-weights"),
    (["save", "gpt2_tiny", "--generate"], "needs an NVIDIA GPU"),
    (["save", "resnet50"], "needs an NVIDIA GPU"),
    (["save", "alexnet"], "unknown model 'alexnet'"),
    (["save", "resnet50", "--fuse-projections"], "applies to a Generator: add --generate"),
    (["save", "gpt2_tiny", "--generate", "--fuse-projections"], "needs an NVIDIA GPU"),
    (["save", "resnet50", "--dtype", "int8"], None),
])
def test_a_wrong_or_gpuless_save_ends_in_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 or message is None
    if message is not None:
        assert message in err
