"""Benchmark results as JSON with their provenance, which `benchmarks/render.py` turns into docs.

Every result file holds what produced it: the date, the commit (and whether the tree had
uncommitted changes), a hash of the engine's files (`engine_sha256`, which tells whether figures
were measured on the engine a page describes even where git's record is missing or stale), the
jax/jaxlib/flax versions, the device, the XLA and JAX flags, the command line and the repeats,
beside the figures and the raw times they summarise.
"""

import datetime
import hashlib
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


# The packages whose code and files make the figures: a change to either makes earlier figures older
# than the code (benchmarks/render.py says so under each table).
ENGINE = ("jaxmtp", "pallas_kernels")
_NOT_ENGINE = ("__pycache__", "build", "dist")  # directories of generated files, as .gitignore lists them


def engine_sha256(root: str | None = None) -> str:
    """sha256 over the path and contents of every file under ENGINE (compiled bytecode, build
    output and hidden files left out) in `root`, the folder that holds both packages (by default
    the one this module was imported from: a checkout or site-packages)."""
    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for package in ENGINE:
        top = os.path.join(root, package)
        if not os.path.isdir(top):
            raise FileNotFoundError(f"engine_sha256: {top} is not a directory (root {root} lacks package {package})")
        for directory, subdirs, files in os.walk(top):
            subdirs[:] = sorted(d for d in subdirs if d not in _NOT_ENGINE and not d.startswith(".")
                                and not d.endswith(".egg-info"))
            for name in sorted(files):
                if name.startswith(".") or name.endswith(".pyc"):
                    continue
                path = os.path.join(directory, name)
                with open(path, "rb") as f:
                    content = hashlib.sha256(f.read()).hexdigest()
                digest.update(f"{os.path.relpath(path, root).replace(os.sep, '/')}\0{content}\n".encode())
    return digest.hexdigest()


def provenance(repeats: int, *, prompts_sha256: str | None = None) -> dict:
    """Where and how the figures were measured (the command is this process's own); prompts_sha256,
    where given, names the prompts' text (`jaxmtp.data.prompts_sha256`)."""
    import flax
    import jaxlib

    device = jax.devices()[0]
    commit = _git("rev-parse", "HEAD") or None  # None outside a git checkout (an installed package)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "uncommitted_changes": bool(_git("status", "--porcelain", "--untracked-files=no")) if commit else None,
        "engine_sha256": engine_sha256(),
        "versions": {"python": platform.python_version(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
                     "flax": flax.__version__},
        "device": {"platform": device.platform, "kind": device.device_kind, "count": jax.device_count(),
                   "cpu_cores": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "flags": {name: value for name, value in os.environ.items() if name.startswith(("XLA_", "JAX_"))},
        "command": " ".join([_program(), *sys.argv[1:]]),
        "repeats": repeats,
    }
    if prompts_sha256 is not None:
        result["prompts_sha256"] = prompts_sha256
    return result


def write(path: str, benchmark: str, figures, raw, repeats: int, *, prompts_sha256: str | None = None) -> dict:
    """Writes {benchmark, provenance, figures, raw} to path (JSON) and returns it; prompts_sha256 as
    in `provenance`."""
    result = {"benchmark": benchmark, "provenance": provenance(repeats, prompts_sha256=prompts_sha256),
              "figures": figures, "raw": raw}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    return result
