"""Each folded GEMV's launch measured on its own kernel (issue 53).

A GEMV whose prologue :mod:`nimble.gemv_prologue_pass` folds in carries the configuration
:func:`nimble.fast_gemv.fast_gemv` measured for the *plain* GEMV of its weight's shape.  The
folded kernel is another kernel: it walks its row blocks grid-stride (at most
``PROGRAMS_PER_SM`` programs a multiprocessor), reads its input through the prologue at every
step, and asks for tiles ahead; what suits the plain kernel need not suit it.  :func:`choose`
times the folded kernel itself, in the launch it carries and in each of :data:`CANDIDATES`
(rows and columns of a tile, warps, programs a multiprocessor, tiles asked ahead), on random
tensors of its shape in a CUDA graph whose weights pass twice the L2 (as a decode step reads
them, :func:`nimble.fast_gemv.replay_us`), and keeps the fastest.  Only the launch changes:
the kernel's order of sums follows its tile, so another tile gives other bits than the
untuned fold, and Nimble proves the step's graph as it proves any.

The pass asks for it where :func:`~nimble.gemv_prologue_pass.fusing` is given
``tune_launches=True`` (``nimble.fast_decoding.fast_generator`` does); what was chosen per
shape stays for the process (:func:`chosen`), so the steps of several batch sizes or a second
model of the same shapes time nothing again.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from . import gemv_prologues as gp
from .fast_gemv import GemvConfig, copies_past_l2, replay_us

log = logging.getLogger("nimble")

PROLOGUE_NAMES = {gp.RMSNORM: "rmsnorm", gp.ADD_RMSNORM: "add_rmsnorm",
                  gp.SILU_GATED: "silu_gated", gp.LAYERNORM: "layernorm",
                  gp.ADD_LAYERNORM: "add_layernorm", gp.GELU_TANH: "gelu_tanh",
                  gp.GELU_ERF: "gelu_erf"}


@dataclass(frozen=True)
class PrologueShape:
    """One folded GEMV as the pass sees it: what its prologue computes, its weight's shape,
    dtype and device."""

    prologue: int
    out_features: int
    in_features: int
    dtype: torch.dtype
    device: torch.device

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (f"{self.out_features}x{self.in_features} {dtype} "
                f"{PROLOGUE_NAMES.get(self.prologue, self.prologue)}")


@dataclass(frozen=True)
class PrologueLaunch:
    """How the folded kernel is launched: its tile configuration, programs a multiprocessor
    at most, weight tiles asked for ahead."""

    config: GemvConfig
    per_sm: int
    ahead: int

    def describe(self) -> str:
        c = self.config
        return (f"{c.block_n}/{c.block_k}/{c.warps}w/{c.stages}s, {self.per_sm} a "
                f"multiprocessor, {self.ahead} ahead")


@dataclass(frozen=True)
class Candidate:
    """A launch to time: ``config`` None is the configuration the GEMV carries."""

    config: Optional[GemvConfig]
    per_sm: int
    ahead: int

    def launch(self, carried: GemvConfig) -> PrologueLaunch:
        return PrologueLaunch(self.config or carried, self.per_sm, self.ahead)


#: The launches timed beside the carried one: the carried tile with more or fewer programs
#: and two tiles ahead, and wider tiles with more warps (more bytes in flight a
#: multiprocessor, which a streaming kernel needs to cover the DRAM's latency).
CANDIDATES = (
    Candidate(None, 2, 1), Candidate(None, 8, 1), Candidate(None, 4, 2), Candidate(None, 8, 2),
    Candidate(GemvConfig(4, 1024, 8, 1), 4, 1), Candidate(GemvConfig(4, 1024, 8, 1), 8, 1),
    Candidate(GemvConfig(8, 1024, 8, 1), 4, 1), Candidate(GemvConfig(8, 1024, 8, 1), 2, 2),
    Candidate(GemvConfig(8, 2048, 16, 1), 2, 1), Candidate(GemvConfig(16, 1024, 16, 1), 2, 1),
    Candidate(GemvConfig(8, 512, 4, 1), 8, 1), Candidate(GemvConfig(8, 512, 4, 1), 8, 2),
)


@dataclass(frozen=True)
class LaunchChoice:
    """What :func:`choose` measured for one folded GEMV, and what it chose."""

    shape: PrologueShape
    carried: PrologueLaunch
    carried_us: float
    launch: PrologueLaunch
    us: float
    timed: int

    def describe(self) -> str:
        return (f"{self.shape.describe()}: carried {self.carried.describe()} "
                f"{self.carried_us:.2f} µs -> {self.launch.describe()} {self.us:.2f} µs "
                f"({self.timed} timed)")


#: ``time(shape, launch) -> µs per call``: how a launch is timed (:func:`graph_timer`; a
#: stand-in in the tests).
Timer = Callable[[PrologueShape, PrologueLaunch], float]

_CHOSEN: dict[tuple, LaunchChoice] = {}


def choose(shape: PrologueShape, carried: GemvConfig, time: Timer | None = None,
           candidates: Iterable[Candidate] = CANDIDATES) -> LaunchChoice:
    """The fastest launch of the folded GEMV ``shape`` that carries ``carried``, timed once a
    process (the carried launch first: it stays where nothing is faster)."""
    base = PrologueLaunch(carried, gp.PROGRAMS_PER_SM, gp.TILES_AHEAD)
    key = (shape, base)  # the module's defaults are part of the launch carried
    if key in _CHOSEN:
        return _CHOSEN[key]
    launches = list(dict.fromkeys([base] + [c.launch(carried) for c in candidates]))
    timer = time or graph_timer
    timed = [(timer(shape, launch), launch) for launch in launches]
    us, best = min(timed, key=lambda t: t[0])  # the first of equals: the carried launch
    choice = LaunchChoice(shape, base, timed[0][0], best, us, len(timed))
    _CHOSEN[key] = choice
    log.info("gemv prologue launch: %s", choice.describe())
    return choice


def chosen() -> list[LaunchChoice]:
    """Every choice made in this process, in the order made."""
    return list(_CHOSEN.values())


def forget() -> None:
    """Drop every choice: the next :func:`choose` times again."""
    _CHOSEN.clear()


def graph_timer(shape: PrologueShape, launch: PrologueLaunch, replays: int = 5) -> float:
    """µs per call of the folded GEMV ``shape`` launched as ``launch``, on random tensors of
    its shape (its weight copied past twice the L2), in a CUDA graph."""
    with _real_tensors():
        n, k, dt, device = shape.out_features, shape.in_features, shape.dtype, shape.device
        g = torch.Generator(device=device).manual_seed(0)
        weight = torch.randn(n, k, device=device, dtype=dt, generator=g) / k ** 0.5
        size = weight.numel() * weight.element_size()
        rotation = [weight] + [weight.clone() for _ in range(copies_past_l2(size, device) - 1)]
        a, b = (torch.randn(k, device=device, dtype=dt, generator=g) for _ in range(2))
        norm_weight = torch.ones(k, device=device, dtype=dt)
        second = b if gp.second_input(shape.prologue) else None
        norm = norm_weight if shape.prologue in gp.NORMS else None
        # the biases a GPT-2's folds read (a layer norm's, the projection's before it): a
        # vector more from the L2, timed as the step reads it
        bias = b if shape.prologue in gp.BIASED and shape.prologue != gp.ADD_RMSNORM else None
        norm_bias = b if shape.prologue in (gp.LAYERNORM, gp.ADD_LAYERNORM) else None

        def call(w):
            return gp.launch(shape.prologue, a, second, norm, 1e-6, w, launch.config,
                             ahead=launch.ahead, per_sm=launch.per_sm, bias=bias,
                             norm_bias=norm_bias)
        return replay_us(call, rotation, device, replays)


@contextlib.contextmanager
def _real_tensors():
    """Inside Inductor's graph pass the tensors made are fake unless its fake mode is set
    aside; elsewhere a no-op."""
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except ImportError:  # pragma: no cover - every torch Nimble supports has it
        yield
        return
    with unset_fake_temporarily(), torch.no_grad():
        yield


def tunable(device: torch.device) -> str | None:
    """Why a folded GEMV on ``device`` cannot be timed now, or None: no CUDA device, or a CUDA
    graph being captured on this thread (a compilation inside a capture keeps what it
    carries)."""
    if device.type != "cuda":
        return f"its weight is on {device}, not a CUDA device"
    if torch.cuda.is_current_stream_capturing():
        return "a CUDA graph is being captured"
    return None
