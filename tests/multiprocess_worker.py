"""One of two processes (4 CPU devices each) that form one 8-device mesh over loopback, load a
checkpoint onto it (each process reading only its devices' blocks) and generate; process 0 writes
the tokens as JSON. Run by tests/test_multiprocess.py."""

import json
import os
import sys

process_id, port, model_dir, out_path = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
# The test run's flags (its optimisation level), with 4 devices instead of its 8: XLA reads each
# flag in turn, so the last value given wins.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)

import jaxmtp  # noqa: E402
from jaxmtp.sharding import make_mesh  # noqa: E402
from generation_models import MESH_PROMPTS as PROMPTS  # noqa: E402

assert jax.device_count() == 8 and jax.local_device_count() == 4
mesh = make_mesh(data=2, expert=2, tensor=2)
model = jaxmtp.load(model_dir, mesh=mesh, quiet=True)
tokens = {k: jaxmtp.generate(model, PROMPTS, max_new_tokens=10, speculative_k=k).tokens for k in (0, 2)}
if process_id == 0:
    with open(out_path, "w") as f:
        json.dump(tokens, f)
jax.distributed.shutdown()
