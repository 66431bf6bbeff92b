"""One of two processes (4 CPU devices each) that form one 8-device mesh over loopback, load a
DeepSeek-V4 checkpoint onto it with load_v4 and generate greedily at k = 2 through
jaxmtp.generate; each process writes the tokens as JSON (process<i>.json in the output folder).
Run by tests/test_multiprocess.py."""

import faulthandler
import json
import os
import sys

process_id, port, model_dir, out_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
faulthandler.dump_traceback_later(int(os.environ.get("WORKER_TIMEOUT", "600")), exit=True)
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)

import jaxmtp  # noqa: E402
from jaxmtp.models.deepseek_v4 import load_v4  # noqa: E402
from jaxmtp.sharding import make_mesh  # noqa: E402
from generation_models import V4_MESH_PROMPTS as PROMPTS, V4_MESH_TOKENS as TOKENS  # noqa: E402

assert jax.device_count() == 8 and jax.local_device_count() == 4
model = load_v4(model_dir, mesh=make_mesh(data=2, expert=2, tensor=2))
out = {"2": jaxmtp.generate(model, PROMPTS, max_new_tokens=TOKENS, speculative_k=2).tokens}
with open(os.path.join(out_dir, f"process{process_id}.json"), "w") as f:
    json.dump(out, f)
