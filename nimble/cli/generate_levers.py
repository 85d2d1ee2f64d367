"""The Nimble rows of ``nimble bench --generate``: the levers a user may ask for (weight prefetch
into the L2, programmatic launch, Inductor's compile mode or tuning, the attention kernels, the
sibling projections fused) and the generators prepared with them."""
from __future__ import annotations

import argparse
import contextlib

from ..analysis.prefetch import PLANS
from ..generate import INDUCTOR_MODES
from .common import one_line


def add_lever_arguments(p) -> None:
    """The ``--generate`` options that choose how the Nimble rows are prepared."""
    p.add_argument("--prefetch-l2", nargs="?", const=True, default=False,
                   choices=(True, *PLANS), metavar="PLAN",
                   help="--generate: prepare the Nimble steps with PrepareOptions(prefetch_l2="
                        "True): weight prefetch into the L2, kept where measured faster; "
                        f"a plan ({', '.join(PLANS)}) times that one alone")
    p.add_argument("--programmatic", action=argparse.BooleanOptionalAction, default=None,
                   help="--generate: the Nimble steps' edges into Nimble's own kernels (GEMVs, "
                        "decode attention) programmatic, kept where measured faster "
                        "(PrepareOptions(programmatic_launch=True), the default); "
                        "--no-programmatic: full dependencies")
    p.add_argument("--inductor-mode", choices=INDUCTOR_MODES, default=None,
                   help="--generate: torch.compile's mode for nimble+inductor's kernels "
                        "(default: Inductor's default; max-autotune-no-cudagraphs tunes them "
                        "at prepare)")
    p.add_argument("--coordinate-descent", action="store_true",
                   help="--generate: nimble+inductor's kernels, and every row that compiles "
                        "(the baseline too, as gpt-fast's recipe has it), compiled with "
                        "Inductor's coordinate_descent_tuning, under which a single-row GEMM "
                        "is a reduction fused with its neighbours (not with --inductor-mode)")
    p.add_argument("--combo-kernels", action="store_true",
                   help="--generate: nimble+inductor's kernels, and every row that compiles, "
                        "compiled with Inductor's "
                        "combo_kernels, independent small kernels (the key and value cache "
                        "updates, each half of the rotary embedding) one launch each (not with "
                        "--inductor-mode)")
    p.add_argument("--fuse-projections", action="store_true",
                   help="--generate: every row (the baseline's and the reference tokens too) "
                        "on the model with its sibling projections (query/key/value, gate/up) "
                        "one GEMM each (nimble.fused_projections), as gpt-fast's model has "
                        "them")
    p.add_argument("--fast-gemv", action="store_true",
                   help="--generate: every row on the model whose single-row GEMMs run a Triton "
                        "GEMV where fast_gemv measured it faster than torch's, per weight shape "
                        "(nimble.fast_gemv; after --fuse-projections)")
    p.add_argument("--gemv-prologues", action="store_true",
                   help="--generate: every row that compiles (the baseline too) compiled with "
                        "nimble.gemv_prologue_pass, under which a GEMV fed by an RMS norm or a "
                        "gated activation computes that vector itself, one kernel fewer each "
                        "(with --fast-gemv, whose GEMVs it folds into, each kept within 10%% "
                        "of torch's GEMM: nimble.fast_gemv.PROLOGUE_MARGIN)")
    p.add_argument("--all-levers", action="store_true",
                   help="--generate: every decode lever that measured faster on the 1B Llama "
                        "shape, as nimble.fast_decoding.fast_generator applies them: "
                        "--fuse-projections --fast-gemv --gemv-prologues --tune-prologues "
                        "--decode-attention --rope-attention --coordinate-descent "
                        "--combo-kernels")
    p.add_argument("--tune-prologues", action="store_true",
                   help="--generate: with --gemv-prologues, each folded GEMV launched as timed "
                        "fastest on its own kernel (nimble.gemv_prologue_tuning)")
    p.add_argument("--rope-attention", action="store_true",
                   help="--generate: with --decode-attention, every row that compiles compiled "
                        "with nimble.gemv_prologue_pass folding each layer's rotary embedding "
                        "and cache read into the attention kernel too (the folds of "
                        "--gemv-prologues included)")
    p.add_argument("--decode-attention", action="store_true",
                   help="--generate: every row on the model whose single-query attention runs "
                        "nimble::decode_attention, one kernel over the cache's key-value heads "
                        "(nimble.decode_attention; prefills stay on sdpa)")
    p.add_argument("--sdpa-backends", type=parse_sdpa_backends, default=None, metavar="B,B",
                   help="--generate: the attention kernels the Nimble steps are prepared with "
                        "(torch.nn.attention.sdpa_kernel: flash, efficient, cudnn, math; "
                        "default: torch's choice)")


