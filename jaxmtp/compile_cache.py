"""JAX's persistent compilation cache, so that generation compiles once per machine, not per process.

`enable()` (called by `jaxmtp.generation.prepare`) points JAX at a cache directory:
$JAXMTP_COMPILE_CACHE if it names one, else $JAXMTP_CACHE_DIR/xla (default ~/.cache/jaxmtp/xla).
JAXMTP_COMPILE_CACHE=0 (or off, false, no) leaves it off, and a cache directory the user has given
JAX already (jax_compilation_cache_dir) is used as it is. JAX keys every entry by the program, the
jaxlib version, the backend and its version, the XLA flags, the compile options and the devices, so
an executable is never reused for another device, version or flag set; a program holding host
callbacks is never stored.
"""

from __future__ import annotations

import os

import jax

from jaxmtp import calibration

ENV = "JAXMTP_COMPILE_CACHE"
MIN_COMPILE_SECONDS = 0.2  # programs that compile faster are not worth a file


def directory() -> str | None:
    """Where jaxmtp keeps compiled programs, or None when the cache is turned off."""
    value = os.environ.get(ENV, "").strip()
    if value.lower() in ("0", "off", "false", "no"):
        return None
    return value if value and value.lower() not in ("1", "on", "true", "yes") else os.path.join(
        calibration.cache_dir(), "xla")


def enable() -> str | None:
    """Turns the cache on (once; later calls only report) -> the directory in use, or None."""
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    path = directory()
    if path is None:
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return path
