"""Nimble's kernels behind programmatic edges (issue 53), in the PTX Triton writes for sm_90 on
a machine without a GPU: every kernel a prepare may launch behind a programmatic edge
(nimble.ir.waiting_kernels.WAITING_KERNELS) waits for its predecessor in every program
before it reads anything but its weight, and writes nothing before the wait; compiled without
the wait (Triton's interpreter), no such instruction."""
from __future__ import annotations

import pytest

from nimble.kernel_waits import waits

triton = pytest.importorskip("triton", reason="compiles with Triton")


def _ptx(fn, signature: dict, constexprs: dict, **options) -> list[str]:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                            target=GPUTarget("cuda", 90, 32), options=options)
    return kernel.asm["ptx"].splitlines()


def _before_the_wait(lines: list[str]) -> list[str]:
    """The instructions before the kernel's one ``griddepcontrol.wait``."""
    at = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
    assert len(at) == 1, at
    return lines[:at[0]]


def _memory(lines: list[str], kind: str) -> list[str]:
    return [line for line in lines if kind in line]


def _gemv(waits_: bool, early: int = 1, late: bool = False) -> list[str]:
    from nimble import fast_gemv

    return _ptx(fast_gemv._kernel(), {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16",
                                      "N": "i32", "K": "i32", "stride_w": "i32"},
                {"BLOCK_N": 4, "BLOCK_K": 1024, "WAITS": waits_, "EARLY": early, "LATE": late},
                num_warps=8)


def _prologue(prologue: int, late: bool = False, ahead: int = 1) -> list[str]:
    import nimble.gemv_prologue_kernels as kernels

    pointers = {name: "*bf16" for name in ("a_ptr", "b_ptr", "nw_ptr", "w_ptr", "y_ptr",
                                           "sum_ptr", "c_ptr", "nb_ptr")}
    return _ptx(kernels.gemv_prologue_kernel,
                {**pointers, "N": "i32", "K": "i32", "stride_w": "i32", "eps": "fp32"},
                {"PROLOGUE": prologue, "BLOCK_N": 4, "BLOCK_K": 1024, "NORM_BLOCK": 2048,
                 "WAITS": True, "LATE": late, "AHEAD": ahead, "HAS_C": prologue in (4, 5),
                 "HAS_NB": prologue == 4, "ONE_BLOCK": prologue == 4}, num_warps=8)


def _attention(kernel: str, cache_early: bool = False) -> list[str]:
    import nimble.decode_attention_kernels as kernels

    if kernel == "join":
        return _ptx(kernels.join, {"part_ptr": "*fp32", "stat_ptr": "*fp32", "out_ptr": "*bf16",
                                   "groups": "i32", "kv_heads": "i32", "splits": "i32",
                                   "sob": "i32", "soh": "i32"},
                    {"HEAD_DIM": 64, "BLOCK_D": 64, "BLOCK_R": 16, "WAITS": True})
    ints = ("slots", "groups", "kv_heads", "splits", "slots_per_split", "sqb", "sqh", "skb",
            "skh", "skl", "svb", "svh", "svl", "smb", "smh", "sml", "sob", "soh")
    rope_ints = ("scb", "ssb", "sknb", "sknh", "svnb", "svnh")
    signature = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "mask_ptr": "*i1",
                 "out_ptr": "*fp32", "part_ptr": "*fp32", "stat_ptr": "*fp32",
                 "count_ptr": "*i32", "scale": "fp32", **{i: "i32" for i in ints},
                 "cos_ptr": "*bf16", "sin_ptr": "*bf16", "kn_ptr": "*bf16", "vn_ptr": "*bf16",
                 "pos_ptr": "*i64", **{i: "i32" for i in rope_ints}}
    whole = "whole" in kernel  # the whole cache as one tile, writing the output itself
    if whole:
        signature["out_ptr"] = "*bf16"
    return _ptx(kernels.attend, signature,
                {"HEAD_DIM": 64, "BLOCK_D": 64, "BLOCK_R": 16, "BLOCK_L": 256 if whole else 64,
                 "MASK": 1, "SPLIT": not whole, "IEEE": False, "BRANCHLESS": False,
                 "LAST_JOINS": not whole, "VALUES_EARLY": whole, "ROPE": "rope" in kernel,
                 "WAITS": True, "WHOLE": whole, "CACHE_EARLY": cache_early},
                num_warps=8 if whole else 4)


