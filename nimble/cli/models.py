"""Models Nimble is measured on: a built-in one (no downloads, no extra packages) and the zoo.

``branchy`` is Nimble's own inception-style network: stages that fork into parallel branches of
small convolutions and join again, the shape where multi-stream execution pays.  The zoo models come
from torchvision and timm (the ``zoo`` extra) with random weights, so nothing is downloaded.
"""
from __future__ import annotations

from typing import Callable

BUILTIN = "branchy"
CHAINS = "gemm_chains"
ZOO = ("resnet50", "inception_v3", "googlenet", "mobilenet_v2", "efficientnet_b0",
       "nasnetalarge", "pnasnet5large")


def _branchy():
    import torch
    from torch import nn

    def conv(cin: int, cout: int, k: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(cin, cout, k, padding=k // 2, bias=False),
                             nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

    class Stage(nn.Module):
        """Four branches (1x1; 1x1-3x3; 1x1-3x3-3x3; pool-1x1) concatenated."""

        def __init__(self, cin: int, width: int) -> None:
            super().__init__()
            self.b1 = conv(cin, width, 1)
            self.b2 = nn.Sequential(conv(cin, width, 1), conv(width, width, 3))
            self.b3 = nn.Sequential(conv(cin, width, 1), conv(width, width, 3),
                                    conv(width, width, 3))
            self.b4 = nn.Sequential(nn.AvgPool2d(3, 1, 1), conv(cin, width, 1))

        def forward(self, x):
            return torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], 1)

    class Branchy(nn.Module):
        def __init__(self, stages: int = 6, width: int = 32, classes: int = 1000) -> None:
            super().__init__()
            self.stem = nn.Sequential(conv(3, 64, 3), nn.MaxPool2d(2))
            blocks, cin = [], 64
            for i in range(stages):
                blocks.append(Stage(cin, width))
                cin = 4 * width
                if i % 2 == 1:
                    blocks.append(nn.MaxPool2d(2))
            self.blocks = nn.Sequential(*blocks)
            self.head = nn.Linear(cin, classes)

        def forward(self, x):
            x = self.blocks(self.stem(x))
            return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))

    return Branchy()


def _gemm_chains(chains: int = 8, depth: int = 12, width: int = 512):
    """``chains`` independent stacks of ``depth`` Linear+ReLU on one input, summed at the end."""
    import torch
    from torch import nn

    class GemmChains(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.chains = nn.ModuleList(
                nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width),
                                                                   nn.ReLU())])
                for _ in range(chains))

        def forward(self, x):
            return torch.stack([c(x) for c in self.chains]).sum(0)

    return GemmChains()


def input_size(name: str) -> int:
    """The image side a model is usually run at."""
    return {"inception_v3": 299, "nasnetalarge": 331, "pnasnet5large": 331,
            BUILTIN: 64}.get(name, 224)


def package_of(name: str) -> str | None:
    """The package a model needs beyond torch (``torchvision`` or ``timm``), None for built-ins.

    Raises ``ValueError`` for an unknown name.
    """
    if name in (BUILTIN, CHAINS):
        return None
    if name not in ZOO:
        raise ValueError(f"unknown model {name!r}: choose {BUILTIN}, {CHAINS} or one of "
                         f"{', '.join(ZOO)}")
    return "timm" if name in ("nasnetalarge", "pnasnet5large") else "torchvision"


def create(name: str, num_classes: int | None = None):
    """A freshly initialised model by name (``branchy``, ``gemm_chains`` or a zoo name), in eval mode, on the CPU.

    ``num_classes`` gives a zoo model another classifier size (10 for CIFAR-10 training).
    Raises ``ValueError`` for an unknown name and ``ImportError`` (saying which extra to install)
    when the zoo packages are missing.
    """
    factories: dict[str, Callable] = {BUILTIN: _branchy, CHAINS: _gemm_chains}
    package = package_of(name)
    if package is None:
        return factories[name]().eval()
    try:
        module = __import__(package)
    except ImportError as e:
        raise ImportError(f"{name} needs {package}: python -m pip install 'nimble-gpu[zoo]'") from e
    extra = {} if num_classes is None else {"num_classes": num_classes}
    if package == "timm":
        return module.create_model(name, pretrained=False, **extra).eval()
    kwargs = {"weights": None, **extra}
    if name in ("inception_v3", "googlenet"):
        kwargs.update(aux_logits=False, init_weights=False)
    return getattr(module.models, name)(**kwargs).eval()


def example_input(name: str, batch: int = 1, device: str = "cuda", side: int | None = None):
    """A random image batch of the size ``name`` expects (or ``side`` × ``side``)."""
    import torch

    if name == CHAINS:
        return torch.randn(batch, 512, device=device)
    side = side or input_size(name)
    return torch.randn(batch, 3, side, side, device=device)
