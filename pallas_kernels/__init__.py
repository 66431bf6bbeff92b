"""Kernels for DeepSeek-V3's FP8 scheme: per-token 1x128 activation quantization and the
128x128 block-scaled FP8 GEMM, with jnp references written from the formulas."""

from pallas_kernels.reference import act_quant_reference, fp8_block_matmul_reference

__all__ = ["act_quant_reference", "fp8_block_matmul_reference"]
