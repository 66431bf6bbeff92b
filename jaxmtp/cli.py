"""The `jaxmtp` command line."""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxmtp import DEMO_MODEL


def _info(args):
    from jaxmtp.cache import bytes_per_token
    from jaxmtp.config import ModelConfig
    from jaxmtp.layout import CHECKPOINT
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
        _forward.lower(config, jnp.dtype(jnp.bfloat16), CHECKPOINT, params, tokens)
        mid = time.perf_counter()
        hidden = jax.ShapeDtypeStruct((args.batch, args.length, config.hidden_size), jnp.bfloat16)
        if config.has_mtp:
            _mtp_forward.lower(config, jnp.dtype(jnp.bfloat16), CHECKPOINT, params, hidden, tokens)
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
    return [tokenizer.encode(text).ids for text in (args.prompt or ["def fibonacci(n):"])]


def _tokenizer(model_dir):
    """The model directory's tokenizer.json as a `tokenizers.Tokenizer`, or None."""
    import os

    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.exists(path):
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def _bench(args):
    import json

    import jaxmtp
    from jaxmtp import bench, data

    model = jaxmtp.load(args.model, quiet=True)
    if args.tokens:
        prompts = _prompts(args, None)
        source = "--tokens"
    else:
        tokenizer = _tokenizer(args.model)
        if tokenizer is None:
            raise SystemExit("this model has no tokenizer.json: pass prompts with --tokens")
        held_out = data.encode(tokenizer, data.read(data.source_files()[1]))
        prompts = data.prompts_from(held_out, args.prompts, args.prompt_len)
        source = f"{args.prompts} held-out standard-library prompts of {args.prompt_len} tokens"
    ks = [int(k) for k in args.ks.split(",")]
    rows = bench.run(model, prompts, ks, args.max_new_tokens, args.repeats, auto=not args.no_auto)
    if args.json:
        print(json.dumps({"model": args.model, "prompts": source, "max_new_tokens": args.max_new_tokens,
                          "repeats": args.repeats, "platform": jax.devices()[0].platform, "rows": rows}, indent=2))
    else:
        print(f"{args.model}: {source}, batch 1, greedy, {args.max_new_tokens} new tokens each, "
              f"{jax.devices()[0].platform}; median of {args.repeats} runs, compile excluded; decode = without the "
              f"prefill; cost = a round in plain steps; ideal = mean len / cost")
        print(bench.table(rows))
    if args.plot:
        bench.plot(rows, args.plot)


def _generate(args):
    import jaxmtp
    from jaxmtp.generation import timed_generate

    kept = {} if args.matmul is None else {"quantized": "keep", "matmul": args.matmul}
    model = jaxmtp.load(args.model, quiet=args.quiet, **kept)
    tokenizer = _tokenizer(args.model)
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
        by_k = ", ".join(f"k={k}: {n}" for k, n in s["rounds_by_k"].items())
        print(f"k={args.k}: acceptance rate {s['acceptance_rate']:.3f}, mean accepted length "
              f"{s['mean_accepted_length']:.2f}, per position [{per_position}]; rounds {by_k}")
        if "round_costs" in s:
            print("round cost in plain steps at k = 0..: " + " ".join(f"{c:.2f}" for c in s["round_costs"]))
    print(f"main forward passes {s['main_forward_passes']} (incl. prefill), drafts {s['draft_tokens']}, "
          f"accepted {s['accepted_tokens']}")


