"""The full 671B config from abstract shapes: parameter counts and lowering, nothing allocated."""

import jax
import jax.numpy as jnp

import jaxmtp
from jaxmtp.layout import CHECKPOINT
from jaxmtp.model import apply_forward, apply_mtp_forward
from jaxmtp.params import abstract_params, parameter_counts

V3 = jaxmtp.ModelConfig.from_hf_config(f"{jaxmtp.CONFIGS}/deepseek_v3_671b.json")


def spec_table_counts():
    """Sums of DeepSeek-V3's tensor shapes as its checkpoint lists them, written out by hand (not from jaxmtp)."""
    D, V = 7168, 129280
    attention = (1536 * 7168 + 1536 + 24576 * 1536 + 576 * 7168 + 512 + 32768 * 512 + 7168 * 16384
                 + 2 * 7168)  # q_a, q_a_norm, q_b, kv_a, kv_norm, kv_b, o, two layer norms
    dense_ffn = 3 * 18432 * 7168
    moe_ffn = 256 * 3 * 2048 * 7168 + 256 * 7168 + 256 + 3 * 2048 * 7168  # experts, gate, bias, shared
    main = 2 * V * D + D + 3 * (attention + dense_ffn) + 58 * (attention + moe_ffn)
    mtp_unique = attention + moe_ffn + 2 * D + 7168 * 14336 + D  # + enorm, hnorm, eh_proj, shared_head.norm
    return main, mtp_unique, mtp_unique + 2 * V * D


def test_parameter_counts_match_spec_table():
    main, mtp_unique, mtp_with_copies = spec_table_counts()
    counts = parameter_counts(V3)
    assert counts == {"main": main, "mtp_unique": mtp_unique, "mtp_with_copies": mtp_with_copies}
    assert round(counts["main"] / 1e9, 1) == 671.0
    assert round(counts["mtp_unique"] / 1e9, 1) == 11.6
    assert round(counts["mtp_with_copies"] / 1e9, 1) == 13.5


def test_forward_and_mtp_lower_from_abstract_parameters():
    params = abstract_params(V3, jnp.bfloat16)
    assert params["moe_layers"]["layers"]["mlp"]["experts"]["gate_proj"].shape == (58, 256, 2048, 7168)
    tokens = jax.ShapeDtypeStruct((1, 64), jnp.int32)
    lowered = apply_forward.lower(V3, jnp.dtype(jnp.bfloat16), CHECKPOINT, params, tokens)
    logits, hidden = lowered.out_info
    assert logits.shape == (1, 64, 129280) and hidden.shape == (1, 64, 7168)
    hidden_in = jax.ShapeDtypeStruct((1, 64, 7168), jnp.bfloat16)
    mtp_logits = apply_mtp_forward.lower(V3, jnp.dtype(jnp.bfloat16), CHECKPOINT, params, hidden_in, tokens).out_info
    assert mtp_logits.shape == (1, 64, 129280)


def test_the_671b_model_decodes_with_its_scanned_stacks():
    """Too large to unroll (jaxmtp.layout.MAX_UNROLLED_BYTES): generate keeps the checkpoint layout."""
    from jaxmtp.layout import decode_layout

    assert decode_layout(V3, abstract_params(V3, jnp.bfloat16, keep_fp8=True)) == CHECKPOINT
