"""Kernel names: readable short names, and which kernels are a library's (no GPU)."""
from __future__ import annotations

import pytest

from nimble.ir.kernel_names import library_kernel, short_kernel_name


def test_short_names_drop_the_template_arguments():
    mangled = "_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIfEEEEviT0_T1_"
    assert short_kernel_name(mangled) == "at::native::vectorized_elementwise_kernel"
    assert short_kernel_name("sm90_xmma_gemm_f16f16_f16f32") == "sm90_xmma_gemm_f16f16_f16f32"


@pytest.mark.parametrize("name, library", [
    ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc", True),
    ("cudnn::bn_fw_tr_1C11_singleread", True),
    ("_ZN7cutlass6KernelI53cutlass_80_tensorop_s1688gemm_64x64_16x6_tn_align4EEvNT_6ParamsE",
     True),
    ("nvjet_tst_128x64_64x8_1x2_h_bz_TNT", True),
    ("_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIfEEEEviT0_T1_", False),
    ("at::native::index_copy_kernel", False),
    ("triton_poi_fused_add_0", False),
    ("nimble_gather_input", False),
])
def test_library_kernels_are_neither_atens_nor_tritons_nor_nimbles(name, library):
    assert library_kernel(name) == library
