"""Under the sanitizer: the built-in model (batch 1) under ``torch.compile`` (default mode),
warmed up, then prepared with Nimble on the compiled model's kernels and called 5 times."""
from __future__ import annotations

import common


def main() -> None:
    args = common.parse(__doc__)
    import torch

    from nimble.cli import models

    model = models.create(models.BUILTIN).cuda()
    x = models.example_input(models.BUILTIN, 1)
    compiled = torch.compile(model)
    with torch.no_grad():
        for _ in range(3):
            compiled(x)
    common.prepare_and_call(compiled, x, args, f"torch.compile'd {models.BUILTIN}")


if __name__ == "__main__":
    main()
