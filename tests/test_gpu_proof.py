"""Bitwise, asserted: every inference zoo model in every precision is proven bit for bit.

The proof holds an output that the recording itself does not reproduce to a tolerance instead of
bitwise equality (``graph.meta["verified"]["not_bitwise"]``).  In inference no zoo model may
fall back to that: a fallback would hide a schedule that changes the arithmetic.  A failure
names each such output and the kernels that write it.
"""
from __future__ import annotations

import pytest

from helpers import zoo_model

pytestmark = pytest.mark.gpu

ZOO = ["resnet50", "inception_v3", "googlenet", "mobilenet_v2", "efficientnet_b0",
       "nasnetalarge", "pnasnet5large"]


def _not_bitwise_report(nm) -> str:
    from nimble.engine.proof import last_writers

    graph = nm.graph
    rows = []
    for index, spread in graph.meta["verified"]["not_bitwise"].items():
        output = graph.outputs[int(index)]
        rows.append(f"output {index} (spread {spread:.3g}) written by "
                    f"{last_writers(graph, output.buffer)}")
    return "; ".join(rows)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", ZOO)
def test_every_zoo_output_is_proven_bitwise(name, dtype):
    import torch

    import nimble

    model, x = zoo_model(name)
    model, x = model.to(getattr(torch, dtype)), x.to(getattr(torch, dtype))
    nm = nimble.Nimble(model).prepare(x, quiet=True)
    verified = nm.graph.meta["verified"]
    assert verified["launches"] >= 100 and verified["outputs"] == len(nm.graph.outputs)
    assert not verified["not_bitwise"], _not_bitwise_report(nm)
    assert verified["fuzz"] and verified["fuzz_launches"] == verified["delay_draws"] >= 1
    # every pair of tasks the schedule leaves unordered ran later-first in a serial order
    assert verified["pairs_not_reversed"] == 0
    assert verified["draw_kinds"].get("order", 0) == max(verified["serial_orders"], default=0)
    # The proof compares with the recording; the recording itself must be the model.
    fresh = torch.randn_like(x)
    with torch.no_grad():
        want = model(fresh)
    tolerance = 2e-3 if dtype == "float32" else 2e-2
    torch.testing.assert_close(nm(fresh).float(), want.float(), rtol=tolerance, atol=tolerance)
    nm.close()
