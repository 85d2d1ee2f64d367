"""nimble.gemm_rows: the kernel's values under Triton's interpreter, the operator on the CPU and
under fake tensors, and fast_gemv choosing it per row count (the timing and the kernels stood
in: the CPU has no GPU)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nimble.fast_gemv as fg
from nimble import gemm_rows
from nimble.errors import InputError
from nimble.fused_projections import fuse_projections

from test_fast_gemv import FAST, Block, gpu_like

ROWS = fg.ROW_CONFIGS[0]


def test_the_kernel_sums_every_row_of_every_case_and_a_row_alone_gives_its_bits():
    from helpers import interpreted_cases

    cases = interpreted_cases(Path(__file__).parent / "workers" / "gemm_rows_interpreted.py")
    assert len(cases) == 15, sorted(cases)
    for name, case in cases.items():
        if name.startswith("prologue"):  # the rows an RMS norm or a gated product of inputs
            assert case["sum_equal"], name
            name = name.split()[-1]
        rows, rest = name.split("x")
        assert case["shape"] == [int(rows), int(rest.split("@")[1])], name
        assert case["error"] < 2e-3, (name, case["error"])
        assert case["rows_alone"], name
        assert case["second_kernel_same"], name


def test_the_prologues_are_the_gemvs_and_a_bad_one_is_refused():
    from nimble import gemv_prologues as gp

    assert (gp.RMSNORM, gp.ADD_RMSNORM, gp.SILU_GATED) == (0, 1, 2)
    a = torch.randn(4, 32, dtype=torch.float16)
    w = torch.randn(8, 32, dtype=torch.float16)
    for prologue, b, nw, words in ((7, a, None, "none of"), (1, None, None, "second"),
                                   (4, None, a[0], "second"), (3, None, None, "norm's weight"),
                                   (2, a[:, :16], None, "second"), (0, None, a[0, :8], "vector")):
        with pytest.raises(InputError, match=words):
            gemm_rows.launch_gemm_rows_prologue(prologue, a, b, nw, 1e-5, w, *ROWS.row_args)
    with pytest.raises(InputError, match="bias is a vector of 32"):
        gemm_rows.launch_gemm_rows_prologue(gp.GELU_TANH, a, None, None, 0.0, w,
                                            *ROWS.row_args, bias=a[0, :16])


def test_columns_are_split_into_whole_steps_and_no_part_is_empty():
    assert gemm_rows.split_columns(1000, 128, 1) == (1024, 1)
    assert gemm_rows.split_columns(1000, 128, 4) == (256, 4)
    assert gemm_rows.split_columns(440, 64, 3) == (192, 3)
    assert gemm_rows.split_columns(8192, 256, 8) == (1024, 8)
    # more parts asked for than steps: one step a part, every part holding columns
    assert gemm_rows.split_columns(300, 128, 8) == (128, 3)
    for k, block, split in ((2048, 64, 5), (4100, 512, 3), (33, 16, 16)):
        chunk, parts = gemm_rows.split_columns(k, block, split)
        assert chunk % block == 0 and parts <= split and (parts - 1) * chunk < k <= parts * chunk


def test_operands_the_kernel_cannot_take_are_refused_saying_what_to_pass():
    x = torch.randn(8, 32, dtype=torch.float16)
    w = torch.randn(24, 32, dtype=torch.float16)
    gemm_rows.check_operands(x, w)
    bad = [((x[0], w), "2 to 16 rows"), ((torch.randn(17, 32).half(), w), "2 to 16 rows"),
           ((x.float(), w.float()), "float16 or bfloat16"), ((x, w[:, :16]), "out_features"),
           ((x, w.bfloat16()), "one dtype"), ((x.t().contiguous().t(), w), "contiguous"),
           ((x, w.t().contiguous().t()), "contiguous")]
    for (a, b), words in bad:
        with pytest.raises(InputError, match=words):
            gemm_rows.launch_gemm_rows(a, b, *ROWS.row_args)


def test_the_operator_on_the_cpu_and_its_fake_shape():
    torch.manual_seed(0)
    x, w = torch.randn(8, 32, dtype=torch.float16), torch.randn(24, 32, dtype=torch.float16)
    got = gemm_rows.gemm_rows_op(x, w, *ROWS.args)
    assert torch.equal(got, (x.float() @ w.float().t()).half())
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = gemm_rows.gemm_rows_op(mode.from_tensor(x), mode.from_tensor(w), 16, 256, 4, 3)
        split = gemm_rows.gemm_rows_op(mode.from_tensor(x), mode.from_tensor(w), 16, 16, 4, 3, 2)
    assert fake.shape == split.shape == (8, 24) and fake.dtype == torch.float16


def row_timer(wins: dict):
    """µs by (weight shape, rows): torch's 5; a kernel 3 where ``wins`` names the shape at that
    row count (the GEMV's or gemm_rows' first configuration), else 9."""
    seen = []

    def time(config, weights, x):
        rows = 1 if x.dim() == 1 else x.shape[0]
        seen.append((tuple(weights[0].shape), rows, config))
        if config is None:
            return 5.0
        best = FAST if rows == 1 else ROWS
        return 3.0 if config == best and rows in wins.get(tuple(weights[0].shape), ()) else 9.0
    time.seen = seen
    return time


def _stand_in(monkeypatch, module, name):
    """``module.name`` (a kernel's operator) replaced by F.linear's values, each call noted as
    ``(input shape, weight shape, launch)``."""
    calls = []

    def op(x, weight, block_n, block_k, warps, stages, split=1):
        calls.append((tuple(x.shape), tuple(weight.shape),
                      fg.GemvConfig(block_n, block_k, warps, stages, split)))
        return F.linear(x.as_subclass(torch.Tensor), weight)
    monkeypatch.setattr(module, name, op)
    return calls


@pytest.fixture
def stand_in_rows(monkeypatch):
    return _stand_in(monkeypatch, gemm_rows, "gemm_rows_op")


@pytest.fixture
def stand_in_gemv(monkeypatch):
    return _stand_in(monkeypatch, fg, "gemv_op")


def test_fast_gemv_chooses_per_row_count_and_a_batch_of_that_count_runs_the_gemm_of_rows(
        stand_in_gemv, stand_in_rows):
    model = Block().half()
    time = row_timer({(16, 16): (1, 8), (16, 48): (8,)})
    choices = fg.fast_gemv(model, time=time, configs=(FAST,), rows=(8, 1))
    picked = {(c.out_features, c.in_features, c.rows): c.config for c in choices}
    assert picked == {(16, 16, 1): FAST, (16, 16, 8): ROWS, (16, 48, 1): None,
                      (16, 48, 8): ROWS, (48, 16, 1): None, (48, 16, 8): None}
    assert {r for _, r, c in time.seen if c in fg.ROW_CONFIGS} == {8}
    assert "GEMM of 8 rows" in choices[1].describe()
    assert model.q_proj.gemv_config == FAST and model.q_proj.row_configs == {8: ROWS}
    assert type(model.down) is fg.GemvLinear and model.down.gemv_config is None
    assert type(model.up) is nn.Linear
    with torch.no_grad():
        x = torch.randn(8, 1, 16, dtype=torch.float16)
        want = model.q_proj.weight.float()
        got = model.q_proj(gpu_like(x))
        assert got.shape == (8, 1, 16)
        assert torch.allclose(got.as_subclass(torch.Tensor).float(),
                              x.float() @ want.t(), atol=1e-2)
        model.q_proj(gpu_like(torch.randn(3, 16, dtype=torch.float16)))  # 3 rows: torch's
        model.q_proj(gpu_like(torch.randn(1, 16, dtype=torch.float16)))  # one row: the GEMV
    assert stand_in_rows == [((8, 16), (16, 16), ROWS)]
    assert stand_in_gemv == [((16,), (16, 16), FAST)]
    # chosen again for one row only: the batch goes back to torch's GEMM
    fg.fast_gemv(model, time=time, configs=(FAST,))
    assert model.q_proj.row_configs is None and model.down.row_configs is None


def test_a_model_made_float32_after_the_choice_runs_torchs_gemm(stand_in_rows):
    model = Block().half()
    fg.fast_gemv(model, time=row_timer({(16, 16): (8,)}), configs=(FAST,), rows=(8,))
    assert model.q_proj.row_configs == {8: ROWS}
    with torch.no_grad():
        model.q_proj(gpu_like(torch.randn(8, 16, dtype=torch.float16)))
        assert len(stand_in_rows) == 1
        model.float()  # tl.dot would round float32 to TF32: torch's GEMM, not the kernel
        got = model.q_proj(gpu_like(torch.randn(8, 16)))
    assert got.dtype == torch.float32 and len(stand_in_rows) == 1


def test_a_negative_margin_keeps_a_slower_gemv_but_never_a_slower_gemm_of_rows():
    model = nn.Sequential(nn.Linear(16, 8)).half()

    def time(config, weights, x):  # either kernel 5% slower than torch's GEMM
        return 5.0 if config is None else 5.25
    choices = fg.fast_gemv(model, time=time, configs=(FAST,), rows=(1, 8),
                           margin=fg.PROLOGUE_MARGIN)
    assert {c.rows: c.config for c in choices} == {1: FAST, 8: None}
    assert model[0].row_configs is None  # the fold pays only for the GEMV's


def test_a_fused_group_takes_its_row_configs(stand_in_rows):
    model = Block().half()
    assert fuse_projections(model, [("q_proj", "k_proj", "v_proj")]) == 1
    fg.fast_gemv(model, time=row_timer({(48, 16): (4,)}), configs=(FAST,), rows=(1, 4))
    assert model.q_proj._group.row_configs == {4: ROWS}
    with torch.no_grad():
        model(gpu_like(torch.randn(4, 16, dtype=torch.float16)))
    assert ((4, 16), (48, 16), ROWS) in stand_in_rows  # the fused q/k/v and the up projection


def test_float32_layers_time_no_gemm_of_rows_and_rows_out_of_range_are_refused():
    model = Block()  # float32: tl.dot would round its inputs to TF32
    time = row_timer({(16, 16): (1, 8)})
    choices = fg.fast_gemv(model, time=time, configs=(FAST,), rows=(1, 8))
    assert {c.rows for c in choices} == {1}
    assert model.q_proj.row_configs is None
    for bad in ((0,), (1, gemm_rows.MAX_ROWS + 1)):
        with pytest.raises(InputError, match="rows are 1"):
            fg.fast_gemv(model, time=time, rows=bad)
