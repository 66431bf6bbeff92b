"""Two processes x 4 CPU devices form one mesh (jax.distributed over loopback), load a checkpoint
onto it and generate the same tokens as one process; with speculative_k="auto" and a round-cost
table of its own per process, both decode with process 0's costs, so with the same k in every
round. One serving engine spans both processes. In one process, auto's measuring loops compile in
the caller's mesh."""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

import generation_models as gm
import jaxmtp
from jaxmtp import calibration
from jaxmtp.sharding import make_mesh

CONFIG, PROMPTS = gm.MESH_CONFIG, gm.MESH_PROMPTS

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER_TIMEOUT = 600  # seconds: a worker still running then is stuck in a collective


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_workers(model_dir, out_dir, script="multiprocess_worker.py", *extra):
    """Both workers to their end (killed past WORKER_TIMEOUT) -> their JSON results."""
    port = str(_free_port())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]),
               WORKER_TIMEOUT=str(WORKER_TIMEOUT))
    workers = [subprocess.Popen([sys.executable, os.path.join(HERE, script), str(i), port, model_dir,
                                 out_dir, *extra], env=dict(env, JAXMTP_CACHE_DIR=os.path.join(out_dir, f"costs{i}")),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for i in range(2)]
    try:
        logs = [w.communicate(timeout=WORKER_TIMEOUT + 60)[0] for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
    assert all(w.returncode == 0 for w in workers), "\n".join(logs)[-6000:]
    results = []
    for i in range(2):
        with open(os.path.join(out_dir, f"process{i}.json")) as f:
            results.append(json.load(f))
    return results


def test_two_processes_generate_at_k2_like_one(tmp_path):
    """The suite's check of several processes (the test below, with JAXMTP_LONG_TESTS=1, adds k = 0
    and auto): speculative greedy at k = 2 on the mesh the two processes form gives one process's
    tokens."""
    model_dir = str(tmp_path / "model")
    single = gm.model("partial", CONFIG)
    jaxmtp.save(single, model_dir)
    first, second = _run_workers(model_dir, str(tmp_path), "multiprocess_worker.py", "quick")
    assert first["2"] == second["2"] == jaxmtp.generate(single, PROMPTS, max_new_tokens=10, speculative_k=2).tokens


def _v4_checkpoint(directory):
    """A tiny random DeepSeek-V4 model whose every sharded dimension the 2 x 2 x 2 mesh divides,
    saved to `directory` -> the model."""
    from jaxmtp.models.deepseek_v4 import CSA, HCA, V4Config, init_v4
    from jaxmtp.models.deepseek_v4.checkpoint import save_v4

    config = V4Config(vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3,
                      num_attention_heads=2, q_lora_rank=32, n_routed_experts=4, num_experts_per_tok=2,
                      layer_types=(CSA, HCA, HCA), mlp_layer_types=("hash_moe", "moe", "moe"), head_dim=32,
                      qk_rope_head_dim=8, sliding_window=8, compress_rates=(4, 8), o_groups=2, o_lora_rank=16,
                      index_n_heads=4, index_head_dim=16, index_topk=2, hc_mult=2, initializer_range=0.1)
    single = init_v4(config, seed=2)
    save_v4(single, directory)
    return single


@pytest.mark.skipif(not os.environ.get("JAXMTP_LONG_TESTS"), reason="two processes compiling V4's loop take about "
                    "half a CPU-minute; set JAXMTP_LONG_TESTS=1 to run it")
def test_two_processes_generate_v4_like_one(tmp_path):
    """A DeepSeek-V4 checkpoint loaded onto the mesh the two processes form (load_v4) decodes at
    k = 2 the tokens that one process decodes plainly on one device."""
    single = _v4_checkpoint(tmp_path / "v4")
    first, second = _run_workers(str(tmp_path / "v4"), str(tmp_path), "multiprocess_v4_worker.py")
    want = jaxmtp.generate(single, gm.V4_MESH_PROMPTS, max_new_tokens=gm.V4_MESH_TOKENS).tokens
    assert first["2"] == second["2"] == want


@pytest.mark.skipif(not os.environ.get("JAXMTP_LONG_TESTS"), reason="two processes compiling four loops each take "
                    "about two and a half CPU-minutes; set JAXMTP_LONG_TESTS=1 to run it")
def test_two_processes_generate_like_one(tmp_path):
    model_dir = str(tmp_path / "model")
    single = gm.model("partial", CONFIG)
    jaxmtp.save(single, model_dir)
    first, second = _run_workers(model_dir, str(tmp_path))
    for k in (0, 2):
        assert first[str(k)] == second[str(k)]
        assert first[str(k)] == jaxmtp.generate(single, PROMPTS, max_new_tokens=10, speculative_k=k).tokens
    # speculative_k="auto": process 1 alone had costs stored that pay no drafting, process 0 had
    # none (so measured); then process 0's table held costs that pay, process 1's still the others.
    greedy = jaxmtp.generate(single, PROMPTS, max_new_tokens=first["auto_tokens"], speculative_k=0).tokens
    for run in ("measured", "stored", "chunked"):
        same = lambda result: {name: value for name, value in result.items() if name != "compiled"}  # noqa: E731
        assert same(first[run]) == same(second[run]), run  # tokens, costs, rounds at each k per row, steps
        assert first[run]["tokens"] == greedy, run
    assert first["measured"]["round_costs"] != second["plain_costs"]
    drafting = np.float32(first["drafting_costs"]).tolist()
    # The measuring compiled the auto loop that the decoding then runs (its inputs placed alike).
    assert not [f for f in first["stored"]["compiled"] if "start" in f or "advance" in f], first["stored"]["compiled"]
    for run in ("stored", "chunked"):
        assert first[run]["round_costs"] == drafting and not first[run]["chose_plain"]
        by_k = np.sum(first[run]["rounds_at"], axis=0)
        assert by_k[1] > 0 and by_k[2] > 0, by_k  # the loop's choice changed k as it went


@pytest.mark.skipif(not os.environ.get("JAXMTP_LONG_TESTS"), reason="two processes compiling the engine take about "
                    "two CPU-minutes; set JAXMTP_LONG_TESTS=1 to run it")
def test_two_processes_serve_like_one(tmp_path):
    """One serving engine over both processes' devices: process 0 schedules, process 1 runs the
    same operations; the served tokens equal one process's plain greedy decoding."""
    model_dir = str(tmp_path / "model")
    single = gm.model("partial", CONFIG)
    jaxmtp.save(single, model_dir)
    first, second = _run_workers(model_dir, str(tmp_path), "engine_worker.py")
    assert second == {"followed": True}
    assert first["tokens"] == jaxmtp.generate(single, PROMPTS, max_new_tokens=10, speculative_k=0).tokens
    assert first["rounds_by_k"].get("2", 0) > 0


@pytest.mark.skipif(not os.environ.get("JAXMTP_LONG_TESTS"), reason="two processes compiling the engine take about "
                    "two CPU-minutes; set JAXMTP_LONG_TESTS=1 to run it")
def test_two_processes_serve_v4_like_one(tmp_path):
    """test_two_processes_serve_like_one on a DeepSeek-V4 checkpoint (jaxmtp.engine.v4 over the
    same lockstep)."""
    single = _v4_checkpoint(tmp_path / "v4")
    first, second = _run_workers(str(tmp_path / "v4"), str(tmp_path), "engine_worker.py", "v4")
    assert second == {"followed": True}
    assert first["tokens"] == jaxmtp.generate(single, gm.V4_MESH_PROMPTS, max_new_tokens=10).tokens
    assert first["rounds_by_k"].get("2", 0) > 0


def test_calibration_compiles_in_the_callers_mesh():
    """In one process the measuring loops compile side by side in threads; `jax.set_mesh` holds per
    thread, so each must be given the caller's (without it a loop on a mesh would be refused, see
    jaxmtp.sharding.context_mesh)."""
    mesh = make_mesh(data=2, expert=2, tensor=2)
    seen = []
    with jax.set_mesh(mesh):
        calibration._warm_up(*[lambda: seen.append(jax.sharding.get_mesh())] * 2)
    calibration._warm_up(lambda: seen.append(jax.sharding.get_mesh()))
    assert seen[:2] == [mesh, mesh] and seen[2].empty