#: ``--sdpa-backends`` names and torch's scaled-dot-product attention backends.
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "cudnn": "CUDNN_ATTENTION", "math": "MATH"}


def parse_sdpa_backends(text: str) -> list[str]:
    """``--sdpa-backends``: names of :data:`SDPA_BACKENDS`, comma-separated."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SDPA_BACKENDS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"{', '.join(unknown) or repr(text)}: not attention backends (choose from "
            f"{', '.join(SDPA_BACKENDS)})")
    return names


def attention_backends(names: list[str] | None):
    """The context the Nimble steps are prepared in: ``sdpa_kernel`` of ``names``, or none."""
    if not names:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[n]) for n in names])


def cache_length(args) -> int:
    """Every static cache's length: the longest prompt and the new tokens."""
    return max(args.prompt_lengths) + args.new_tokens


def nimble_generators(model, args, batch: int) -> dict:
    """The two Nimble generators by mode, or the one-line error that stopped one; with
    ``--prefetch-l2``, each step prepared with ``PrepareOptions(prefetch_l2=True)`` (kept
    where it measures faster), with ``--no-programmatic`` with ``programmatic_launch=False``;
    ``--inductor-mode``, ``--coordinate-descent`` and ``--combo-kernels`` choose how
    nimble+inductor's kernels are compiled."""
    from ..engine.options import PrepareOptions
    from ..generate import Generator, prepare_with_nimble

    asked = {"prefetch_l2": getattr(args, "prefetch_l2", False)}
    if getattr(args, "programmatic", None) is not None:  # else PrepareOptions' default
        asked["programmatic_launch"] = args.programmatic
    options = PrepareOptions(**asked) if asked != {"prefetch_l2": False} else None
    tuned = inductor_settings(args)
    inductor = {"compile_mode": getattr(args, "inductor_mode", None),
                "compile_options": tuned or None}
    made: dict = {}
    for mode, compiled in (("nimble", False), ("nimble+inductor", True)):
        try:
            with attention_backends(getattr(args, "sdpa_backends", None)):
                made[mode] = Generator(model, cache_length(args), args.prompt_lengths, [batch],
                                       prepare_step=prepare_with_nimble(
                                           options, compiled, **(inductor if compiled else {})))
        except Exception as e:  # noqa: BLE001 - the other modes still run
            made[mode] = one_line(e)
    return made


def inductor_settings(args) -> dict:
    """The Inductor settings ``--coordinate-descent``, ``--combo-kernels`` and
    ``--gemv-prologues`` ask for."""
    settings = {key: True for key, flag in (("coordinate_descent_tuning", "coordinate_descent"),
                                            ("combo_kernels", "combo_kernels"))
                if getattr(args, flag, False)}
    if folds_asked(args):
        from ..gemv_prologue_pass import make_pass

        settings["post_grad_custom_post_pass"] = make_pass(
            rope_attention=bool(getattr(args, "rope_attention", False)),
            tune_launches=bool(getattr(args, "tune_prologues", False)))
    return settings


