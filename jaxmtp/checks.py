"""Argument checks for the public API. Each names the argument and says what was expected and what
was found, so that a wrong value fails at the call, not as NaN logits or a trace error deep in JAX."""

from __future__ import annotations

import math
import numbers

import jax
import numpy as np

from jaxmtp.errors import ArgumentTypeError, InputError


def whole(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    """`value` as an int: a Python or numpy integer (not a bool) in [minimum, maximum]."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{name}: expected an integer, found {value!r} ({type(value).__name__})")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = f"{minimum}..{maximum}" if maximum is not None else f">= {minimum}"
        raise InputError(f"{name}: expected an integer {bounds}, found {value}")
    return value


def real(name: str, value, minimum: float, maximum: float = math.inf, above_minimum: bool = False) -> float:
    """`value` as a finite float in [minimum, maximum] ((minimum, maximum] with above_minimum)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name}: expected a number, found {value!r} ({type(value).__name__})")
    value = float(value)
    low_ok = value > minimum if above_minimum else value >= minimum
    if not (math.isfinite(value) and low_ok and value <= maximum):
        low = f"> {minimum}" if above_minimum else f">= {minimum}"
        bounds = low if maximum == math.inf else f"{low} and <= {maximum}"
        raise InputError(f"{name}: expected a finite number {bounds}, found {value}")
    return value


def prompts(value, vocab_size: int) -> list[list[int]]:
    """A batch of prompts as lists of ints. Accepts a list or tuple of token-id sequences (lists,
    tuples or 1-D integer arrays) or a 2-D integer array [batch, length]; each id in [0, vocab_size)."""
    if isinstance(value, (np.ndarray, jax.Array)):
        array = np.asarray(value)
        if array.ndim != 2:
            raise ArgumentTypeError(f"prompts: expected a 2-D array [batch, length] or a list of token-id lists, found an "
                            f"array of shape {array.shape}" + ("; for one prompt pass [ids]" if array.ndim == 1 else ""))
        value = list(array)
    if not isinstance(value, (list, tuple)):
        raise ArgumentTypeError(f"prompts: expected a list of token-id lists, found {type(value).__name__}")
    if not value:
        raise InputError("prompts: expected at least one prompt, found an empty list")
    if all(isinstance(t, numbers.Number) for t in value):
        raise ArgumentTypeError("prompts: expected a list of prompts (token-id lists), found a flat list of numbers; "
                        "for one prompt pass [[id, id, ...]]")
    return [_prompt(i, p, vocab_size) for i, p in enumerate(value)]


def _prompt(i: int, p, vocab_size: int) -> list[int]:
    if isinstance(p, (np.ndarray, jax.Array)):
        p = np.asarray(p)
        if p.ndim != 1 or not np.issubdtype(p.dtype, np.integer):
            raise ArgumentTypeError(f"prompts[{i}]: expected a 1-D integer array, found shape {p.shape} dtype {p.dtype}")
        p = p.tolist()
    if not isinstance(p, (list, tuple)):
        raise ArgumentTypeError(f"prompts[{i}]: expected a list of token ids, found {type(p).__name__}")
    if not p:
        raise InputError(f"prompts[{i}]: empty; every prompt needs at least one token")
    return [token_id(f"prompts[{i}][{j}]", t, vocab_size) for j, t in enumerate(p)]


def token_id(name: str, value, vocab_size: int) -> int:
    """One token id: an integer in [0, vocab_size)."""
    value = whole(name, value)
    if not 0 <= value < vocab_size:
        raise InputError(f"{name}: token id {value} outside the vocabulary [0, {vocab_size})")
    return value


def token_ids(name: str, value, vocab_size: int):
    """A [B, T] integer array of token ids in [0, vocab_size), as int32. Traced values (inside a
    caller's jit) and arrays spanning several processes are checked for shape and dtype only."""
    if not isinstance(value, jax.core.Tracer) and not (isinstance(value, jax.Array) and not value.is_fully_addressable):
        value = host_token_ids(name, value, vocab_size)
    elif not np.issubdtype(value.dtype, np.integer):
        raise ArgumentTypeError(f"{name}: expected integer token ids, found dtype {value.dtype}")
    if value.ndim != 2:
        raise InputError(f"{name}: expected shape [batch, length], found {tuple(value.shape)}")
    return jax.numpy.asarray(value, jax.numpy.int32)


def host_token_ids(name: str, value, vocab_size: int) -> np.ndarray:
    """token_ids' checks of a host value, which stays on the host: -> the ids as a numpy int32
    array of the value's shape. (Converting on the device would compile a program for each new
    shape: the serving engine checks every request's prompt with this.)"""
    value = np.asarray(value)
    if value.dtype == object or not np.issubdtype(value.dtype, np.integer):
        raise ArgumentTypeError(f"{name}: expected integer token ids, found dtype {value.dtype}")
    if value.size and not (0 <= value.min() and value.max() < vocab_size):
        bad = value[(value < 0) | (value >= vocab_size)].flat[0]
        raise InputError(f"{name}: token id {bad} outside the vocabulary [0, {vocab_size})")
    return value.astype(np.int32)


def eos_ids(value, vocab_size: int) -> tuple[int, ...]:
    """eos_token_id as a tuple of ids: None -> (), one id, or a list/tuple of ids."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        if not value:
            raise InputError("eos_token_id: expected an id or a non-empty list of ids, found an empty list")
        return tuple(token_id(f"eos_token_id[{i}]", v, vocab_size) for i, v in enumerate(value))
    return (token_id("eos_token_id", value, vocab_size),)


def stop_sequences(value, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """stop_token_ids: a list of non-empty token-id lists -> a tuple of tuples."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ArgumentTypeError(f"stop_token_ids: expected a list of token-id lists, found {type(value).__name__}")
    out = []
    for i, seq in enumerate(value):
        if not isinstance(seq, (list, tuple)):
            raise ArgumentTypeError(f"stop_token_ids[{i}]: expected a list of token ids, found {seq!r}; a single id "
                            "is [[id]] (or an eos_token_id)")
        if not seq:
            raise InputError(f"stop_token_ids[{i}]: empty; a stop sequence needs at least one token")
        out.append(tuple(token_id(f"stop_token_ids[{i}][{j}]", t, vocab_size) for j, t in enumerate(seq)))
    return tuple(out)


def stop_strings(value) -> tuple[str, ...]:
    """stop: a list of non-empty strings -> a tuple."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ArgumentTypeError(f"stop: expected a list of strings, found {value!r}")
    for i, s in enumerate(value):
        if not isinstance(s, str) or not s:
            raise InputError(f"stop[{i}]: expected a non-empty string, found {s!r}")
    return tuple(value)


def float_dtype(name: str, value):
    """A parameter dtype: float32, bfloat16 or float16 (given as a string or a dtype)."""
    try:
        dtype = np.dtype(jax.numpy.dtype(value))
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or dtype.name not in ("float32", "bfloat16", "float16"):
        raise InputError(f"{name}: expected float32, bfloat16 or float16, found {value!r}")
    return jax.numpy.dtype(dtype)
