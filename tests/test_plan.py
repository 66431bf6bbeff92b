"""`jaxmtp plan`'s memory limits and decode loops, without compiling: the limit JAX's allocator sets
on each device from the environment, the setting a plan that does not fit is told, and the loops a
plan compiles against what `generate` compiles (the compiling plan tests are in test_mesh.py)."""

import os
import re

import jax
import pytest

import generation_models as gm
import jaxmtp
from jaxmtp import generation
from jaxmtp.cli import main
from jaxmtp.errors import InputError
from jaxmtp.plan import (DEVICES, SAMPLING, AllocatorSettings, Device, Loop, abstract_inputs, allocator_settings,
                         default_loops, memory_limit)
from jaxmtp.sampling import SamplingMode
from jaxmtp.sharding import make_mesh

GPU_SETTINGS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE",
                "XLA_PYTHON_CLIENT_ALLOCATOR")


@pytest.fixture
def env(monkeypatch):
    """This process's environment without JAX's GPU memory settings; set them with env.setenv."""
    for name in GPU_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_default_limit_is_three_quarters_of_a_gpu_and_all_of_a_tpu(env):
    h200 = memory_limit(DEVICES["h200"], allocator_settings())
    assert h200.bytes == pytest.approx(0.75 * 141e9)
    assert "H200 (141 GB): allocator limit 105.75 GB = 0.75 x 141 GB (XLA_CLIENT_MEM_FRACTION unset" in h200.describe()
    assert memory_limit(DEVICES["h100"], allocator_settings()).bytes == pytest.approx(0.75 * 80e9)
    v5p = memory_limit(DEVICES["v5p"], allocator_settings())
    assert v5p.bytes == pytest.approx(95e9) and "TPU" in v5p.describe()


@pytest.mark.parametrize("variable", ["XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"])
def test_an_explicit_fraction_sets_the_limit_and_is_the_setting_named(env, variable):
    env.setenv(variable, ".9")
    limit = memory_limit(DEVICES["h200"], allocator_settings())
    assert limit.bytes == pytest.approx(0.9 * 141e9)
    assert f"126.90 GB = 0.9 x 141 GB ({variable}=0.9)" in limit.describe()
    assert f"fits with {variable}=" in limit.verdict(0.92 * 141e9)
    # A TPU's memory is not JAX's GPU allocator's to limit.
    assert memory_limit(DEVICES["v6e"], allocator_settings()).bytes == pytest.approx(32e9)


def test_without_preallocation_the_pool_grows_to_the_same_limit(env):
    env.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    limit = memory_limit(DEVICES["h200"], allocator_settings())
    assert limit.bytes == pytest.approx(0.75 * 141e9) and "XLA_PYTHON_CLIENT_PREALLOCATE=false" in limit.describe()
    env.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    assert memory_limit(DEVICES["h200"], allocator_settings()).bytes == pytest.approx(0.5 * 141e9)


def test_the_platform_allocator_has_no_pool(env):
    env.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
    limit = memory_limit(DEVICES["h100"], allocator_settings())
    assert limit.bytes == pytest.approx(80e9) and "platform" in limit.describe()
    assert limit.verdict(81e9).startswith("does not fit") and "=" not in limit.verdict(81e9)


