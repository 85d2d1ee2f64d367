"""Under the sanitizer: one training step of resnet50 at CIFAR-10 shape (batch 8, 3x32x32, 10
classes) through ``Nimble.prepare(training=True)``: forward, loss, backward, SGD step."""
from __future__ import annotations

import common


def main() -> None:
    args = common.parse(__doc__)
    import nimble
    from nimble.cli import train_bench

    model, x, y = train_bench.setup("resnet50", 8)
    nm = nimble.Nimble(model).prepare(x, training=True, options=common.short_options(args))
    train_bench.training_step(nm, model, x, y)()
    common.finish(f"resnet50 training step, batch 8 at 32x32, {nm.launch_mode}")
    nm.close()


if __name__ == "__main__":
    main()
