"""The `jaxmtp` command line."""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np


def _info(args):
    from jaxmtp.cache import bytes_per_token
    from jaxmtp.config import ModelConfig
    from jaxmtp.model import _forward, _mtp_forward, abstract_params, parameter_counts

    config = ModelConfig.from_hf_config(args.config)
    counts = parameter_counts(config)
    print(f"parameters, main model:              {counts['main'] / 1e9:8.2f} B ({counts['main']:,})")
    print(f"parameters, unique to MTP:           {counts['mtp_unique'] / 1e9:8.2f} B ({counts['mtp_unique']:,})")
    print(f"parameters, MTP with embed/head copy:{counts['mtp_with_copies'] / 1e9:8.2f} B")
    per_token = bytes_per_token(config, jnp.bfloat16)
    layers = config.num_hidden_layers + config.num_nextn_predict_layers
    print(f"MLA cache, bf16: {per_token} B per token per layer, {per_token * layers:,} B per token "
          f"({layers} layers incl. MTP)")
    if args.lower:
        params = abstract_params(config, jnp.bfloat16)
        tokens = jax.ShapeDtypeStruct((args.batch, args.length), jnp.int32)
        start = time.perf_counter()
        _forward.lower(config, jnp.dtype(jnp.bfloat16), params, tokens)
        mid = time.perf_counter()
        hidden = jax.ShapeDtypeStruct((args.batch, args.length, config.hidden_size), jnp.bfloat16)
        if config.has_mtp:
            _mtp_forward.lower(config, jnp.dtype(jnp.bfloat16), params, hidden, tokens)
        end = time.perf_counter()
        print(f"jit(forward).lower on abstract bf16 parameters, batch {args.batch} x {args.length}: {mid - start:.1f} s")
        print(f"jit(mtp_forward).lower: {end - mid:.1f} s")


def _forward_demo(args):
    import jaxmtp
    from jaxmtp.config import ModelConfig

    if args.model:
        model = jaxmtp.load(args.model)
    else:
        model = jaxmtp.init(ModelConfig.from_hf_config(args.config), seed=args.seed)
    tokens = np.array([[int(t) for t in args.tokens.split(",")]])
    logits, hidden = model.forward(tokens)
    print(f"tokens: {tokens[0].tolist()}")
    print(f"main model, next-token argmax per position: {np.asarray(logits.argmax(-1))[0].tolist()}")
    if model.config.has_mtp:
        predicted = logits.argmax(-1)
        mtp_logits = model.mtp_forward(hidden, predicted)
        print(f"MTP module, token after next per position:  {np.asarray(mtp_logits.argmax(-1))[0].tolist()}")


def _convert(args):
    import jaxmtp

    start = time.perf_counter()
    model = jaxmtp.load(args.src, dtype=args.dtype, quantized=args.quantized)
    loaded = time.perf_counter()
    jaxmtp.save(model, args.dst, format=args.format)
    print(f"{args.src} -> {args.dst} ({args.format}, {model.dtype}): "
          f"load {loaded - start:.1f} s, save {time.perf_counter() - loaded:.1f} s")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="jaxmtp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="parameter counts and cache size of a config; optionally lower it")
    info.add_argument("--config", required=True, help="HF config.json (file or directory)")
    info.add_argument("--lower", action="store_true", help="time jax.jit(forward).lower on abstract parameters")
    info.add_argument("--batch", type=int, default=1)
    info.add_argument("--length", type=int, default=128)
    info.set_defaults(run=_info)

    fwd = sub.add_parser("forward", help="one forward pass (main + MTP) and the predicted tokens")
    fwd.add_argument("--model", help="checkpoint directory; default: random init of --config")
    fwd.add_argument("--config", default="configs/tiny.json")
    fwd.add_argument("--tokens", default="1,2,3,4,5,6,7,8")
    fwd.add_argument("--seed", type=int, default=0)
    fwd.set_defaults(run=_forward_demo)

    conv = sub.add_parser("convert", help="rewrite a checkpoint (HF, DeepSeek mp-sharded or orbax) as HF or orbax")
    conv.add_argument("src", help="checkpoint directory")
    conv.add_argument("dst", help="output directory")
    conv.add_argument("--format", choices=("hf", "orbax"), required=True)
    conv.add_argument("--dtype", help="dense parameter dtype (default: the source's)")
    conv.add_argument("--quantized", choices=("keep", "dequantize"), default="keep",
                      help="FP8 weights: keep them FP8 with their scales, or write dense --dtype weights")
    conv.set_defaults(run=_convert)

    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