@pytest.mark.parametrize("kernel", ["gemv", "gemv early 2", "rmsnorm", "add_rmsnorm", "gated",
                                    "add_rmsnorm two ahead", "gated two ahead", "layernorm",
                                    "add_layernorm", "gelu_tanh", "gelu_erf"])
def test_a_gemv_asks_for_its_first_weight_tile_alone_before_its_wait(kernel):
    """Before the wait: the weight's loads (the only ones evicted first) and no other load,
    no store, no atomic; after it, the rest.  The dependents may launch from the start."""
    lines = _gemv(True, 2 if "early" in kernel else 1) if "gemv" in kernel else _prologue(
        {"rmsnorm": 0, "add_rmsnorm": 1, "gated": 2, "layernorm": 3, "add_layernorm": 4,
         "gelu_tanh": 5, "gelu_erf": 6}[kernel.split()[0]],
        ahead=2 if "two ahead" in kernel else 1)
    early = _before_the_wait(lines)
    loads = _memory(early, "ld.global")
    assert loads and all("evict_first" in line for line in loads)
    assert not _memory(early, "st.global") and not _memory(early, "atom.")
    assert _memory(lines[len(early):], "ld.global")
    assert _memory(early, "griddepcontrol.launch_dependents")


def _gemm_rows(block_n: int, partial: bool, late: bool = True, joins: bool = True,
               prologue: int = -1) -> list[str]:
    from nimble import gemm_rows

    return _ptx(gemm_rows._kernel(), {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16",
                                      "part_ptr": "*fp32", "count_ptr": "*i32", "b_ptr": "*bf16",
                                      "nw_ptr": "*bf16", "sum_ptr": "*bf16",
                                      "c_ptr": "*bf16", "nb_ptr": "*bf16", "M": "i32",
                                      "N": "i32", "K": "i32", "stride_w": "i32",
                                      "stride_x": "i32", "stride_b": "i32", "K_CHUNK": "i32",
                                      "eps": "fp32"},
                {"M_PAD": 16 if block_n >= 16 else 8, "BLOCK_N": block_n, "BLOCK_K": 128,
                 "PARTIAL": partial, "LAST_JOINS": partial and joins, "WAITS": True,
                 "LATE": late, "PROLOGUE": prologue, "NORM_BLOCK": 512,
                 "HAS_C": prologue in (4, 5), "HAS_NB": prologue == 4}, num_warps=4)


@pytest.mark.parametrize("kernel", ["tensor cores", "cuda cores", "split", "split early",
                                    "split, a second kernel adds", "rmsnorm", "add_rmsnorm",
                                    "gated", "add_layernorm", "gelu"])
def test_a_gemm_of_rows_asks_for_its_first_weight_tile_alone_before_its_wait(kernel):
    prologue = {"rmsnorm": 0, "add_rmsnorm": 1, "gated": 2, "add_layernorm": 4,
                "gelu": 5}.get(kernel, -1)
    lines = _gemm_rows(2 if kernel == "cuda cores" else 32, "split" in kernel,
                       late="early" not in kernel, joins="second" not in kernel,
                       prologue=prologue)
    early = _before_the_wait(lines)
    loads = _memory(early, "ld.global")
    assert loads and all("evict_first" in line for line in loads)
    assert not _memory(early, "st.global") and not _memory(early, "atom.")
    assert _memory(lines[len(early):], "ld.global")
    assert bool(_memory(early, "griddepcontrol.launch_dependents")) == ("early" in kernel)
    # the last program to count adds the parts: the count after the wait, with its release
    assert bool(_memory(lines, "atom.")) == (kernel in ("split", "split early"))


def test_the_split_gemm_of_rows_reduction_reads_and_writes_nothing_before_its_wait():
    from nimble import gemm_rows

    gemm_rows._kernel()
    lines = _ptx(gemm_rows._KERNEL[1], {"parts_ptr": "*fp32", "y_ptr": "*bf16", "MN": "i32"},
                 {"SPLITS": 4, "BLOCK": gemm_rows.REDUCE_BLOCK, "WAITS": True})
    early = _before_the_wait(lines)
    assert not [line for line in early if "ld.global" in line or "st.global" in line]
    assert len(_memory(lines[len(early):], "ld.global")) >= 4


