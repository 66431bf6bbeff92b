"""Held-out evaluation of a model trained by `jaxmtp train` (default: the bundled demo model).

Teacher-forced over the held-out standard-library modules: main-model loss, perplexity and top-1
accuracy; the MTP module's loss and top-1 accuracy at predicting the token after next; and the
unigram baseline (token frequencies of the held-out text itself, a generous baseline).

    python benchmarks/evaluate.py [--model DIR]
"""

import argparse
import os

from tokenizers import Tokenizer

import jaxmtp
from jaxmtp import data
from jaxmtp.train import evaluate


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=jaxmtp.DEMO_MODEL)
    args = parser.parse_args()
    model = jaxmtp.load(args.model, quiet=True)
    tokenizer = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    tokens = data.held_out_tokens(tokenizer)
    r = evaluate(model, tokens)
    print(f"held out: {', '.join(data.HELD_OUT_MODULES)} ({r['tokens']:,} tokens scored)")
    print(f"main model      loss {r['main_loss']:.3f}  perplexity {r['main_perplexity']:7.1f}  top-1 {r['main_top1']:.3f}")
    print(f"MTP (t+2)       loss {r['mtp_loss']:.3f}  perplexity {2.718281828 ** r['mtp_loss']:7.1f}  top-1 {r['mtp_top1']:.3f}")
    print(f"unigram         loss {r['unigram_loss']:.3f}  perplexity {r['unigram_perplexity']:7.1f}")


if __name__ == "__main__":
    main()
