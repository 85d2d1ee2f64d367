"""Debug aid: compare the recorded-order rebuild of a model with torch's own graph replay.

    python3 tools/replay_check.py [MODEL ...]

Per model: whether torch's replay is bitwise repeatable, whether the rebuilt chain equals it,
the largest difference, and whether the captured graph's edges all run forward in task order.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def check(name: str) -> dict:
    import torch

    from nimble import driver

    from nimble.cli import models
    from nimble.driver.gpu import use_cudnn_benchmark
    from nimble.engine.build import GraphSpec, build_graph, chain_edges
    from nimble.record.recorder import record
    from nimble.engine.proof import random_like, same_bits

    use_cudnn_benchmark()
    model = models.create(name).cuda()
    with torch.no_grad():
        rec = record(model, models.example_input(name), name=name)
    g = rec.graph
    index = {int(n): i for i, n in enumerate(rec.nodes)}
    cu = driver.borrowed_graph(rec.torch_graph.raw_cuda_graph())
    count = int(driver.call("cuGraphGetEdges", cu, 0)[3])
    frm, to = driver.call("cuGraphGetEdges", cu, count)[:2]
    backward = sum(1 for a, b in zip(frm, to) if index[int(a)] >= index[int(b)])
    built = build_graph(g, rec.nodes, [b.address for b in g.buffers],
                        GraphSpec(chain_edges(len(g.tasks))))
    stream = driver.stream(torch.cuda.current_stream().cuda_stream)
    xs = [random_like(x) for x in rec.static_inputs]
    a = rec.replay_reference(xs)
    b = rec.replay_reference(xs)
    built.launch(stream)
    c = [o.clone() for o in rec.static_outputs]
    d = rec.replay_reference(xs)
    e = rec.replay_reference([random_like(x) for x in xs])
    for o in rec.static_outputs:
        o.fill_(float("nan"))
    built.launch(stream)
    f = [o.clone() for o in rec.static_outputs]
    result = {
        "captured_edges": count, "backward_edges": backward,
        "torch_repeatable": all(map(same_bits, a, b)),
        "input_dependent": not all(map(same_bits, a, e)),
        "nan_filled_output_rewritten": all(map(same_bits, f, e)),
        "rebuilt_equals_torch": all(map(same_bits, c, a)),
        "max_diff": max(float((x - y).abs().max()) for x, y in zip(c, a)),
        "torch_after_rebuilt_equals_torch": all(map(same_bits, d, a))}
    print(f"{name}: {result}", flush=True)
    built.close()
    return result


if __name__ == "__main__":
    for m in sys.argv[1:] or ["inception_v3"]:
        check(m)
