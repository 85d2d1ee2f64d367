"""The debugging tools on the two widest zoo models (:data:`debug_zoo.WIDE`), each case minutes
long: a file of its own, which the GPU suite runs as a process per case."""
from __future__ import annotations

import pytest

from debug_zoo import WIDE, ZOO_DTYPES, check_tools_on_zoo_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name,dtype", [c for c in ZOO_DTYPES if c[0] in WIDE])
def test_on_the_widest_zoo_models_the_tools_trace_every_task_find_no_divergence_and_name_a_nan(
        name, dtype):
    """:func:`debug_zoo.check_tools_on_zoo_model` on nasnetalarge (fp16) and pnasnet5large
    (fp32)."""
    check_tools_on_zoo_model(name, dtype)
