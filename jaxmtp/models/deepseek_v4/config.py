"""`V4Config`: the static, hashable description of a DeepSeek-V4 model (HF `model_type: deepseek_v4`).

Read from HF `config.json` in both of its spellings: transformers' (`layer_types`, `mlp_layer_types`,
`compress_rates`, nested `rope_parameters`) and DeepSeek's released one (`compress_ratios` per layer,
the MTP layer's entry last, `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`). The layer pattern
always comes from the config, since Flash and Pro differ. Values jaxmtp cannot run exactly raise
`ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from jaxmtp.config import QuantizationConfig, RopeScaling, _check_int, _float, _quantization_from_hf, _read_json
from jaxmtp.errors import ConfigError

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE, TOPK_MOE = "hash_moe", "moe"
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}

# transformers' DeepseekV4Config defaults (V4-Flash's values) for the fields a config may omit.
_DEFAULTS = dict(
    num_key_value_heads=1, head_dim=512, n_shared_experts=1, routed_scaling_factor=1.5, rope_theta=10000.0,
    compress_rope_theta=160000.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=10.0,
    sliding_window=128, o_groups=8, o_lora_rank=1024, index_n_heads=64, index_head_dim=128, index_topk=512,
    num_nextn_predict_layers=1, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
    initializer_range=0.02, max_position_embeddings=1048576, scoring_func="sqrtsoftplus", hidden_act="silu",
    attention_bias=False, mlp_bias=False,
)
_REQUIRED = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
             "q_lora_rank", "n_routed_experts", "num_experts_per_tok")


@dataclasses.dataclass(frozen=True)
class V4Config:
    """DeepSeek-V4 sizes and layer pattern. `layer_types[i]` is the attention of layer i (sliding
    window only, compressed sparse, heavily compressed); `mlp_layer_types[i]` its routing (by token
    id or top-k); `compress_rates` = (CSA rate, HCA rate); `rope_scaling` is the compressed layers'
    YaRN (sliding layers and the MTP layer rotate without scaling, at `rope_theta`)."""

    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    n_routed_experts: int
    num_experts_per_tok: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    n_shared_experts: int = 1
    routed_scaling_factor: float = 1.5
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: RopeScaling | None = None
    compress_rates: tuple[int, int] = (4, 128)
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_nextn_predict_layers: int = 1
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | tuple[int, ...] | None = 1
    initializer_range: float = 0.02
    max_position_embeddings: int = 1048576
    quantization: QuantizationConfig | None = None
    expert_dtype: str | None = None  # "fp4" where the routed experts ship as e2m1 with ue8m0 scales per 32

    model_type = "deepseek_v4"

    def __post_init__(self):
        _validate(self)

    @property
    def has_mtp(self) -> bool:
        return self.num_nextn_predict_layers > 0

    def compress_rate(self, layer_type: str) -> int:
        """Positions pooled into one compressed entry by a layer of this type; 0 for sliding layers."""
        return {SLIDING: 0, CSA: self.compress_rates[0], HCA: self.compress_rates[1]}[layer_type]

    def replace(self, **changes) -> "V4Config":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_config(cls, source) -> "V4Config":
        """From a path to config.json (or its directory) or an already-parsed dict."""
        raw = dict(source) if isinstance(source, Mapping) else _read_json(source)
        if raw.get("model_type") == "deepseek_v41":
            raise ConfigError("model_type: deepseek_v41 is a different architecture (V4.1) that jaxmtp does not "
                              "implement yet; deepseek_v4 (V4-Flash, V4-Pro) is supported")
        if raw.get("model_type", "deepseek_v4") != "deepseek_v4":
            raise ConfigError(f"model_type: expected 'deepseek_v4', found {raw.get('model_type')!r}")
        for name in _REQUIRED:
            if name not in raw:
                raise ConfigError(f"{name}: required field is missing")
        _check_supported(raw)
        layers = _check_int("num_hidden_layers", raw["num_hidden_layers"], minimum=1)
        kwargs = {name: raw[name] for name in _REQUIRED}
        for name, default in _DEFAULTS.items():
            if name in cls.__dataclass_fields__:
                kwargs[name] = raw.get(name, default)
        eos = kwargs["eos_token_id"]
        kwargs["eos_token_id"] = tuple(eos) if isinstance(eos, list) else eos
        kwargs["layer_types"] = _layer_types(raw, layers)
        kwargs["mlp_layer_types"] = _mlp_layer_types(raw, layers)
        kwargs["compress_rates"] = _compress_rates(raw)
        kwargs["qk_rope_head_dim"] = _rope_dim(raw, kwargs["head_dim"])
        kwargs["rope_theta"], kwargs["compress_rope_theta"], kwargs["rope_scaling"] = _rope_from_hf(raw)
        kwargs["quantization"] = _quantization_from_hf(raw.get("quantization_config"))
        q = raw.get("quantization_config") or {}
        kwargs["expert_dtype"] = raw.get("expert_dtype", q.get("expert_dtype") if isinstance(q, Mapping) else None)
        return cls(**kwargs)

    def to_hf_config(self) -> dict[str, Any]:
        """The config as transformers' DeepseekV4Config reads it (`DeepseekV4ForCausalLM`)."""
        out = {name: getattr(self, name) for name in _REQUIRED}
        out.update({name: getattr(self, name) for name in _DEFAULTS if name in self.__dataclass_fields__})
        out.update(model_type=self.model_type, architectures=["DeepseekV4ForCausalLM"], num_key_value_heads=1,
                   layer_types=list(self.layer_types), mlp_layer_types=list(self.mlp_layer_types),
                   compress_rates={CSA: self.compress_rates[0], HCA: self.compress_rates[1]},
                   partial_rotary_factor=self.qk_rope_head_dim / self.head_dim, scoring_func="sqrtsoftplus",
                   hidden_act="silu", attention_bias=False, mlp_bias=False)
        if isinstance(self.eos_token_id, tuple):
            out["eos_token_id"] = list(self.eos_token_id)
        main = {"rope_type": "default", "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.qk_rope_head_dim / self.head_dim}
        compress = {"rope_type": "default", "rope_theta": self.compress_rope_theta,
                    "partial_rotary_factor": main["partial_rotary_factor"]}
        r = self.rope_scaling
        if r is not None:
            compress.update(rope_type="yarn", factor=r.factor, original_max_position_embeddings=r.original_max_position_embeddings,
                            beta_fast=r.beta_fast, beta_slow=r.beta_slow, attention_factor=1.0)
        out["rope_parameters"] = {"main": main, "compress": compress}
        if self.quantization is not None:
            q = self.quantization
            out["quantization_config"] = {"quant_method": "fp8", "fmt": q.fmt, "activation_scheme": q.activation_scheme,
                                          "weight_block_size": list(q.weight_block_size)}
            if q.scale_fmt:
                out["quantization_config"]["scale_fmt"] = q.scale_fmt
        if self.expert_dtype is not None:
            out["expert_dtype"] = self.expert_dtype
        return out


def _check_supported(raw: Mapping):
    """Settings transformers accepts that would change the math jaxmtp implements."""
    for name, expected in dict(scoring_func="sqrtsoftplus", hidden_act="silu", attention_bias=False, mlp_bias=False,
                               num_key_value_heads=1).items():
        if raw.get(name, expected) != expected:
            raise ConfigError(f"{name}: DeepSeek-V4 uses {expected!r}, found {raw[name]!r}")


def _layer_types(raw: Mapping, layers: int) -> tuple[str, ...]:
    """`layer_types`, else DeepSeek's `compress_ratios` (0 / CSA rate / HCA rate per layer, the MTP
    layer's entry after the trunk's). Neither is refused: transformers' fallback pattern has the
    opposite parity to the released V4-Pro, so no pattern is guessed."""
    if raw.get("layer_types") is not None:
        types = tuple(raw["layer_types"])
        field = "layer_types"
    elif raw.get("compress_ratios") is not None:
        csa, hca = _compress_rates(raw)
        table = {0: SLIDING, csa: CSA, hca: HCA}
        bad = [r for r in raw["compress_ratios"] if r not in table]
        if bad:
            raise ConfigError(f"compress_ratios: entries must be 0, {csa} (CSA) or {hca} (HCA), found {bad}")
        types = tuple(table[r] for r in raw["compress_ratios"])
        field = "compress_ratios"
    else:
        raise ConfigError("layer_types: required (or DeepSeek's compress_ratios); the layer pattern differs between "
                          "V4-Flash and V4-Pro and is not guessed")
    if len(types) < layers:
        raise ConfigError(f"{field}: {len(types)} entries for num_hidden_layers={layers}")
    bad = [t for t in types if t not in LAYER_TYPES]
    if bad:
        raise ConfigError(f"{field}: entries must be one of {LAYER_TYPES}, found {bad}")
    return types[:layers]


def _mlp_layer_types(raw: Mapping, layers: int) -> tuple[str, ...]:
    if raw.get("mlp_layer_types") is not None:
        types = tuple(raw["mlp_layer_types"])
        if len(types) < layers or any(t not in (HASH_MOE, TOPK_MOE) for t in types):
            raise ConfigError(f"mlp_layer_types: expected {layers} entries of 'hash_moe' or 'moe', found {list(types)}")
        return types[:layers]
    hashed = _check_int("num_hash_layers", raw.get("num_hash_layers", 3), minimum=0)
    return (HASH_MOE,) * min(hashed, layers) + (TOPK_MOE,) * max(0, layers - hashed)


def _compress_rates(raw: Mapping) -> tuple[int, int]:
    rates = dict(raw.get("compress_rates") or {})
    csa = rates.get(CSA, raw.get("compress_rate_csa", 4))
    hca = rates.get(HCA, raw.get("compress_rate_hca", 128))
    return _check_int("compress_rates.compressed_sparse_attention", csa, 1), _check_int(
        "compress_rates.heavily_compressed_attention", hca, 1)


def _rope_dim(raw: Mapping, head_dim: int) -> int:
    if raw.get("qk_rope_head_dim") is not None:
        return raw["qk_rope_head_dim"]
    factor = raw.get("partial_rotary_factor")
    if factor is None:
        nested = (raw.get("rope_parameters") or {}).get("main") or {}
        factor = nested.get("partial_rotary_factor", 64 / 512)
    return int(head_dim * factor)


def _rope_from_hf(raw: Mapping) -> tuple[float, float, RopeScaling | None]:
    """(main theta, compressed layers' theta, their YaRN or None). Nested `rope_parameters` (main /
    compress) as transformers writes it, or a flat `rope_parameters` / `rope_scaling` that applies to
    the compressed layers, as DeepSeek ships it."""
    params = raw.get("rope_parameters") or {}
    if isinstance(params.get("main"), Mapping) and isinstance(params.get("compress"), Mapping):
        main, compress = params["main"], params["compress"]
        if main.get("rope_type", "default") != "default":
            raise ConfigError(f"rope_parameters.main.rope_type: expected 'default', found {main['rope_type']!r}")
        theta = _float("rope_parameters.main.rope_theta", main.get("rope_theta", raw.get("rope_theta", 10000.0)))
        compress_theta = compress.get("rope_theta", raw.get("compress_rope_theta", 160000.0))
        return theta, _float("rope_parameters.compress.rope_theta", compress_theta), _yarn(compress, "compress")
    flat = params or raw.get("rope_scaling") or {}
    theta = _float("rope_theta", raw.get("rope_theta", 10000.0))
    compress_theta = _float("compress_rope_theta", raw.get("compress_rope_theta", 160000.0))
    return theta, compress_theta, _yarn(flat, "rope_scaling")


def _yarn(params: Mapping, field: str) -> RopeScaling | None:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ConfigError(f"{field}.rope_type: only 'default' and 'yarn' are supported, found {kind!r}")
    for name in ("factor", "original_max_position_embeddings"):
        if name not in params:
            raise ConfigError(f"{field}.{name}: required for yarn")
    attention = params.get("attention_factor", 1.0)
    if attention != 1.0:  # DeepSeek's reference does not scale cos/sin by YaRN's mscale
        raise ConfigError(f"{field}.attention_factor: DeepSeek-V4 uses 1.0, found {attention!r}")
    return RopeScaling(factor=_float(f"{field}.factor", params["factor"]),
                       original_max_position_embeddings=params["original_max_position_embeddings"],
                       beta_fast=_float(f"{field}.beta_fast", params.get("beta_fast", 32)),
                       beta_slow=_float(f"{field}.beta_slow", params.get("beta_slow", 1)), attention_factor=1.0,
                       truncate=bool(params.get("truncate", True)))


def _validate(c: V4Config):
    for name in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "q_lora_rank", "n_routed_experts", "num_experts_per_tok", "head_dim", "hc_mult", "hc_sinkhorn_iters",
                 "sliding_window", "o_groups", "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk"):
        _check_int(name, getattr(c, name), minimum=1)
    for name in ("n_shared_experts", "num_nextn_predict_layers"):
        _check_int(name, getattr(c, name), minimum=0)
    if len(c.layer_types) != c.num_hidden_layers or len(c.mlp_layer_types) != c.num_hidden_layers:
        raise ConfigError(f"layer_types / mlp_layer_types: need {c.num_hidden_layers} entries each, found "
                          f"{len(c.layer_types)} / {len(c.mlp_layer_types)}")
    rope = _check_int("qk_rope_head_dim", c.qk_rope_head_dim, minimum=2)
    if rope % 2 or rope > c.head_dim or rope > c.index_head_dim:
        raise ConfigError(f"qk_rope_head_dim: must be even and at most head_dim ({c.head_dim}) and index_head_dim "
                          f"({c.index_head_dim}), found {rope}")
    if (c.num_attention_heads * c.head_dim) % c.o_groups:
        raise ConfigError(f"o_groups: {c.o_groups} does not divide num_attention_heads x head_dim = "
                          f"{c.num_attention_heads * c.head_dim}")
    if c.num_experts_per_tok > c.n_routed_experts:
        raise ConfigError(f"num_experts_per_tok: {c.num_experts_per_tok} exceeds n_routed_experts {c.n_routed_experts}")
    if not c.swiglu_limit > 0 or math.isinf(c.swiglu_limit):
        raise ConfigError(f"swiglu_limit: must be a positive number, found {c.swiglu_limit}")
    if c.expert_dtype not in (None, "fp4", "fp8", "bf16"):
        raise ConfigError(f"expert_dtype: expected 'fp4', 'fp8' or 'bf16', found {c.expert_dtype!r}")