@pytest.mark.parametrize("settings, named", [
    ({"XLA_CLIENT_MEM_FRACTION": "0.8", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}, "XLA_PYTHON_CLIENT_MEM_FRACTION"),
    ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "most"}, "XLA_PYTHON_CLIENT_MEM_FRACTION=most"),
    ({"XLA_CLIENT_MEM_FRACTION": "1.5"}, "XLA_CLIENT_MEM_FRACTION=1.5"),
    ({"XLA_PYTHON_CLIENT_ALLOCATOR": "pool"}, "XLA_PYTHON_CLIENT_ALLOCATOR=pool"),
])
def test_a_setting_jax_would_refuse_is_refused_naming_it(env, capsys, settings, named):
    for name, value in settings.items():
        env.setenv(name, value)
    with pytest.raises(InputError, match=named):
        allocator_settings()
    # The command line says so in one line, before compiling anything.
    env.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # plan appends to it
    # plan emulates its mesh's device count where the backend has not started yet; started here, it
    # keeps the suite's 8 devices for the tests that run after this one in this process.
    jax.devices()
    with pytest.raises(SystemExit):
        main(["plan", "--config", "tiny", "--mesh", "data=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxmtp plan: error: ") and named in err[0]


@pytest.mark.parametrize("share", [0.76, 0.8, 0.9])
def test_a_plan_that_fits_the_device_but_not_the_default_limit_is_told_the_fraction(share):
    memory = 141e9
    limit = memory_limit(Device("GPU", memory, gpu=True), AllocatorSettings())
    total = share * memory
    verdict = limit.verdict(total)
    assert verdict.startswith("does not fit")
    fraction = float(re.search(r"fits with XLA_CLIENT_MEM_FRACTION=([0-9.]+)$", verdict).group(1))
    # The smallest fraction, in hundredths, that holds the plan with 2% to spare.
    assert fraction * memory >= 1.02 * total > (fraction - 0.01) * memory
    assert limit.verdict(0.7 * memory).startswith("fits (93% of the limit)")


def test_a_plan_beyond_what_a_fraction_can_give_is_told_so():
    limit = memory_limit(Device("GPU", 100e9, gpu=True), AllocatorSettings())
    assert "above the 0.95" in limit.verdict(96e9) and "fits with" not in limit.verdict(96e9)
    assert limit.verdict(101e9).endswith("more than the device's memory")


def test_plan_compiles_the_auto_loop_with_sampling_that_generate_runs():
    config = gm.TINY
    auto, fixed = default_loops(config, 1)
    assert (auto, fixed) == (Loop(generation.AUTO_MAX_K, True, SAMPLING), Loop(1, False, SAMPLING))
    static, _ = abstract_inputs(config, make_mesh(1, 1, 1, devices=jax.devices()[:1]), 2, 16, 128, auto.k, "float32", auto=True,
                                mode=auto.mode)
    # What generate compiles by default (speculative_k="auto") when it samples with top-k and top-p:
    # the auto loop with that sampling transform, k up to the platform's most.
    prepared = generation.prepare(gm.model("random"), [[1, 2, 3], [4]], speculative_k="auto", temperature=0.6,
                                  top_k=20, top_p=0.95)
    assert (static.auto, static.mode) == (prepared.static.auto, prepared.static.mode) == (True, SAMPLING)
    assert static.k == generation.AUTO_MAX_K and prepared.static.k == generation.AUTO_MAX_K_CPU  # this is a CPU
    assert default_loops(config, 1, "fixed", greedy=True) == (Loop(1, False, SamplingMode()),)
    # A model without an MTP layer decodes plainly under auto: one loop.
    plain = config.replace(num_nextn_predict_layers=0)
    assert default_loops(plain, 0) == (Loop(0, False, SAMPLING),)


@pytest.mark.parametrize("per_token, quadratic, longest", [
    (1e4, 0.0, 300 * 1024),    # the caches' cost predicts the total (the V3 family): found by the per-token step
    (10.0, 2e-3, 200 * 1024),  # compressed caches, temporaries growing faster (DeepSeek-V4): found by halving ratios
    (10.0, 1.0, None),         # not even the shortest length fits
])
def test_the_fit_search_finds_the_longest_length_within_its_ratio(per_token, quadratic, longest):
    """`fit`'s search for one batch, on a synthetic total per length (a fixed part, a per-token part
    and a part growing with the square of the length, as attention's temporaries can): what it
    returns fits, and the longest that fits is within FIT_RATIO (or one step) of it."""
    from jaxmtp.plan import CONTEXT_STEP, FIT_RATIO, _longest

    def total(n):
        return 1e9 + per_token * n + quadratic * n * n

    capacity = total(longest) if longest else 1e9

    def measure(n):
        return {"xla_argument_bytes": total(n), "xla_temp_bytes": 0, "xla_output_bytes": 0, "cache_len": n}

    found = _longest(measure, 1024 * 1024, 2 * CONTEXT_STEP, capacity, per_token)
    if longest is None:
        assert found is None
        return
    n = found["cache_len"]
    assert n % CONTEXT_STEP == 0 and total(n) <= capacity
    assert longest <= max(FIT_RATIO * n, n + CONTEXT_STEP)
