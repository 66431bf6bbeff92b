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


def _prompts(args, tokenizer):
    """Prompts as token-id lists: text through the model's tokenizer, or --tokens "1,2,3;4,5"."""
    if args.tokens:
        return [[int(t) for t in row.split(",")] for row in args.tokens.split(";")]
    if tokenizer is None:
        raise SystemExit("this model has no tokenizer.json: pass token ids with --tokens 1,2,3")
    if not args.prompt:
        raise SystemExit("give a prompt (text) or --tokens")
    return [tokenizer.encode(text).ids for text in args.prompt]


def _generate(args):
    import os

    import jaxmtp
    from jaxmtp.generation import timed_generate

    model = jaxmtp.load(args.model, quiet=args.quiet)
    tokenizer = None
    if os.path.exists(os.path.join(args.model, "tokenizer.json")):
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    prompts = _prompts(args, tokenizer)
    eos = None if args.ignore_eos else model.config.eos_token_id
    out, compile_s, (run_s,) = timed_generate(
        model, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, speculative_k=args.k, eos_token_id=eos, seed=args.seed)
    for prompt, tokens in zip(prompts, out.tokens):
        if tokenizer is not None:
            print(tokenizer.decode(prompt) + tokenizer.decode(tokens))
        else:
            print(f"{prompt} -> {tokens}")
        print()
    new = sum(len(t) for t in out.tokens)
    s = out.stats
    print(f"{new} new tokens in {run_s:.3f} s: {new / run_s:.1f} tokens/s (compile {compile_s:.1f} s, not included)")
    if args.k:
        per_position = ", ".join(f"{a:.2f}" for a in s["per_position_acceptance"])
        print(f"k={args.k}: acceptance rate {s['acceptance_rate']:.3f}, mean accepted length "
              f"{s['mean_accepted_length']:.2f}, per position [{per_position}]")
    print(f"main forward passes {s['main_forward_passes']} (incl. prefill), drafts {s['draft_tokens']}, "
          f"accepted {s['accepted_tokens']}")


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

    gen = sub.add_parser("generate", help="generate text with plain or MTP speculative decoding")
    gen.add_argument("prompt", nargs="*", help="prompt text (needs the model's tokenizer.json)")
    gen.add_argument("--model", required=True, help="checkpoint directory")
    gen.add_argument("--tokens", help='token ids instead of text: "1,2,3", several prompts separated by ";"')
    gen.add_argument("--k", type=int, default=2, help="MTP drafts per round; 0 = plain decoding")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at the config's eos_token_id")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    gen.set_defaults(run=_generate)

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