def _k_value(text: str):
    """--k: "auto" or a whole number."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f'expected "auto" or a whole number, found {text!r}') from None


def _plan(args):
    import os

    sizes = {"data": 1, "expert": 1, "tensor": 1}
    for part in args.mesh.split(","):
        name, value = part.split("=")
        if name not in sizes:
            raise SystemExit(f"--mesh: unknown axis {name!r}; use data, expert, tensor")
        sizes[name] = int(value)
    count = sizes["data"] * sizes["expert"] * sizes["tensor"]
    # Emulate the mesh with host devices; XLA reads this when the backend starts, which is below.
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={count}"
    if jax.device_count() < count:
        raise SystemExit(f"--mesh needs {count} devices; this process has {jax.device_count()}")
    from jaxmtp.config import ModelConfig
    from jaxmtp.plan import plan, report

    figures = plan(ModelConfig.from_hf_config(args.config), **sizes, batch=args.batch, max_len=args.max_len,
                   prompt_len=args.prompt_len or args.max_len // 2, k=args.k, matmul=args.matmul)
    print(report(figures))


def _train(args):
    import dataclasses
    import json
    import os
    import shutil
    import sys

    import jaxmtp
    from jaxmtp import data
    from jaxmtp.config import ModelConfig
    from jaxmtp.train import TrainConfig, evaluate, train

    try:
        cfg = TrainConfig(steps=args.steps, batch=args.batch, seq_len=args.seq_len, learning_rate=args.lr,
                          seed=args.seed, mtp_only=args.mtp_only, mtp_depth=args.mtp_depth)
    except ValueError as e:
        raise SystemExit(f"jaxmtp train: {e}") from None
    os.makedirs(args.out, exist_ok=True)
    train_texts, held_texts = (data.read(files) for files in data.source_files())
    if args.mtp_only:
        if not args.init:
            raise SystemExit("--mtp-only needs --init PATH (the checkpoint whose MTP layer to fine-tune)")
        from tokenizers import Tokenizer

        model = jaxmtp.load(args.init, dtype="float32", quiet=args.quiet)
        tokenizer = Tokenizer.from_file(os.path.join(args.init, "tokenizer.json"))
    else:
        config = ModelConfig.from_hf_config(args.config)
        tokenizer = data.train_tokenizer(train_texts, config.vocab_size)
        model = jaxmtp.init(config, seed=args.seed)
    train_tokens, held_tokens = data.encode(tokenizer, train_texts), data.encode(tokenizer, held_texts)
    print(f"data: {len(train_texts)} training files, {len(train_tokens):,} tokens; held out "
          f"{', '.join(data.HELD_OUT_MODULES)}: {len(held_tokens):,} tokens")
    before = evaluate(model, held_tokens, args.seq_len) if args.mtp_only else None
    model, log = train(model, train_tokens, cfg, os.path.join(args.out, "train_log.jsonl"), quiet=args.quiet)
    after = evaluate(model, held_tokens, args.seq_len)
    jaxmtp.save(model, args.out, format="hf")
    tokenizer.save(os.path.join(args.out, "tokenizer.json"))
    record = {"command": "jaxmtp " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("jaxmtp") else None,
              "train_config": dataclasses.asdict(cfg), "data": {
                  "source": "Python standard library *.py (tests excluded)", "python": sys.version.split()[0],
                  "training_files": len(train_texts), "training_tokens": int(len(train_tokens)),
                  "held_out_modules": list(data.HELD_OUT_MODULES), "held_out_tokens": int(len(held_tokens))},
              "final_losses": log[-1], "held_out": after, "held_out_before": before}
    if args.init:
        record["init"] = args.init
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(record, f, indent=2, default=float)
    for name, figures in (("before", before), ("after", after)):
        if figures:
            print(f"held out ({name}): main loss {figures['main_loss']:.3f} (perplexity {figures['main_perplexity']:.1f}, "
                  f"top-1 {figures['main_top1']:.3f}), MTP loss {figures['mtp_loss']:.3f} (top-1 {figures['mtp_top1']:.3f}); "
                  f"unigram baseline loss {figures['unigram_loss']:.3f} (perplexity {figures['unigram_perplexity']:.1f})")
    if not args.mtp_only:
        shutil.copy(args.config, os.path.join(args.out, "source_config.json"))


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
    gen.add_argument("prompt", nargs="*", help='prompt text (needs the model\'s tokenizer.json); default "def fibonacci(n):"')
    gen.add_argument("--model", default=DEMO_MODEL, help="checkpoint directory (default: the bundled demo model)")
    gen.add_argument("--tokens", help='token ids instead of text: "1,2,3", several prompts separated by ";"')
    gen.add_argument("--k", type=_k_value, default="auto",
                     help='MTP drafts per round; 0 = plain decoding; "auto" (default): chosen as it goes, from '
                          "the measured cost of a round at each k on this machine and the acceptance so far")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at the config's eos_token_id")
    gen.add_argument("--matmul", choices=("fp8", "dequant"),
                     help="FP8 checkpoints: keep the weights in FP8 and multiply them with the W8A8 kernels (fp8) "
                          "or dequantize them on the fly (dequant); default: dequantize at load")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    gen.set_defaults(run=_generate)

    b = sub.add_parser("bench", help="plain vs speculative decoding side by side: tokens/s, speedup, acceptance")
    b.add_argument("--model", default=DEMO_MODEL, help="checkpoint directory (default: the bundled demo model)")
    b.add_argument("--tokens", help='prompts as token ids instead of held-out text: "1,2,3;4,5"')
    b.add_argument("--prompts", type=int, default=8, help="number of held-out prompts")
    b.add_argument("--prompt-len", type=int, default=32)
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--ks", default="1,2,3,4")
    b.add_argument("--no-auto", action="store_true", help='leave out speculative_k="auto"')
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--json", action="store_true", help="print JSON instead of the table")
    b.add_argument("--plot", help="write acceptance-by-position and speedup-by-k plots to this PNG")
    b.set_defaults(run=_bench)

    pl = sub.add_parser("plan", help="per-device memory of speculative generation on a mesh (AOT compile, abstract shapes)")
    pl.add_argument("--config", required=True, help="HF config.json (file or directory)")
    pl.add_argument("--mesh", default="tensor=8", help="e.g. expert=8,tensor=8 (axes data, expert, tensor)")
    pl.add_argument("--batch", type=int, default=8)
    pl.add_argument("--max-len", type=int, default=4096, help="cache length in tokens")
    pl.add_argument("--prompt-len", type=int, help="prompt bucket (default max-len / 2)")
    pl.add_argument("--k", type=int, default=2)
    pl.add_argument("--matmul", choices=("dequant", "fp8"), default="dequant",
                    help="how kept FP8 weights are multiplied (fp8: the W8A8 kernels, here lowered in interpret mode)")
    pl.set_defaults(run=_plan)

    tr = sub.add_parser("train", help="train a small DeepSeek-V3 + MTP on the standard library's source")
    tr.add_argument("--out", required=True, help="output checkpoint directory (HF layout + tokenizer.json)")
    tr.add_argument("--config", default="configs/demo.json", help="model config (HF config.json)")
    tr.add_argument("--steps", type=int, default=1200)
    tr.add_argument("--batch", type=int, default=16)
    tr.add_argument("--seq-len", type=int, default=256)
    tr.add_argument("--lr", type=float, default=3e-3)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--mtp-only", action="store_true", help="fine-tune only the MTP layer of --init")
    tr.add_argument("--init", help="checkpoint to start from (with --mtp-only)")
    tr.add_argument("--mtp-depth", type=int, default=1,
                    help="with --mtp-only: train this many chained drafting steps (draft j reads draft j-1's hidden state)")
    tr.add_argument("--quiet", action="store_true")
    tr.set_defaults(run=_train)

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
