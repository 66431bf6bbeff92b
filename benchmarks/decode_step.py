"""What one decode step costs at T rows: the main model's forward and one MTP pass, each timed as a
jitted `fori_loop` of `--calls` calls with the cache carried (so dispatch is excluded), batch 1.

A speculative round with k drafts runs the main forward at T = k + 1, the MTP layer k - 1 times at
T = 1 and once at T = k + 1 (the repair pass); plain decoding runs the main forward at T = 1. These
figures therefore bound the speedup a given acceptance can give on the machine that runs them.

    python benchmarks/decode_step.py [--model DIR | --config CONFIG_JSON] [--calls 200] [--rows 1,2,3,4,5]
                                     [--cache-len 128] [--start 40] [--tokens fixed|varied]
                                     [--positions fixed|advancing]
                                     [--experts decode|split|stacked]
                                     [--prefix-attention decode|on|off]

--config times a model of that architecture with random weights (seed 0): how the cost of extra rows
depends on a model's size and shape (e.g. weights too big for the CPU's caches, dense or MoE).
The rows of a call carry different tokens, so that they route to different experts as text does;
with --tokens varied every call also feeds new ones, and with --positions advancing every call writes
and reads the cache at positions one further on, as generation does (see step_loops).
--experts forces the routed experts' arrangement of the decode layout (one conditional per expert,
or the stack that few tokens gather from) instead of the one it picks for this platform, and
--prefix-attention whether attention reads only a prefix of the cache (--start: the position of
each call's first row, --cache-len: the slots).

The loops here are shared: tools/decode_compare.py times this tree's main forward against an
earlier commit's with them, tools/step_profile.py traces them, benchmarks/sparse_attention.py
times V3 against V3.2 with them.
"""

import argparse
import dataclasses

import jax
import jax.numpy as jnp

import jaxmtp
from jaxmtp.cache import MLACache
# The fallbacks import an older engine's names, so that tools/decode_compare.py (and PYTHONPATH
# pointing at an older checkout) can time that engine with these same loops.
try:
    from jaxmtp.decoding import Static, empty_caches, main_forward, mtp_step
except ImportError:  # engines before jaxmtp.decoding kept the loop's pieces in jaxmtp.generation
    from jaxmtp.generation import Static, _empty_caches as empty_caches, _main as main_forward, _mtp as mtp_step
try:
    from jaxmtp.params import parameter_counts
except ImportError:  # engines before jaxmtp.params kept it in jaxmtp.model
    from jaxmtp.model import parameter_counts
from jaxmtp.sampling import SamplingMode
from timing import median_seconds


def microseconds_per_call(loop, args, calls):
    return median_seconds(jax.jit(loop), args, repeats=5) / calls * 1e6


def step_loops(static, rows, calls, start=40, tokens="fixed", positions="fixed"):
    """(main loop, MTP loop): each feeds `rows` tokens at positions start.. per call, `calls` times.
    The tokens fed depend on the previous call's output so that no call can be skipped.

    positions="fixed": every call at the same positions, which XLA may treat as constants (the
    cache is written at the same slots, the attention mask is the same every call).
    positions="advancing": call i at start + i mod 32 (within the cache), so that every call
    writes new slots and computes its mask and rotary angles, as generation does.

    tokens="fixed": every call feeds the same tokens (but for that dependence), so every call routes
    to the same experts and reads the same weights, which stay in the CPU's caches if they fit.
    tokens="varied": each call feeds new random tokens, so the experts it reads change from call to
    call as they do in generation, and over a few calls the loop reads every expert's weights."""
    first = start + jnp.arange(rows, dtype=jnp.int32)[None]
    span = max(1, min(32, static.cache_len - start - rows + 1)) if positions == "advancing" else 1
    at = lambda i: first + i % span  # noqa: E731
    spread = jnp.arange(rows, dtype=jnp.int32)[None] * 131  # a different token in every row
    vocab = static.config.vocab_size
    table = None if tokens == "fixed" else jax.random.randint(jax.random.key(7), (calls, 1, rows), 0, vocab, jnp.int32)

    def fed(acc, i):
        base = spread + 5 if table is None else table[i]
        return (base + acc.astype(jnp.int32) % 2) % vocab

    def main_loop(params, caches):
        def body(i, carry):
            caches, acc = carry
            tokens = fed(acc, i)
            logits, _, caches = main_forward(static, params, tokens, at(i), caches, absorbed=True)
            return caches, acc + logits[0, 0, 0]
        return jax.lax.fori_loop(0, calls, body, (caches, jnp.float32(0)))[1]

    def mtp_loop(params, cache):
        def body(i, carry):
            cache, acc = carry
            tokens = fed(acc, i)
            hidden = jnp.ones((1, rows, static.config.hidden_size), static.dtype) * acc
            logits, _, cache = mtp_step(static, params, hidden, tokens, at(i), cache, absorbed=True)
            return cache, acc + logits[0, 0, 0] * 1e-6
        return jax.lax.fori_loop(0, calls, body, (cache, jnp.float32(0)))[1]

    return main_loop, mtp_loop


