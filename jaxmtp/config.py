"""`ModelConfig`: the static, hashable description of a DeepSeek-V3-family model.

It is read from and written to HF `config.json` (`model_type` deepseek_v3, kimi_k2 or
deepseek_v32) and passed explicitly to every module and jitted function. Validation is strict: a
value jaxmtp cannot run exactly raises `ConfigError` naming the field, instead of being silently
approximated.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

from jaxmtp.errors import ConfigError


# Sizes that define the architecture: no default is guessed for these.
_REQUIRED = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
)
_REQUIRED_MOE = ("moe_intermediate_size", "n_routed_experts", "num_experts_per_tok")
# HF `DeepseekV3Config` defaults for the fields a config may omit.
_HF_DEFAULTS = dict(
    n_shared_experts=1, routed_scaling_factor=2.5, n_group=8, topk_group=4, first_k_dense_replace=3,
    norm_topk_prob=True, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_interleave=True, num_nextn_predict_layers=1, bos_token_id=0, eos_token_id=1,
    scoring_func="sigmoid", topk_method="noaux_tc", hidden_act="silu", moe_layer_freq=1,
    attention_bias=False, initializer_range=0.02,
)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters (HF `rope_parameters` with `rope_type: yarn`)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


# The HF model types of the DeepSeek-V3 architecture: DeepSeek's own (V3, V3-0324, R1, V3.1,
# Moonlight), Moonshot's Kimi K2 (the same modules with its own sizes, no MTP weights released) and
# DeepSeek-V3.2 (the same plus a lightning indexer in every attention: DeepSeek Sparse Attention).
MODEL_TYPES = ("deepseek_v3", "kimi_k2", "deepseek_v32")
ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM", "kimi_k2": "DeepseekV3ForCausalLM",
                 "deepseek_v32": "DeepseekV32ForCausalLM"}
# The model types that jaxmtp.models.deepseek_v4 reads (deepseek_v41 there only to be refused by name).
V4_MODEL_TYPES = ("deepseek_v4", "deepseek_v41")
# HF `DeepseekV32Config` defaults for the indexer's sizes (DeepSeek-V3.2's own values).
_INDEX_DEFAULTS = dict(index_n_heads=64, index_head_dim=128, index_topk=2048)
# quantization_config.scale_fmt values: absent (scales amax / 448) or "ue8m0" (powers of two).
SCALE_FORMATS = (None, "ue8m0")


@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    """Block-scaled FP8 weights as published (`quantization_config`)."""

    weight_block_size: tuple[int, int] = (128, 128)
    fmt: str = "e4m3"
    activation_scheme: str = "dynamic"
    scale_fmt: str | None = None  # "ue8m0" (DeepSeek-V3.1 on): activation scales are powers of two


# The configs shipped with the package (tiny, demo, deepseek_v3_671b, deepseek_v32_671b, kimi_k2), found from any
# working directory; the repository's configs/ links here.
CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def config_file(path: str) -> str:
    """`path` itself, or for the name of a config shipped in jaxmtp.CONFIGS (e.g. "deepseek_v3_671b")
    that file, so that commands work from any directory."""
    packaged = os.path.join(CONFIGS, path.removesuffix(".json") + ".json")
    return packaged if not os.path.exists(path) and os.sep not in path and os.path.exists(packaged) else path


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a DeepSeek-V3-family model. Field names follow HF `DeepseekV3Config`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 0
    norm_topk_prob: bool = True
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_interleave: bool = True
    rope_scaling: RopeScaling | None = None
    num_nextn_predict_layers: int = 1
    bos_token_id: int | None = 0
    eos_token_id: int | tuple[int, ...] | None = 1
    initializer_range: float = 0.02
    quantization: QuantizationConfig | None = None
    model_type: str = "deepseek_v3"  # one of MODEL_TYPES; kept so that a save writes it back
    # DeepSeek Sparse Attention (deepseek_v32; 0 = none): each query attends to the index_topk cached
    # keys that its lightning indexer (index_n_heads heads of index_head_dim) scores highest.
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0

    def __post_init__(self):
        _validate(self)

    # ----- derived sizes -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_dense_layers(self) -> int:
        return self.first_k_dense_replace

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace

    @property
    def has_mtp(self) -> bool:
        return self.num_nextn_predict_layers > 0

    @property
    def cache_width(self) -> int:
        """MLA's values cached per token per layer: compressed latent + shared RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def has_indexer(self) -> bool:
        """Whether attention is DeepSeek Sparse Attention (a lightning indexer selects the keys)."""
        return self.index_topk > 0

    @property
    def cached_per_token(self) -> int:
        """All values cached per token per layer: MLA's, plus the indexer's key where there is one."""
        return self.cache_width + self.index_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 when that is set."""
        scale = self.qk_head_dim ** -0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim:
            scale *= yarn_mscale(rs.factor, rs.mscale_all_dim) ** 2
        return scale

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ----- HF config.json ------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, source: str | os.PathLike | Mapping[str, Any]) -> "ModelConfig":
        """Reads an HF `config.json` (a path to the file or its directory, or the parsed dict)."""
        raw = _read_json(source) if not isinstance(source, Mapping) else dict(source)
        if not isinstance(raw, Mapping):
            raise ConfigError(f"config.json: expected a JSON object of fields, found a JSON {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type in V4_MODEL_TYPES:
            raise ConfigError(f"model_type: {model_type!r} is DeepSeek-V4, another architecture: "
                              "jaxmtp.models.deepseek_v4 runs deepseek_v4 (load_v4; docs/deepseek_v4.md); this reads the "
                              "DeepSeek-V3 architecture (V3, R1, V3.1, V3.2, Moonlight, Kimi K2)")
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"model_type: expected one of {', '.join(map(repr, MODEL_TYPES))} (the DeepSeek-V3 "
                              f"architecture: V3, R1, V3.1, V3.2, Moonlight, Kimi K2), found {model_type!r}")
        _check_supported(raw)
        kwargs = {name: _get(raw, name) for name in _REQUIRED}
        # The MoE sizes are required only if some layer is MoE, which these three decide.
        layers = _check_int("num_hidden_layers", _get(raw, "num_hidden_layers"), minimum=1)
        dense = _check_int("first_k_dense_replace", raw.get("first_k_dense_replace", 3), minimum=0)
        mtp = _check_int("num_nextn_predict_layers", raw.get("num_nextn_predict_layers", 1), minimum=0)
        moe_needed = layers > dense or mtp > 0
        for name in _REQUIRED_MOE:
            kwargs[name] = _get(raw, name) if moe_needed else raw.get(name, 0)
        for name in ("n_shared_experts", "routed_scaling_factor", "first_k_dense_replace", "norm_topk_prob",
                     "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "rope_interleave",
                     "num_nextn_predict_layers", "bos_token_id", "initializer_range"):
            kwargs[name] = raw.get(name, _HF_DEFAULTS[name])
        # HF allows null group settings; they mean a single group.
        kwargs["n_group"] = raw.get("n_group", _HF_DEFAULTS["n_group"]) or 1
        kwargs["topk_group"] = raw.get("topk_group", _HF_DEFAULTS["topk_group"]) or 1
        kwargs["n_shared_experts"] = kwargs["n_shared_experts"] or 0
        eos = raw.get("eos_token_id", _HF_DEFAULTS["eos_token_id"])
        kwargs["eos_token_id"] = tuple(eos) if isinstance(eos, list) else eos
        kwargs["rope_theta"], kwargs["rope_scaling"] = _rope_from_hf(raw)
        kwargs["quantization"] = _quantization_from_hf(raw.get("quantization_config"))
        if model_type == "deepseek_v32":
            kwargs.update(_indexer_from_hf(raw, dense))
        return cls(**kwargs, model_type=model_type)

    def to_hf_config(self) -> dict[str, Any]:
        """The HF `config.json` dict (`rope_parameters` spelling, as transformers 5 writes it)."""
        out: dict[str, Any] = {"architectures": [ARCHITECTURES[self.model_type]], "model_type": self.model_type}
        # HF's DeepSeek-V3.2 always rotates MLA's pairs interleaved and has no rope_interleave field.
        skipped = {"rope_scaling", "quantization", "rope_theta", "model_type"}
        skipped |= {"rope_interleave"} if self.has_indexer else {"index_n_heads", "index_head_dim", "index_topk"}
        for f in dataclasses.fields(self):
            if f.name not in skipped:
                value = getattr(self, f.name)
                out[f.name] = list(value) if isinstance(value, tuple) else value
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope["rope_type"] = "yarn"
            rope.update({k: v for k, v in dataclasses.asdict(self.rope_scaling).items() if v is not None})
        out["rope_parameters"] = rope
        out.update(hidden_act="silu", scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1,
                   attention_bias=False, num_key_value_heads=self.num_attention_heads)
        if self.quantization is not None:
            q = self.quantization
            out["quantization_config"] = {"activation_scheme": q.activation_scheme, "fmt": q.fmt,
                                          "quant_method": "fp8", "weight_block_size": list(q.weight_block_size)}
            if q.scale_fmt is not None:
                out["quantization_config"]["scale_fmt"] = q.scale_fmt
        return out


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature sqrt(t) = 0.1 * mscale * ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


# ----- reading helpers ---------------------------------------------------------------------
def _read_json(source) -> dict:
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


def _get(raw: Mapping, name: str):
    if name not in raw:
        raise ConfigError(f"{name}: required field is missing")
    return raw[name]


def _check_supported(raw: Mapping):
    """Rejects settings HF accepts but which would change the math jaxmtp implements."""
    expectations = dict(scoring_func="sigmoid", topk_method="noaux_tc", hidden_act="silu", moe_layer_freq=1,
                        attention_bias=False)
    for name, expected in expectations.items():
        value = raw.get(name, expected)
        if value != expected:
            raise ConfigError(f"{name}: only {expected!r} is supported, found {value!r}")


def _rope_from_hf(raw: Mapping) -> tuple[float, RopeScaling | None]:
    """Accepts both `rope_parameters` (transformers 5) and legacy `rope_scaling` + `rope_theta`."""
    field = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    params = raw.get(field) or {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"{field}: expected a dict, found {type(params).__name__}")
    theta = _float("rope_theta", params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise ConfigError(f"rope_parameters.rope_type: only 'default' and 'yarn' are supported, found {kind!r}")
    if "original_max_position_embeddings" not in params:
        raise ConfigError("rope_parameters.original_max_position_embeddings: required for yarn")
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:  # HF derives it from the context extension
        factor = raw.get("max_position_embeddings", _HF_DEFAULTS["max_position_embeddings"]) / original
    optional = lambda k: None if params.get(k) is None else _float(f"rope_parameters.{k}", params[k])  # noqa: E731
    scaling = RopeScaling(
        factor=_float("rope_parameters.factor", factor), original_max_position_embeddings=original,
        beta_fast=_float("rope_parameters.beta_fast", params.get("beta_fast") or 32),
        beta_slow=_float("rope_parameters.beta_slow", params.get("beta_slow") or 1),
        mscale=optional("mscale"), mscale_all_dim=optional("mscale_all_dim"),
        attention_factor=optional("attention_factor"), truncate=bool(params.get("truncate", True)))
    return theta, scaling


def _indexer_from_hf(raw: Mapping, dense: int) -> dict[str, Any]:
    """DeepSeek-V3.2's indexer sizes (HF's defaults where absent). Its MLA rotates interleaved pairs
    whatever `rope_interleave` says (HF's V3.2 has no such field): true or absent is accepted."""
    if raw.get("rope_interleave", True) is not True:
        raise ConfigError(f"rope_interleave: DeepSeek-V3.2's attention rotates interleaved pairs, found "
                          f"{raw['rope_interleave']!r}")
    types = raw.get("mlp_layer_types")
    layers = raw["num_hidden_layers"]
    if types is not None and list(types) != ["dense"] * dense + ["sparse"] * (layers - dense):
        raise ConfigError(f"mlp_layer_types: expected first_k_dense_replace={dense} 'dense' then 'sparse', "
                          f"found {types!r}")
    out = {name: raw.get(name, default) for name, default in _INDEX_DEFAULTS.items()}
    out["rope_interleave"] = True
    return out


def _quantization_from_hf(q) -> QuantizationConfig | None:
    if q is None:
        return None
    if not isinstance(q, Mapping):
        raise ConfigError(f"quantization_config: expected a dict, found {type(q).__name__}")
    if q.get("quant_method") != "fp8":
        raise ConfigError(f"quantization_config.quant_method: only 'fp8' is supported, found {q.get('quant_method')!r}")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"quantization_config.fmt: only 'e4m3' is supported, found {q.get('fmt')!r}")
    block = q.get("weight_block_size", (128, 128))
    if not isinstance(block, (list, tuple)) or len(block) != 2 or not all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
        raise ConfigError(f"quantization_config.weight_block_size: expected two positive ints, found {list(block)}")
    scale_fmt = q.get("scale_fmt")
    if scale_fmt not in SCALE_FORMATS:
        raise ConfigError(f"quantization_config.scale_fmt: expected one of {SCALE_FORMATS}, found {scale_fmt!r}")
    return QuantizationConfig(weight_block_size=tuple(block), activation_scheme=q.get("activation_scheme", "dynamic"),
                              scale_fmt=scale_fmt)


