"""How far W8A8 (matmul="fp8") moves a model from its float32-dequantized self.

By default the trained demo model is quantized to a 128x128 block-scaled FP8 checkpoint (as
DeepSeek-V3 publishes its weights), so both paths multiply the very same FP8 weights and differ only
by the per-token 1x128 e4m3 activation quantization. Prints the logits' relative error, greedy
decision agreement along the FP8 model's own generations, and how many positions of the
free-running greedy sequences coincide.

    python benchmarks/fp8_accuracy.py [--model FP8_CHECKPOINT] [--prompts 20] [--new-tokens 32]
"""

import argparse
import os
import tempfile

import numpy as np
from tokenizers import Tokenizer

import jaxmtp
from jaxmtp import data
from jaxmtp.config import QuantizationConfig
from jaxmtp.quant import quantize_params


def fp8_demo(directory):
    demo = jaxmtp.load(jaxmtp.DEMO_MODEL, quiet=True)
    config = demo.config.replace(quantization=QuantizationConfig())
    jaxmtp.save(jaxmtp.Model(config, quantize_params(demo.params)), directory)
    return directory


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="an FP8 checkpoint with the demo's vocabulary (default: the demo model quantized to FP8)")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        path = args.model or fp8_demo(scratch)
        fp8 = jaxmtp.load(path, quantized="keep", matmul="fp8", quiet=True)
        dense = jaxmtp.load(path, dtype="float32", quantized="dequantize", quiet=True)
    tokenizer = Tokenizer.from_file(os.path.join(jaxmtp.DEMO_MODEL, "tokenizer.json"))
    prompts = data.held_out_prompts(tokenizer, args.prompts, args.prompt_len)
    got, want = (np.asarray(m.forward(np.array(prompts))[0]) for m in (fp8, dense))
    print(f"{args.prompts} held-out prompts of {args.prompt_len} tokens, logits of every position:")
    print(f"  relative error |fp8 - dequant|_F / |dequant|_F = {np.linalg.norm(got - want) / np.linalg.norm(want):.4f}")
    print(f"  max |fp8 - dequant| / max |dequant| = {np.abs(got - want).max() / np.abs(want).max():.4f}")
    print(f"  top-1 agreement (teacher-forced) = {(got.argmax(-1) == want.argmax(-1)).mean():.4f}")
    fp8_tokens = jaxmtp.generate(fp8, prompts, max_new_tokens=args.new_tokens).tokens
    dense_tokens = jaxmtp.generate(dense, prompts, max_new_tokens=args.new_tokens).tokens
    sequences = np.array([p + g for p, g in zip(prompts, fp8_tokens)])
    decisions = np.asarray(dense.forward(sequences)[0])[:, args.prompt_len - 1:-1].argmax(-1)
    agree = (decisions == sequences[:, args.prompt_len:]).mean()
    same = np.mean([a == b for x, y in zip(fp8_tokens, dense_tokens) for a, b in zip(x, y)])
    print(f"greedy, {args.prompts} x {args.new_tokens} new tokens:")
    print(f"  float32 model's decision = fp8 model's token, along the fp8 generations: {agree:.4f}")
    print(f"  free-running sequences equal position by position: {same:.4f}")


if __name__ == "__main__":
    main()