def test_the_peer_sum_reads_only_its_table_before_its_wait():
    """Before the wait: only 8-byte loads (the ranks' buffers' addresses, from the table), no
    store, no flag; after it, the counter, the copy, the flags and the peers' reads."""
    from nimble import peer_sum

    lines = _ptx(peer_sum._kernel(), {"x_ptr": "*bf16", "out_ptr": "*bf16",
                                      "table_ptr": "*i64", "n": "i32", "rank": "i32",
                                      "slot_elements": "i32"},
                 {"RANKS": 2, "PROGRAMS": 16, "DATA_AT": 256, "BLOCK": 512,
                  "WAITS": True, "GATHER": False})
    early = _before_the_wait(lines)
    loads = [next(word for word in line.split() if word.startswith("ld.global"))
             for line in _memory(early, "ld.global")]
    assert loads and all(op.endswith(".b64") for op in loads), loads
    assert not _memory(early, "st.global") and not _memory(early, "atom.")
    after = lines[len(early):]
    assert _memory(after, "atom.global.sys.release") and _memory(after, "global.sys.acquire")


@pytest.mark.parametrize("kernel", ["attend", "rope attend", "whole rope attend", "join"])
def test_the_attentions_kernels_read_and_write_nothing_before_their_wait(kernel):
    lines = _attention(kernel)
    early = _before_the_wait(lines)
    assert not [line for line in early if "ld." in line and "param" not in line
                or "st.global" in line or "atom." in line]
    assert _memory(lines[len(early):], "ld.global")


def test_the_whole_cache_rotary_attention_asks_for_its_cache_alone_before_its_wait():
    """nimble.decode_attention.CACHE_BEFORE_WAIT: the same loads, the cache's moved before the
    wait, nothing written before it (the query, the new key and value, the rotation and the
    mask after)."""
    early, late = (_attention("whole rope attend", cache_early=c) for c in (True, False))
    before = _before_the_wait(early)
    loads = _memory(before, "ld.global")
    assert loads and not _memory(before, "st.global") and not _memory(before, "atom.")
    assert not _memory(_before_the_wait(late), "ld.global")
    assert len(_memory(early, "ld.global")) == len(_memory(late, "ld.global"))
    assert len(_memory(early[len(before):], "ld.global")) > 0


def test_a_prologue_gemv_two_tiles_ahead_asks_for_twice_the_weight_before_its_wait():
    def early_loads(ahead: int) -> int:
        return len(_memory(_before_the_wait(_prologue(2, ahead=ahead)), "ld.global"))
    assert early_loads(2) == 2 * early_loads(1) > 0


def test_two_early_tiles_are_twice_the_weight_loads_before_the_wait():
    def early_loads(early: int) -> int:
        return len(_memory(_before_the_wait(_gemv(True, early)), "ld.global"))
    assert early_loads(2) == 2 * early_loads(1) > 0


def test_without_the_wait_no_grid_dependency_instruction_is_written():
    assert not [line for line in _gemv(False) if "griddepcontrol" in line]


def test_the_kernels_wait_on_a_gpu_and_not_under_the_interpreter():
    import torch

    assert waits(torch.device("cuda", 0)) and not waits(torch.device("cpu"))


@pytest.mark.parametrize("kernel", ["gemv", "rms prologue", "gated prologue"])
def test_a_gemv_lets_the_next_kernel_launch_at_its_start_or_after_its_weight_is_read(kernel):
    """kernel_waits.LAUNCH_DEPENDENTS_LATE: the one launch_dependents before any load, or
    after the wait (the plain GEMV's after every load, before its store: the prologue GEMV's
    sits in its loop over row blocks, whose blocks PTX lays out in its own order); the wait
    and the loads before it as they were."""
    def compiled(late: bool) -> list[str]:
        return _gemv(True, late=late) if kernel == "gemv" else \
            _prologue(0 if kernel == "rms prologue" else 2, late=late)

    for late in (False, True):
        lines = compiled(late)
        at = [i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line]
        loads = [i for i, line in enumerate(lines) if "ld.global" in line]
        stores = [i for i, line in enumerate(lines) if "st.global" in line]
        assert len(at) == 1 and loads and stores, (late, at)
        if late and kernel == "gemv":
            assert max(loads) < at[0] < max(stores), (at, loads[-3:], stores)
        elif late:
            assert at[0] > len(_before_the_wait(lines)), at
        else:
            assert at[0] < min(loads), (at, loads[:3])
    assert len(_memory(_before_the_wait(compiled(True)), "ld.global")) == \
        len(_memory(_before_the_wait(compiled(False)), "ld.global"))
