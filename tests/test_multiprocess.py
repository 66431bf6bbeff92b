"""Two processes x 4 CPU devices form one mesh (jax.distributed over loopback), load a checkpoint
onto it and generate the same tokens as one process."""

import json
import os
import socket
import subprocess
import sys

import generation_models as gm
import jaxmtp

CONFIG, PROMPTS = gm.MESH_CONFIG, gm.MESH_PROMPTS

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_generate_like_one(tmp_path):
    port, out, model_dir = str(_free_port()), str(tmp_path / "tokens.json"), str(tmp_path / "model")
    single = gm.model("partial", CONFIG)
    jaxmtp.save(single, model_dir)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    workers = [subprocess.Popen([sys.executable, os.path.join(HERE, "multiprocess_worker.py"), str(i), port, model_dir, out],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for i in range(2)]
    logs = [w.communicate(timeout=600)[0] for w in workers]
    assert all(w.returncode == 0 for w in workers), "\n".join(logs)[-4000:]
    with open(out) as f:
        got = json.load(f)
    for k in (0, 2):
        assert got[str(k)] == jaxmtp.generate(single, PROMPTS, max_new_tokens=10, speculative_k=k).tokens
