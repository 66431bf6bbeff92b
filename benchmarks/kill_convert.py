"""kill -9 during `jaxmtp.checkpoint.convert(..., overwrite=True)`: is the destination always whole?

Converts the bundled demo model into a destination that already holds a different checkpoint
(random weights of the same shapes, in the other format), killing the converting process with
SIGKILL 0.5 s, 1.0 s, 1.5 s, ... after it starts (process start and imports included), each time
into a fresh copy of the old destination, until one run finishes before its kill. After each kill it
loads the destination and prints whether it holds the old checkpoint, the new one, or neither
(BROKEN: it fails to load or has other weights), and what the killed process left beside it.

    python benchmarks/kill_convert.py [--interval 0.5] [--format hf|orbax]
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import jaxmtp
from jaxmtp.params import abstract_params

CHILD = "import sys; from jaxmtp.checkpoint import convert; convert(sys.argv[1], sys.argv[2], sys.argv[3], overwrite=True)"
LIMIT_S = 300  # a convert of the demo model takes seconds; past this the child is taken to hang


def random_model(config, seed):
    """Random parameters in the checkpoint layout (numpy draws: nothing to compile)."""
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda t: jnp.asarray(rng.standard_normal(t.shape), t.dtype), abstract_params(config))
    return jaxmtp.Model(config, params)


def same_params(a, b):
    leaves_a, tree_a = jax.tree.flatten(a.params)
    leaves_b, tree_b = jax.tree.flatten(b.params)
    return tree_a == tree_b and all(
        x.dtype == y.dtype and np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
        for x, y in zip(leaves_a, leaves_b))


def run_until(dst, format, kill_after):
    """Converts the demo model into `dst`, killed with SIGKILL after `kill_after` seconds unless it
    finishes first; True when it finished."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    child = subprocess.Popen([sys.executable, "-c", CHILD, jaxmtp.DEMO_MODEL, dst, format], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        errors = child.communicate(timeout=kill_after)[1]
    except subprocess.TimeoutExpired:
        child.send_signal(signal.SIGKILL)
        child.communicate()
        return False
    if child.returncode != 0:
        raise SystemExit(f"the convert failed on its own (exit {child.returncode}):\n{errors}")
    return True


def state(dst, old, new):
    """"old", "new" or "BROKEN" (fails to load, or holds neither checkpoint's weights)."""
    try:
        found = jaxmtp.load(dst, quiet=True, check_finite=False)  # every bit is compared below
    except Exception as e:  # any failure to load is what this benchmark looks for
        return f"BROKEN ({type(e).__name__}: {e})"
    return "old" if same_params(found, old) else "new" if same_params(found, new) else "BROKEN (other weights)"


def leftovers(parent, name):
    """What lies beside the destination: temporaries of the killed save, with their file counts."""
    found = []
    for entry in sorted(os.listdir(parent)):
        if entry != name:
            files = sum(len(names) for _, _, names in os.walk(os.path.join(parent, entry)))
            found.append(f"{entry} ({files} files)")
    return ", ".join(found) or "-"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between kill moments")
    parser.add_argument("--format", choices=("hf", "orbax"), default="hf", help="format the demo model is converted to")
    args = parser.parse_args()
    new = jaxmtp.load(jaxmtp.DEMO_MODEL, quiet=True, check_finite=False)
    old = random_model(new.config, seed=1)
    counts = collections.Counter()
    with tempfile.TemporaryDirectory(prefix="jaxmtp-kill-convert-") as work:
        pristine, parent = os.path.join(work, "old"), os.path.join(work, "out")
        jaxmtp.save(old, pristine, format="orbax" if args.format == "hf" else "hf")
        dst = os.path.join(parent, "dst")
        print(f"demo model -> {args.format}, over an old {'orbax' if args.format == 'hf' else 'hf'} checkpoint")
        print(f"{'killed at':>14}  {'state':<8}  left beside the destination")
        for step in range(1, int(LIMIT_S / args.interval) + 1):
            shutil.rmtree(parent, ignore_errors=True)
            shutil.copytree(pristine, dst)
            finished = run_until(dst, args.format, step * args.interval)
            found = state(dst, old, new)
            moment = f"{step * args.interval:.1f} s" if not finished else f"(ran < {step * args.interval:.1f} s)"
            print(f"{moment:>14}  {found:<8}  {leftovers(parent, 'dst')}", flush=True)
            if finished:
                break
            counts[found.split()[0]] += 1
        else:
            raise SystemExit(f"the convert did not finish within {LIMIT_S} s")
    print(f"{sum(counts.values())} kills: " + ", ".join(f"{k} {counts[k]}" for k in ("old", "new", "BROKEN"))
          + f"; uninterrupted: {found}")


if __name__ == "__main__":
    main()