def add_model_arguments(parser):
    """The model and the cache: what this script, tools/step_profile.py and tools/decode_compare.py time."""
    parser.add_argument("--model", default=jaxmtp.DEMO_MODEL)
    parser.add_argument("--config", help="an HF config.json: random weights of that architecture instead of --model")
    parser.add_argument("--cache-len", type=int, default=128, help="cache slots (the bucket a generation would use)")
    parser.add_argument("--start", type=int, default=40, help="position of each call's first row")
    parser.add_argument("--tokens", choices=("fixed", "varied"), default="fixed",
                        help="the same tokens every call, or new random ones each call (see step_loops)")
    parser.add_argument("--positions", choices=("fixed", "advancing"), default="fixed",
                        help="every call at the same positions, or one further on each call (see step_loops)")
    parser.add_argument("--prefix-attention", choices=("decode", "on", "off"), default="decode",
                        help="attention over a prefix of the cache as the decode layout picks it here, or forced")
    parser.add_argument("--experts", choices=("decode", "split", "stacked"), default="decode",
                        help="routed experts as the decode layout picks them here, or forced")


def decoding_model(args):
    """The model of --model / --config in its decode layout, with what --experts and
    --prefix-attention force."""
    if args.config:
        model = jaxmtp.init(jaxmtp.ModelConfig.from_hf_config(args.config))
    else:
        model = jaxmtp.load(args.model, quiet=True)
    forced = {name: getattr(args, name) == choice for name, choice in
              (("experts", "split"), ("prefix_attention", "on")) if getattr(args, name) != "decode"}
    if forced:
        from jaxmtp.layout import decode_layout

        layout = decode_layout(model.config, model.params)
        fields = {"split_experts" if name == "experts" else name: value for name, value in forced.items()}
        model = model.with_layout(dataclasses.replace(layout, **fields))
    return model.decoding() if hasattr(model, "decoding") else model


def plain_static(model, cache_len):
    """The decoding loop's static configuration for plain greedy steps over `cache_len` slots."""
    fields = dict(config=model.config, dtype=model.dtype, k=0, mode=SamplingMode.of(0.0, 0, 1.0), cache_len=cache_len,
                  layout=getattr(model, "layout", None))  # an older engine's Static has no layout
    return Static(**{name: value for name, value in fields.items() if name in Static.__dataclass_fields__})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rows", default="1,2,3,4,5")
    args = parser.parse_args()
    model = decoding_model(args)
    counts = parameter_counts(model.config)
    parameters = counts["main"] + counts["mtp_unique"]
    static = plain_static(model, args.cache_len)
    print(f"{args.config or args.model} ({parameters / 1e6:.1f}M parameters, {model.dtype.name}) on "
          f"{jax.devices()[0].device_kind}, {getattr(model, 'layout', 'checkpoint layout')}: microseconds per call, "
          f"median of 5 loops of {args.calls} calls")
    main, mtp = {}, {}
    for rows in (int(r) for r in args.rows.split(",")):
        main_loop, mtp_loop = step_loops(static, rows, args.calls, args.start, args.tokens, args.positions)
        main[rows] = microseconds_per_call(main_loop, (model.params, empty_caches(static, 1)), args.calls)
        mtp_cache = MLACache.zeros(model.config, None, 1, args.cache_len, model.dtype)
        mtp[rows] = microseconds_per_call(mtp_loop, (model.params, mtp_cache), args.calls)
        print(f"T={rows}: main forward {main[rows]:8.1f}   MTP pass {mtp[rows]:7.1f}", flush=True)
    # A round at k: main forward at k + 1 rows, k - 1 MTP drafts at 1 row, the repair at k + 1 rows.
    ks = [k for k in range(1, 9) if {1, k + 1} <= main.keys()]
    if ks:
        costs = [(main[k + 1] + (k - 1) * mtp[1] + mtp[k + 1]) / main[1] for k in ks]
        print("round at k in plain steps (these passes only, without the loop's bookkeeping): "
              + "  ".join(f"k={k} {c:.2f}" for k, c in zip(ks, costs)))


if __name__ == "__main__":
    main()
