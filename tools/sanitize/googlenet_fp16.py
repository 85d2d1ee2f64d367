"""Under the sanitizer: prepare googlenet in float16 (batch 1) with Nimble, then 5 calls."""
from __future__ import annotations

import common


def main() -> None:
    args = common.parse(__doc__)
    from nimble.cli import models

    model = models.create("googlenet").cuda().half()
    common.prepare_and_call(model, models.example_input("googlenet", 1).half(), args,
                            "googlenet float16")


if __name__ == "__main__":
    main()
