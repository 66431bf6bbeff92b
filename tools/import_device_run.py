"""Turns the output folder of one `benchmarks/accelerator.sh` run on a lent device into results
JSON with provenance in benchmarks/results/ (which `benchmarks/render.py` renders into the docs).

The folder holds what the run wrote: device.txt (nvidia-smi's name, driver and memory, then `git
rev-parse HEAD`), console.log (the jax and flax versions, and each step's start time), and the
steps' logs (bench.log: `jaxmtp bench --json`; decode_step.log; plan_device.log and
plan_device.json).

Results JSON that a step wrote itself with `jaxmtp.provenance` (e.g. sparse_attention.json) are
copied as NAME_<file>. --commit names the commit of the tree that was sent, where the device's git
metadata is older than the files it ran (`git rev-parse` there names an earlier commit, and the
tree reads as changed).

    python tools/import_device_run.py RUN_DIR --date YYYY-MM-DD --name h200 [--commit SHA]
        [--out benchmarks/results]
"""

import argparse
import json
import os
import re


def _provenance(run: str, date: str, step: str, command: str, repeats: int, flags: dict, commit=None) -> dict:
    with open(os.path.join(run, "device.txt")) as f:
        lines = [line.strip() for line in f if line.strip()]
    name, driver, memory = (part.strip() for part in lines[1].split(","))
    with open(os.path.join(run, "console.log")) as f:
        console = f.read()
    versions = re.search(r"jax (\S+) flax (\S+)", console)
    started = re.search(rf"== {step} \((\d\d:\d\d:\d\d)\)", console)
    return {"date": f"{date}T{started.group(1) if started else '00:00:00'}+00:00", "commit": commit or lines[2],
            "uncommitted_changes": False, "versions": {"jax": versions.group(1), "flax": versions.group(2)},
            "device": {"platform": "gpu", "kind": name, "count": 1, "driver": driver, "memory": memory},
            "flags": flags, "command": command, "repeats": repeats}


def _json_in(path: str) -> dict:
    """The JSON document a log starts with (a step's log ends with its exit status)."""
    with open(path) as f:
        text = f.read()
    return json.JSONDecoder().raw_decode(text[text.index("{"):])[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="the folder accelerator.sh wrote")
    parser.add_argument("--date", required=True, help="the day of the run (UTC), YYYY-MM-DD")
    parser.add_argument("--name", required=True, help="the results' prefix, e.g. h200")
    parser.add_argument("--commit", help="the commit of the tree that was sent (see above)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                      "benchmarks", "results"))
    args = parser.parse_args()
    highest = {"JAX_DEFAULT_MATMUL_PRECISION": "highest", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    written = []
    if os.path.exists(os.path.join(args.run, "bench.log")):
        figures = _json_in(os.path.join(args.run, "bench.log"))
        figures["model"] = os.path.basename(os.path.normpath(figures["model"]))
        prov = _provenance(args.run, args.date, "bench", "jaxmtp bench --repeats 5 --json (benchmarks/accelerator.sh)",
                           figures["repeats"], highest, args.commit)
        written.append(("bench", {"benchmark": "bench", "provenance": prov, "figures": figures,
                                  "raw": {"note": "this run's bench kept medians only"}}))
    if os.path.exists(os.path.join(args.run, "decode_step.log")):
        with open(os.path.join(args.run, "decode_step.log")) as f:
            text = f.read()
        rows = [{"rows": int(t), "main_forward_us": float(m), "mtp_pass_us": float(p)}
                for t, m, p in re.findall(r"T=(\d+): main forward\s+([\d.]+)\s+MTP pass\s+([\d.]+)", text)]
        costs = {int(k): float(c) for k, c in re.findall(r"k=(\d) ([\d.]+)", text.split("round at k")[1])}
        prov = _provenance(args.run, args.date, "decode_step", "python benchmarks/decode_step.py", 5, highest,
                           args.commit)
        written.append(("decode_step", {"benchmark": "decode_step", "provenance": prov,
                                        "figures": {"passes": rows, "round_cost_by_k": costs,
                                                    "setting": text.splitlines()[0].split(": microseconds")[0]},
                                        "raw": {"log": text}}))
    if os.path.exists(os.path.join(args.run, "plan_device.json")):
        with open(os.path.join(args.run, "plan_device.json")) as f:
            device = json.load(f)
        with open(os.path.join(args.run, "plan_device.log")) as f:
            cpu = json.loads(f.readline())
        prov = _provenance(args.run, args.date, "plan_device",
                           "python benchmarks/plan_on_device.py --matmul fp8 (and --plan-only on the CPU)", 1, {},
                           args.commit)
        written.append(("plan_device", {"benchmark": "plan_device", "provenance": prov,
                                        "figures": {"device_run": device, "cpu_prediction": cpu}, "raw": {}}))
    for file in sorted(os.listdir(args.run)):
        if file.endswith(".json") and file != "plan_device.json":
            with open(os.path.join(args.run, file)) as f:
                result = json.load(f)
            if args.commit:
                result["provenance"].update(commit=args.commit, uncommitted_changes=False)
            written.append((file.removesuffix(".json"), result))
    for step, result in written:
        path = os.path.join(args.out, f"{args.name}_{step}.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        print("wrote", path)


if __name__ == "__main__":
    main()