def folds_asked(args) -> bool:
    """Whether the rows compile with the fold pass: ``--gemv-prologues`` or
    ``--rope-attention``."""
    return bool(getattr(args, "gemv_prologues", False) or getattr(args, "rope_attention", False))


#: The flags ``--all-levers`` sets: :func:`nimble.fast_decoding.fast_generator`'s levers.
ALL_LEVERS = ("fuse_projections", "fast_gemv", "gemv_prologues", "tune_prologues",
              "decode_attention", "rope_attention", "coordinate_descent", "combo_kernels")


def check_lever_arguments(args) -> None:
    """``--all-levers`` made the flags it stands for; the lever flags that need another
    refused, before any lever changes the model."""
    from ..errors import InputError

    if getattr(args, "all_levers", False):
        for flag in ALL_LEVERS:
            setattr(args, flag, True)
    if getattr(args, "gemv_prologues", False) and not getattr(args, "fast_gemv", False):
        raise InputError("--gemv-prologues folds norms and activations into the GEMVs "
                         "--fast-gemv gives a model: add --fast-gemv")
    if getattr(args, "tune_prologues", False) and not getattr(args, "gemv_prologues", False):
        raise InputError("--tune-prologues times the launches of the GEMVs --gemv-prologues "
                         "folds: add --gemv-prologues (and --fast-gemv)")
    if getattr(args, "rope_attention", False) and not getattr(args, "decode_attention", False):
        raise InputError("--rope-attention folds the rotary embedding into the attention "
                         "kernel of --decode-attention: add --decode-attention")


def compiled_under(run, args):
    """``run`` (a row that compiles with Inductor on its first calls: the compiled loop,
    ``generate()``'s compiled forward) compiling under the Inductor settings the Nimble rows
    are compiled with: a setting of Inductor's is every row's lever, as the coordinate-descent
    tuning is in gpt-fast's own recipe."""
    settings = inductor_settings(args)
    if not settings:
        return run
    import torch._inductor.config as inductor_config

    def compiled(*a, **k):
        with inductor_config.patch(**settings):
            return run(*a, **k)
    return compiled


def fuse_if_asked(model, args, info: dict) -> None:
    """With ``--fuse-projections``, ``model``'s sibling projections fused in place, before any
    row runs (their count in ``info["fused_projections"]``): a fused model is a lever every way
    of running it gets (gpt-fast's model fuses its query, key and value projections), so the
    baseline gets it too."""
    if not getattr(args, "fuse_projections", False):
        return
    from ..fused_projections import fuse_projections

    info["fused_projections"] = fuse_projections(model)


def gemv_if_asked(model, args, info: dict, batch: int = 1) -> None:
    """With ``--fast-gemv``, ``model``'s GEMMs of a decode step at ``batch`` given the GEMV
    (batch 1) or :mod:`nimble.gemm_rows` (a few rows) where it measured faster (after any
    fusion, whose groups it reaches), before any row runs: what was measured per weight shape
    in ``info["fast_gemv"]``.  With the folds (:func:`folds_asked`), a GEMV
    is kept within :data:`~nimble.fast_gemv.PROLOGUE_MARGIN` of torch's GEMM, as the folds pay
    for it."""
    if not getattr(args, "fast_gemv", False):
        return
    from ..fast_gemv import decode_rows, fast_gemv, margin_for

    info["fast_gemv"] = [choice.describe() for choice in
                         fast_gemv(model, margin=margin_for(folds_asked(args)),
                                   rows=decode_rows([batch]))]


def attention_if_asked(model, args, info: dict) -> None:
    """With ``--decode-attention``, ``model``'s single-query attention on
    ``nimble::decode_attention`` before any row runs (the reference tokens too, as with the
    other model-level levers); ``info["decode_attention"]`` says so."""
    if not getattr(args, "decode_attention", False):
        return
    from ..decode_attention import decode_attention

    decode_attention(model)
    info["decode_attention"] = True
