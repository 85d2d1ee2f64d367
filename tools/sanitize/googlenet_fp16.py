"""Under the sanitizer: prepare googlenet in float16 (batch 1) with Nimble, then 5 calls."""
from __future__ import annotations

import common


def main() -> None:
    args = common.parse(__doc__)
    import torch

    import nimble
    from nimble.cli import models

    model = models.create("googlenet").cuda().half()
    x = models.example_input("googlenet", 1).half()
    nm = nimble.Nimble(model).prepare(x, options=common.short_options(args))
    for _ in range(5):
        nm(torch.randn_like(x))
    common.finish(f"googlenet float16, {nm.launch_mode}: prepare and 5 calls")
    nm.close()


if __name__ == "__main__":
    main()