# ----- validation --------------------------------------------------------------------------
def _validate(c: ModelConfig):
    positive = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_group", "topk_group",
                "max_position_embeddings"]
    needs_moe = c.num_moe_layers > 0 or c.has_mtp
    if needs_moe:
        positive += ["moe_intermediate_size", "n_routed_experts", "num_experts_per_tok"]
    for name in positive:
        _check_int(name, getattr(c, name), minimum=1)
    for name in ("first_k_dense_replace", "n_shared_experts", "num_nextn_predict_layers"):
        _check_int(name, getattr(c, name), minimum=0)
    if c.q_lora_rank is not None:
        _check_int("q_lora_rank", c.q_lora_rank, minimum=1)
    if c.qk_rope_head_dim % 2:
        raise ConfigError(f"qk_rope_head_dim: must be even (RoPE rotates pairs), found {c.qk_rope_head_dim}")
    if c.first_k_dense_replace > c.num_hidden_layers:
        raise ConfigError(f"first_k_dense_replace: {c.first_k_dense_replace} exceeds num_hidden_layers "
                          f"{c.num_hidden_layers}")
    if c.num_nextn_predict_layers > 1:
        raise ConfigError(f"num_nextn_predict_layers: at most 1 MTP module is supported, found "
                          f"{c.num_nextn_predict_layers}")
    for name in ("rms_norm_eps", "routed_scaling_factor", "rope_theta", "initializer_range"):
        _float(name, getattr(c, name))
    for name in ("norm_topk_prob", "tie_word_embeddings", "rope_interleave"):
        if not isinstance(getattr(c, name), bool):
            raise ConfigError(f"{name}: expected true or false, found {getattr(c, name)!r}")
    _check_ids(c)
    if not c.rms_norm_eps > 0:
        raise ConfigError(f"rms_norm_eps: must be positive, found {c.rms_norm_eps}")
    if needs_moe:
        _validate_routing(c)
    if c.rope_scaling is not None:
        _validate_rope(c.rope_scaling)
    if (c.model_type == "deepseek_v32") != c.has_indexer:
        raise ConfigError(f"index_topk: model_type 'deepseek_v32' and only it has an indexer (index_topk > 0); "
                          f"found model_type {c.model_type!r} with index_topk {c.index_topk}")
    if c.has_indexer:
        _validate_indexer(c)


