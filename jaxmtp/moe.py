"""Feed-forward blocks: the dense SwiGLU MLP and DeepSeekMoE.

DeepSeekMoE routes each token to `num_experts_per_tok` of `n_routed_experts` experts (sigmoid
scores, a bias that steers selection only, group-limited top-k), runs them dropless by sorting the
token copies by expert and calling a grouped matmul, and adds the always-on shared experts. On a
mesh with an `expert` or `tensor` axis the routed experts run expert-parallel in shard_map.
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxmtp.config import ModelConfig
from jaxmtp.layers import Dtype, Linear, normal_init, projection_weight
from jaxmtp.layout import CHECKPOINT, Layout
from jaxmtp.quant import QuantizedWeight, grouped_linear, linear, runs_fp8
from jaxmtp.sharding import ShardingWarning, context_mesh, expert_axes


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up as one weight `gate_up_proj` with
    layout.joint_projections. x: [..., D] -> [..., D]."""

    config: ModelConfig
    intermediate_size: int
    dtype: Dtype = jnp.float32
    axis: str = "mlp"
    layout: Layout = CHECKPOINT
    swiglu_limit: float | None = None  # DeepSeek-V4's clamp (see gated)

    def setup(self):
        D, I, std, layout = self.config.hidden_size, self.intermediate_size, self.config.initializer_range, self.layout
        if layout.joint_projections:
            self.gate_up_proj = Linear(D, 2 * I, (self.axis, "embed"), self.dtype, std, layout)
        else:
            self.gate_proj = Linear(D, I, (self.axis, "embed"), self.dtype, std, layout)
            self.up_proj = Linear(D, I, (self.axis, "embed"), self.dtype, std, layout)
        self.down_proj = Linear(I, D, ("embed", self.axis), self.dtype, std, layout)

    def __call__(self, x):
        if self.layout.joint_projections:
            gate, up = jnp.split(self.gate_up_proj(x), 2, axis=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(gated(gate, up, self.swiglu_limit))


def gated(gate_x, up_x, limit: float | None = None):
    """silu(gate_x) * up_x; with a limit (DeepSeek-V4), gate_x clamped above at it and up_x to
    [-limit, limit] first."""
    if limit is not None:
        gate_x, up_x = jnp.minimum(gate_x, limit), jnp.clip(up_x, -limit, limit)
    return nn.silu(gate_x) * up_x


def swiglu(x, gate, up, down, inputs_first: bool, limit: float | None = None):
    """One expert on its own weights (what MLP computes): x [N, D] -> [N, D]; weights [I, D] /
    [D, I] ([D, I] / [I, D] inputs first), dense or QuantizedWeight. up None: gate is the
    joint [D, 2I] weight of gate and up (layout.joint_projections)."""
    if up is None:
        gate_x, up_x = jnp.split(linear(x, gate, inputs_first), 2, axis=-1)
    else:
        gate_x, up_x = linear(x, gate, inputs_first), linear(x, up, inputs_first)
    return linear(gated(gate_x, up_x, limit), down, inputs_first)


def top_two_sum(x: jax.Array) -> jax.Array:
    """x [..., S] (S >= 2) -> the sum of its two largest values along S [...], a tied maximum counted twice.

    What jax.lax.top_k(x, 2)[0].sum(-1) gives, bit for bit, from reductions: XLA CPU runs that top_k
    as a whole sort, the dearest kernel of a few-token router (tools/step_profile.py)."""
    first = x.max(axis=-1)
    at_first = x == first[..., None]
    below = jnp.where(at_first, -jnp.inf, x).max(axis=-1)
    return first + jnp.where(at_first.sum(axis=-1) > 1, first, below)


def route(logits: jax.Array, bias: jax.Array, config: ModelConfig):
    """Group-limited top-k routing (DeepSeek-V3 `noaux_tc`).

    Args:
      logits: [N, E] float32 router logits; bias: [E] e_score_correction_bias.
    Returns:
      weights [N, K] float32 (unbiased sigmoid scores, normalised if norm_topk_prob, times
      routed_scaling_factor) and expert indices [N, K] int32.
    """
    c = config
    scores = jax.nn.sigmoid(logits)
    biased = scores + bias  # the bias only decides which experts are chosen
    grouped = biased.reshape(biased.shape[0], c.n_group, -1)
    group_scores = top_two_sum(grouped)  # [N, G]
    _, kept_groups = jax.lax.top_k(group_scores, c.topk_group)
    group_mask = jax.nn.one_hot(kept_groups, c.n_group, dtype=jnp.bool_).any(axis=1)  # [N, G]
    masked = jnp.where(group_mask[:, :, None], grouped, -jnp.inf).reshape(biased.shape)
    _, experts = jax.lax.top_k(masked, c.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if c.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * c.routed_scaling_factor, experts


class Router(nn.Module):
    """Gate: weight [E, D] ([D, E] inputs first) and the float32 selection bias [E].
    x [N, D] -> (weights, experts)."""

    config: ModelConfig
    dtype: Dtype = jnp.float32
    layout: Layout = CHECKPOINT

    @nn.compact
    def __call__(self, x):
        c = self.config
        weight = projection_weight(self, c.n_routed_experts, c.hidden_size, ("router", "embed"), self.dtype,
                                   c.initializer_range, self.layout)
        bias = self.param("e_score_correction_bias", nn.with_logical_partitioning(nn.initializers.zeros, ("router",)),
                          (c.n_routed_experts,), jnp.float32)
        logits = linear(x.astype(jnp.float32), weight.astype(jnp.float32), self.layout.inputs_first)
        return route(logits, bias, c)


class Experts(nn.Module):
    """Routed experts, weights stacked [E, out, in], or (layout.split_experts) a tuple of E
    per-expert weights [out, in] ([in, out] inputs first; gate and up joined as `gate_up_proj`
    with layout.joint_projections)."""

    config: ModelConfig
    dtype: Dtype = jnp.float32
    layout: Layout = CHECKPOINT
    swiglu_limit: float | None = None  # DeepSeek-V4's clamp (see gated)

    @nn.compact
    def __call__(self, x, weights, experts):
        """x [N, D], weights/experts [N, K] -> [N, D] = sum_k weights[:, k] * Expert_{experts[:, k]}(x)."""
        c = self.config
        E, I, D = c.n_routed_experts, c.moe_intermediate_size, c.hidden_size
        if self.layout.split_experts:
            if self.layout.joint_projections:
                gate, up = self.param("gate_up_proj", self.split_init, (2 * I, D)), (None,) * E
            else:
                gate, up = (self.param(name, self.split_init, (I, D)) for name in ("gate_proj", "up_proj"))
            down = self.param("down_proj", self.split_init, (D, I))
            return split_experts(x, weights, experts, gate, up, down, self.layout.inputs_first, self.swiglu_limit)
        init = lambda axes: normal_init(c.initializer_range, axes)  # noqa: E731
        gate = self.param("gate_proj", init(("expert", "expert_mlp", "embed")), (E, I, D), self.dtype)
        up = self.param("up_proj", init(("expert", "expert_mlp", "embed")), (E, I, D), self.dtype)
        down = self.param("down_proj", init(("expert", "embed", "expert_mlp")), (E, D, I), self.dtype)

        mesh = expert_parallel_mesh(c, gate)
        # Fewer token copies than experts (decode): most groups would be empty, so gather instead;
        # weights for the FP8 kernels always take the sorted path (the grouped kernel).
        if mesh is None and experts.size <= E and not runs_fp8(gate):
            return gathered_experts(x, weights, experts, gate, up, down, self.swiglu_limit)
        if mesh is None:
            return local_experts(x, weights, experts, gate, up, down, first=0, num_experts=E, limit=self.swiglu_limit)
        return expert_parallel(mesh, x, weights, experts, gate, up, down, E, self.swiglu_limit)

    def split_init(self, key, shape):
        """E per-expert weights of checkpoint shape [out, in] (reversed inputs first)."""
        shape = shape[::-1] if self.layout.inputs_first else shape
        normal = nn.initializers.normal(self.config.initializer_range)
        return tuple(normal(k, shape, self.dtype) for k in jax.random.split(key, self.config.n_routed_experts))


def split_experts(x, weights, experts, gate, up, down, inputs_first, limit=None):
    """Routed experts on their own weights (split layout), each run only where a token chose it.

    One token (a plain decode step): one lax.switch per expert it chose, over the E experts.
    Several: one lax.cond per expert, which runs it on all N rows where any row chose it, and each
    token keeps its own experts' outputs, weighted. A third branch running an expert on the one
    row that chose it measured no faster at the few rows of a verify pass
    (benchmarks/decode_step.py --rows 1,2,3,4) and made every round variant compile longer
    (benchmarks/compile_cache.py). With many tokens (prefill)
    most experts run over every token, up to E / K times the routed FLOPs, which the few experts of
    a split layout keep small.
    x [N, D]; weights/experts [N, K]; gate/up/down: tuples of E weights (up: E Nones where gate
    holds both, see swiglu) -> [N, D]."""
    run = [lambda x, g=g, u=u, d=d: swiglu(x, g, u, d, inputs_first, limit) for g, u, d in zip(gate, up, down)]
    if x.shape[0] == 1:  # K conditionals (and index clamps) instead of E, and no per-expert bookkeeping
        # Clipped as one vector, though lax.switch clamps its index too: switching on a scalar slice
        # of top_k's indices makes XLA CPU run that top_k as a whole sort (tools/step_profile.py).
        chosen = jnp.clip(experts[0], 0, len(run) - 1)
        return sum(weights[0, k].astype(x.dtype) * jax.lax.switch(chosen[k], run, x) for k in range(len(chosen)))
    combine = (jax.nn.one_hot(experts, len(gate), dtype=x.dtype) * weights[..., None].astype(x.dtype)).sum(axis=1)
    chosen = (combine != 0).any(axis=0)  # [E]
    out = jnp.zeros_like(x)
    for e, expert in enumerate(run):
        def every_row(out, e=e, expert=expert):
            return out + combine[:, e:e + 1] * expert(x)

        out = jax.lax.cond(chosen[e], every_row, lambda out: out, out)
    return out


def gathered_experts(x, weights, experts, gate, up, down, limit=None):
    """Few tokens (decode): fetch each token's K experts' weights and apply them directly, which
    avoids the sort/scatter of the grouped path. Same arguments and result as `local_experts`."""
    def pick(w):  # [N, K, ., .]; FP8 weights: only the picked experts are dequantized
        if isinstance(w, QuantizedWeight):
            return w.replace(value=w.value[experts], scale=w.scale[experts]).dequantize(x.dtype)
        return w[experts].astype(x.dtype)

    w_gate, w_up, w_down = pick(gate), pick(up), pick(down)
    h = gated(jnp.einsum("nd,nkid->nki", x, w_gate), jnp.einsum("nd,nkid->nki", x, w_up), limit)
    y = jnp.einsum("nki,nkdi->nkd", h, w_down)
    return jnp.einsum("nkd,nk->nd", y, weights.astype(y.dtype))


def local_experts(x, weights, experts, gate, up, down, first, num_experts, limit=None):
    """The contribution of experts first..first+G-1 (G = gate.shape[0]) to every token.

    x [N, D]; weights/experts [N, K]; gate/up [G, I, D], down [G, D, I] -> [N, D]. Token copies are
    sorted so that those of these experts come first, grouped by expert; copies for other experts
    fall past the groups and contribute zero.
    """
    n, k = experts.shape
    local = (experts.reshape(-1) - first) % num_experts  # these experts -> 0..G-1
    order = jnp.argsort(local, stable=True)
    sizes = jnp.bincount(local, length=num_experts)[:gate.shape[0]]
    sorted_x = x[order // k]
    h = gated(grouped_linear(sorted_x, gate, sizes), grouped_linear(sorted_x, up, sizes), limit)
    y = grouped_linear(h, down, sizes)
    y = jnp.where((jnp.arange(n * k) < sizes.sum())[:, None], y, 0)
    y = jnp.zeros_like(y).at[order].set(y).reshape(n, k, -1)  # back to token order
    return jnp.einsum("nkd,nk->nd", y, weights.astype(y.dtype))


def expert_parallel_mesh(config: ModelConfig, gate):
    """The context mesh (`jax.set_mesh`) when experts run expert/tensor-parallel, else None: needs
    mesh axes that split the experts (jaxmtp.sharding.expert_axes) or a tensor axis > 1 that
    divides the intermediate size (in whole FP8 blocks for kept FP8 weights). None without a
    context mesh (one device; weights placed on a mesh are refused there,
    jaxmtp.sharding.context_mesh). On a mesh of several devices that cannot run them so, a
    ShardingWarning names the axis and why (once per distinct message, as Python shows warnings),
    and XLA's partitioner runs the experts as it sees fit."""
    mesh = context_mesh(gate, "MoE experts")
    if mesh.empty or mesh.size == 1:
        return None
    reason = serial_experts_reason(config, gate, mesh)
    if reason is None:
        return mesh
    sizes = " x ".join(f"{axis}={size}" for axis, size in mesh.shape.items())
    warnings.warn(f"on the mesh {sizes}, the routed experts run without expert or tensor parallelism: {reason}; "
                  "XLA partitions them itself, which may gather every expert's weights onto each device",
                  ShardingWarning, stacklevel=2)
    return None


def serial_experts_reason(config: ModelConfig, gate, mesh) -> str | None:
    """Why the routed experts cannot run expert/tensor-parallel on `mesh` (a sentence naming the
    axis), or None where they can."""
    tensor, size, experts = mesh.shape.get("tensor", 1), config.moe_intermediate_size, config.n_routed_experts
    if size % tensor:
        return f"moe_intermediate_size {size} is not divisible by tensor={tensor}"
    if isinstance(gate, QuantizedWeight) and tensor > 1 and (size // tensor) % gate.block[0]:
        return (f"moe_intermediate_size {size} / tensor={tensor} = {size // tensor} rows per device would cut "
                f"the FP8 weights' {gate.block[0]}-row scale blocks")
    if not expert_axes(mesh, experts) and tensor == 1:
        axes = [f"{axis}={mesh.shape[axis]}" for axis in ("data", "expert") if mesh.shape.get(axis, 1) > 1]
        return f"n_routed_experts {experts} is not divisible by {' or '.join(axes)}, and there is no tensor axis"
    return None


def expert_parallel(mesh, x, weights, experts, gate, up, down, num_experts, limit=None):
    """Experts split over their mesh axes (`data` and `expert`, see jaxmtp.sharding) and their
    intermediate dim over `tensor`, in shard_map. Tokens split over `data` (each device's own
    rows, as attention left them) are first gathered over `data`; each device runs its own
    experts' slices on the token copies routed to them; the outputs are summed over the expert
    and tensor axes and each device keeps its own rows' sums (a reduce-scatter over `data`)."""
    axes = expert_axes(mesh, num_experts)
    split_rows = "data" in mesh.shape and x.shape[0] % mesh.shape["data"] == 0 and mesh.shape["data"] > 1
    tokens = P("data") if split_rows else P()
    gathered = split_rows and "data" in axes  # the experts of these rows live on other data shards too

    def shard(x, weights, experts, gate, up, down):
        if gathered:
            x, weights, experts = (jax.lax.all_gather(a, "data", axis=0, tiled=True) for a in (x, weights, experts))
        first = (jax.lax.axis_index(axes) if axes else 0) * gate.shape[0]
        out = local_experts(x, weights, experts, gate, up, down, first, num_experts, limit)
        out = jax.lax.psum(out, tuple(a for a in axes if a != "data" or not gathered) + ("tensor",))
        return jax.lax.psum_scatter(out, "data", scatter_dimension=0, tiled=True) if gathered else out

    def weight_spec(w, spec):  # FP8 weights: values and block scales are cut alike
        return w.replace(value=spec, scale=spec) if isinstance(w, QuantizedWeight) else spec

    split = axes or None
    in_specs = (tokens, tokens, tokens, weight_spec(gate, P(split, "tensor")), weight_spec(up, P(split, "tensor")),
                weight_spec(down, P(split, None, "tensor")))
    # check_vma off: the FP8 Pallas kernels inside do not declare how their outputs vary over the mesh.
    return jax.shard_map(shard, mesh=mesh, out_specs=tokens, in_specs=in_specs, check_vma=False)(
        x, weights, experts, gate, up, down)


class MoE(nn.Module):
    """Routed experts + shared experts. x [B, T, D] -> [B, T, D]."""

    config: ModelConfig
    dtype: Dtype = jnp.float32
    layout: Layout = CHECKPOINT

    def setup(self):
        c = self.config
        self.gate = Router(c, self.dtype, self.layout)
        self.experts = Experts(c, self.dtype, self.layout)
        if c.n_shared_experts:
            self.shared_experts = MLP(c, c.moe_intermediate_size * c.n_shared_experts, self.dtype, layout=self.layout)

    def __call__(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = self.gate(flat)
        # Tokens per expert, for the aux-loss-free bias update in training (kept only when the
        # "intermediates" collection is mutable).
        self.sow("intermediates", "expert_load", jnp.bincount(experts.reshape(-1), length=self.config.n_routed_experts))
        out = self.experts(flat, weights, experts).reshape(x.shape)
        if self.config.n_shared_experts:
            out = out + self.shared_experts(x)
        return out
