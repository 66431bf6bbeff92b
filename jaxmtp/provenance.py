"""Benchmark results as JSON with their provenance, which `benchmarks/render.py` turns into docs.

Every result file holds what produced it: the date, the commit (and whether the tree had
uncommitted changes), the jax/jaxlib/flax versions, the device, the XLA and JAX flags, the command
line and the repeats, beside the figures and the raw times they summarise.
"""

import datetime
import json
import os
import platform
import subprocess
import sys

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout, where there is one


def _git(*args) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def _program() -> str:
    """How this process was started: `jaxmtp` for the console script, else python and the script's
    path within the checkout."""
    name = os.path.basename(sys.argv[0])
    if name in ("jaxmtp", "cli.py", "__main__.py"):
        return "jaxmtp"
    return "python " + os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)


def provenance(repeats: int) -> dict:
    """Where and how the figures were measured (the command is this process's own)."""
    import flax
    import jaxlib

    device = jax.devices()[0]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _git("rev-parse", "HEAD") or None,
        "uncommitted_changes": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "versions": {"python": platform.python_version(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
                     "flax": flax.__version__},
        "device": {"platform": device.platform, "kind": device.device_kind, "count": jax.device_count(),
                   "cpu_cores": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "flags": {name: value for name, value in os.environ.items() if name.startswith(("XLA_", "JAX_"))},
        "command": " ".join([_program(), *sys.argv[1:]]),
        "repeats": repeats,
    }


def write(path: str, benchmark: str, figures, raw, repeats: int) -> dict:
    """Writes {benchmark, provenance, figures, raw} to path (JSON) and returns it."""
    result = {"benchmark": benchmark, "provenance": provenance(repeats), "figures": figures, "raw": raw}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    return result