def _validate_routing(c: ModelConfig):
    if c.topk_group > c.n_group:
        raise ConfigError(f"topk_group: {c.topk_group} exceeds n_group {c.n_group}")
    if c.n_routed_experts % c.n_group:
        raise ConfigError(f"n_group: n_routed_experts {c.n_routed_experts} is not divisible by n_group {c.n_group}")
    per_group = c.n_routed_experts // c.n_group
    if per_group < 2:
        raise ConfigError(f"n_group: each group needs >= 2 experts (group score = sum of top 2), found {per_group}")
    if c.num_experts_per_tok > c.topk_group * per_group:
        raise ConfigError(f"num_experts_per_tok: {c.num_experts_per_tok} exceeds the {c.topk_group * per_group} "
                          f"experts in the topk_group={c.topk_group} kept groups")
    if not c.routed_scaling_factor > 0:
        raise ConfigError(f"routed_scaling_factor: must be positive, found {c.routed_scaling_factor}")


def _validate_indexer(c: ModelConfig):
    for name in ("index_n_heads", "index_head_dim", "index_topk"):
        _check_int(name, getattr(c, name), minimum=1)
    if c.q_lora_rank is None:
        raise ConfigError("q_lora_rank: DeepSeek Sparse Attention's indexer reads the query LoRA's output; "
                          "found null")
    if c.index_head_dim < c.qk_rope_head_dim or c.index_head_dim % 2:
        raise ConfigError(f"index_head_dim: must be even and hold the {c.qk_rope_head_dim} rotated dims "
                          f"(qk_rope_head_dim), found {c.index_head_dim}")


def _validate_rope(r: RopeScaling):
    if not r.factor > 0:
        raise ConfigError(f"rope_parameters.factor: must be positive, found {r.factor}")
    _check_int("rope_parameters.original_max_position_embeddings", r.original_max_position_embeddings, minimum=1)


def _check_ids(c: ModelConfig):
    """bos_token_id: an id or null; eos_token_id: an id, a list of ids or null; each in the vocabulary."""
    eos = c.eos_token_id if isinstance(c.eos_token_id, tuple) else (c.eos_token_id,)
    for name, ids in (("bos_token_id", (c.bos_token_id,)), ("eos_token_id", eos)):
        for value in ids:
            if value is not None and not 0 <= _check_int(name, value, minimum=0) < c.vocab_size:
                raise ConfigError(f"{name}: {value} is outside the vocabulary [0, {c.vocab_size})")


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: expected an integer, found {value!r}")
    if value < minimum:
        raise ConfigError(f"{name}: must be >= {minimum}, found {value}")
    return value


def _float(name: str, value) -> float:
    """A JSON number as a float (ints are numbers too; strings and booleans are not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name}: expected a number, found {value!r}")
    return float(value)
