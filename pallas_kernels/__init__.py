"""Kernels for DeepSeek-V3's FP8 scheme: per-token 1x128 activation quantization and the
128x128 block-scaled FP8 GEMM (dense and grouped for MoE experts), with jnp references written
from the formulas."""

from pallas_kernels.fp8_gemm import Backend, act_quant, backend, fp8_block_matmul, fp8_grouped_matmul
from pallas_kernels.reference import act_quant_reference, fp8_block_matmul_reference

__all__ = [
    "Backend",
    "act_quant",
    "act_quant_reference",
    "backend",
    "fp8_block_matmul",
    "fp8_block_matmul_reference",
    "fp8_grouped_matmul",
]
