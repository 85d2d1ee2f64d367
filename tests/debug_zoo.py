"""The debugging tools' check on one zoo model, shared by tests/test_gpu_debug_tools.py and
tests/test_gpu_debug_tools_wide.py (the two widest models apart, so that the GPU suite can give
each of their long cases a process of its own: tools/gpu_suite.py's ``SPLIT``)."""
from __future__ import annotations

from helpers import zoo_model
from nimble.cli.models import ZOO

#: Each zoo model in one dtype, the two taking turns down the zoo (fp32 and fp16 each on three
#: or four models, nasnetalarge in fp16: the rounding of its 1,000+ ops is the hard case, and
#: pnasnet5large in fp32, where its "same" pools pad with -inf).  The tools' code is the same
#: in every dtype, only the tolerance differs.
ZOO_DTYPES = [(name, ("float32", "float16")[k % 2]) for k, name in enumerate(ZOO)]

#: The widest zoo models: each one's case takes minutes (on four busy H200s, 2026-11-27, each
#: was still running after five minutes in a process it shared with smaller cases).
WIDE = ("nasnetalarge", "pnasnet5large")


def check_tools_on_zoo_model(name: str, dtype: str) -> None:
    """A trace in two stamp groups times every task; the compare against eager finds no op
    beyond the dtype's tolerance (the -inf that NASNet's and PNASNet's "same" pools pad with
    included); a NaN put into a convolution weight in the middle of the network is traced to
    the first op that reads that weight."""
    import torch

    import nimble

    model, x = zoo_model(name)
    model, x = model.to(getattr(torch, dtype)), x.to(getattr(torch, dtype))
    nm = nimble.Nimble(model).prepare(x, options=nimble.PrepareOptions(relaunches=4))
    n = len(nm.graph.tasks)
    timeline = nm.trace(x, start_stamps=False, groups=2)
    assert len(timeline.times) == n and all(0.0 <= a <= b for a, b in timeline.times)
    assert sum(end > 0.0 for _, end in timeline.times) >= n - len(nm.schedule.streams)
    assert timeline.instrumented_us > 0 and timeline.plain_us > 0
    # each op that drifts from the eager chain is judged again from the graph's own inputs, so
    # rounding that builds up over 1,000+ fp16 ops (nasnetalarge) is no divergence
    assert nm.first_divergence(x, quiet=True) is None
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    victim = convs[len(convs) // 2].weight
    g = nm.graph
    [buffer] = [b for b in g.buffers if b.kind == "param" and b.address == victim.data_ptr()]
    reader = min(t.op for t in g.tasks if any(a.buffer == buffer.id for a in t.accesses))
    with torch.no_grad():
        victim[0, 0, 0, 0] = float("nan")
    found = nm.first_divergence(x, nonfinite=True, quiet=True)
    assert found is not None and found.op == reader, found
    assert "NaN" in found.detail
    nm.close()
