"""Under the sanitizer, without Nimble: googlenet in float16 (batch 1), 5 eager forwards, then a
``torch.cuda.graph`` of it captured and replayed 5 times: the baseline that tells a report of
torch's or cuDNN's kernels (present here too) from one of Nimble's."""
from __future__ import annotations

import common


def main() -> None:
    common.parse(__doc__)
    import torch

    from nimble.cli import models
    from nimble.driver.gpu import use_cudnn_benchmark

    use_cudnn_benchmark()
    model = models.create("googlenet").cuda().half().eval()
    x = models.example_input("googlenet", 1).cuda().half()
    with torch.no_grad():
        for _ in range(5):
            model(torch.randn_like(x))
        torch.cuda.synchronize()
        graph, static = torch.cuda.CUDAGraph(), x.clone()
        with torch.cuda.graph(graph):
            model(static)
        for _ in range(5):
            static.copy_(torch.randn_like(x))
            graph.replay()
    common.finish("googlenet float16 without Nimble: 5 eager forwards, 5 torch.cuda.graph replays")


if __name__ == "__main__":
    main()
