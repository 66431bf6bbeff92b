"""One of two processes (4 CPU devices each) that form one 8-device mesh over loopback and run one
serving engine on it: process 0 takes the requests and schedules, process 1 follows its operations
(jaxmtp.engine.device). Process 0 writes the tokens it served as JSON (process0.json in the output
folder); process 1 writes that it followed to the end. With "v4" after the folder, the checkpoint
is a DeepSeek-V4 one (load_v4). Run by tests/test_multiprocess.py."""

import faulthandler
import json
import os
import sys

process_id, port, model_dir, out_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
V4 = sys.argv[5:] == ["v4"]
faulthandler.dump_traceback_later(int(os.environ.get("WORKER_TIMEOUT", "600")), exit=True)
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)

import jaxmtp  # noqa: E402
from jaxmtp.engine import Engine  # noqa: E402
from jaxmtp.sharding import make_mesh  # noqa: E402
from generation_models import MESH_PROMPTS, V4_MESH_PROMPTS  # noqa: E402

mesh = make_mesh(data=2, expert=2, tensor=2)
if V4:
    from jaxmtp.models.deepseek_v4 import load_v4

    model, PROMPTS = load_v4(model_dir, mesh=mesh), V4_MESH_PROMPTS
else:
    model, PROMPTS = jaxmtp.load(model_dir, mesh=mesh), MESH_PROMPTS
engine = Engine(model, slots=4, buckets=(4,), max_len=64, prefill_chunk=16, segment_rounds=2, prefix_blocks=4,
                sampling=False, speculative_k=2)
engine.start()  # process 1: follows process 0 until it shuts down
if process_id == 0:
    result = {"tokens": engine.generate(PROMPTS, max_tokens=10, timeout=300),
              "rounds_by_k": {str(k): n for k, n in engine.snapshot()["rounds_by_k"].items()}}
    engine.shutdown(timeout=5)
else:
    result = {"followed": True}
with open(os.path.join(out_dir, f"process{process_id}.json"), "w") as f:
    json.dump(result, f)
