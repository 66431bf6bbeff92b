"""One of two processes (4 CPU devices each) that form one 8-device mesh over loopback, load a
checkpoint onto it (each process reading only its devices' blocks) and generate; each process
writes what it decoded and its stats as JSON (process<i>.json in the output folder). Run by
tests/test_multiprocess.py, which gives each process a round-cost table of its own
(JAXMTP_CACHE_DIR)."""

import faulthandler
import json
import os
import sys

process_id, port, model_dir, out_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
QUICK = sys.argv[5:] == ["quick"]  # only the generation at k = 2
# A process whose collectives wait for ones the other never launches hangs: print where, and end.
faulthandler.dump_traceback_later(int(os.environ.get("WORKER_TIMEOUT", "600")), exit=True)
# The test run's flags (its optimisation level), with 4 devices instead of its 8: XLA reads each
# flag in turn, so the last value given wins.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)

import jaxmtp  # noqa: E402
from jaxmtp import calibration, generation  # noqa: E402
from jaxmtp.sharding import make_mesh  # noqa: E402
from generation_models import MESH_PROMPTS as PROMPTS  # noqa: E402

AUTO_TOKENS = 24  # three segments of auto rounds
# Costs that make process 1, on its own, decode plainly (no k > 0 pays), and costs with which
# drafting pays, that process 0's table is given before the second auto call.
PLAIN_COSTS, DRAFTING_COSTS = [1.0, 9.0, 9.5], [1.0, 1.25, 1.5]
# Fewer timed rounds: the figures only need to be the same on both processes, not steady.
calibration.ROUNDS, calibration.REPEATS = 8, 1


class Digits:
    """A tokenizer for stop strings: ids as space-separated numbers."""

    def decode(self, ids):
        return " ".join(map(str, ids))


def seed(key, costs):
    """Stores `costs` for `key` in this process's own table."""
    assert len(costs) == generation.auto_max_k(model) + 1
    path = os.path.join(calibration.cache_dir(), calibration.FILE)
    table = {}
    if os.path.exists(path):
        with open(path) as f:
            table = json.load(f)
    os.makedirs(calibration.cache_dir(), exist_ok=True)
    with open(path, "w") as f:
        json.dump({**table, key: costs}, f)


def auto(**options):
    """generate with auto -> its tokens, stats and the programs it compiled (XLA compilations by
    jitted function name, from jax.monitoring's backend-compile event)."""
    compiled = []

    def listen(event, duration, fun_name="", **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(fun_name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        out = jaxmtp.generate(model, PROMPTS, max_new_tokens=AUTO_TOKENS, speculative_k="auto", **options)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    s = out.stats
    return {"tokens": out.tokens, "round_costs": s.round_costs, "chose_plain": s.chose_plain,
            "rounds_at": s.rounds_at, "steps": s.steps, "compiled": compiled}


assert jax.device_count() == 8 and jax.local_device_count() == 4
mesh = make_mesh(data=2, expert=2, tensor=2)
model = jaxmtp.load(model_dir, mesh=mesh, quiet=True)
if QUICK:
    with open(os.path.join(out_dir, f"process{process_id}.json"), "w") as f:
        json.dump({"2": jaxmtp.generate(model, PROMPTS, max_new_tokens=10, speculative_k=2).tokens}, f)
    jax.distributed.shutdown()
    sys.exit(0)
key = generation.prepare(model, PROMPTS, max_new_tokens=AUTO_TOKENS, speculative_k="auto").cost_key()
result = {k: jaxmtp.generate(model, PROMPTS, max_new_tokens=10, speculative_k=k).tokens for k in (0, 2)}
# Process 1 has costs stored, process 0 has none: alone, process 1 would decode plainly at once
# while process 0 measures (running loops whose collectives process 1 never joins).
if process_id == 1:
    seed(key, PLAIN_COSTS)
result["measured"] = auto()
# Both stored, different: process 0's decide; then once more in chunks (stop strings), whose
# lengths follow a clock.
if process_id == 0:
    seed(key, DRAFTING_COSTS)
result["stored"] = auto()
result["chunked"] = auto(stop=["never"], tokenizer=Digits())
result.update(auto_tokens=AUTO_TOKENS, plain_costs=PLAIN_COSTS, drafting_costs=DRAFTING_COSTS)
with open(os.path.join(out_dir, f"process{process_id}.json"), "w") as f:
    json.dump(result, f)
jax.distributed.shutdown()
