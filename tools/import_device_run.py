"""Turns the output folder of one `benchmarks/accelerator.sh` run on a lent device into results
JSON with provenance in benchmarks/results/ (which `benchmarks/render.py` renders into the docs).

The folder holds what the run wrote: device.txt (nvidia-smi's name, driver and memory, then `git
rev-parse HEAD`), provenance.json where the run wrote one (`jaxmtp.provenance` at its start: the
commit, whether the tree had uncommitted changes, the engine's hash, the versions), console.log
(the jax and flax versions, and each step's start time), and the steps' logs (bench.log: `jaxmtp
bench --json`; decode_step.log; plan_device.log and plan_device.json). The folder is kept in
benchmarks/results/ (each result names it as `imported_from`), so that tests/test_provenance.py
can check the results against it.

Each result keeps the commit and the uncommitted flag the device recorded. The flag comes from
the run's provenance.json, else from a result a step of the same run wrote with
`jaxmtp.provenance` (the run is one tree), else it is null: not recorded. Results JSON that a step
wrote itself (e.g. sparse_attention.json) are copied as NAME_<file> with their provenance as
written. --commit and --reason name the commit of the tree that was sent where the device's git
metadata is older than the files it ran (`git rev-parse` there names an earlier commit, and the
tree reads as changed): they are kept as tree_commit and tree_reason beside the recorded commit,
never in its place.

    python tools/import_device_run.py RUN_DIR --date YYYY-MM-DD --name h200 [--only STEP ...]
        [--commit SHA --reason TEXT] [--out benchmarks/results]
"""

import argparse
import json
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
RUN_RECORD = "provenance.json"  # what accelerator.sh records of the run itself; not a step's result
_HIGHEST = {"JAX_DEFAULT_MATMUL_PRECISION": "highest", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def _read(run: str, name: str) -> str:
    with open(os.path.join(run, name)) as f:
        return f.read()


def _recorded(run: str, commit: str) -> dict | None:
    """The provenance a program of this run recorded itself: the run's provenance.json, else the
    first step result (by file name) written with jaxmtp.provenance at the same commit."""
    if os.path.exists(os.path.join(run, RUN_RECORD)):
        return json.loads(_read(run, RUN_RECORD))
    for name in sorted(os.listdir(run)):
        if name.endswith(".json"):
            prov = json.loads(_read(run, name)).get("provenance")
            if isinstance(prov, dict) and prov.get("commit") == commit:
                return prov
    return None


def run_record(run: str) -> dict:
    """What the device recorded of the whole run: {commit, uncommitted_changes (None where not
    recorded), versions, device, and engine_sha256 where recorded}."""
    lines = [line.strip() for line in _read(run, "device.txt").splitlines() if line.strip()]
    name, driver, memory = (part.strip() for part in lines[1].split(","))
    commit = lines[2]
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        raise ValueError(f"{run}/device.txt: expected `git rev-parse HEAD` (40 hex digits) on line 3, found {commit!r}")
    console = re.search(r"jax (\S+) flax (\S+)", _read(run, "console.log"))
    if console is None:
        raise ValueError(f"{run}/console.log: no 'jax VERSION flax VERSION' line")
    recorded = _recorded(run, commit) or {}
    known = recorded.get("versions", {})
    if known.get("jax", console.group(1)) != console.group(1):
        raise ValueError(f"{run}: the recorded provenance says jax {known['jax']}, console.log jax {console.group(1)}")
    versions = {"python": known.get("python"), "jax": console.group(1), "jaxlib": known.get("jaxlib"),
                "flax": console.group(2)}
    record = {"commit": commit, "uncommitted_changes": recorded.get("uncommitted_changes"),
              "versions": {k: v for k, v in versions.items() if v is not None},
              "device": {"platform": "gpu", "kind": name, "count": 1, "driver": driver, "memory": memory}}
    if recorded.get("engine_sha256"):
        record["engine_sha256"] = recorded["engine_sha256"]
    return record


def _where(run: str) -> str:
    path = os.path.relpath(os.path.abspath(run), ROOT)
    if not path.replace(os.sep, "/").startswith("benchmarks/results/"):
        raise ValueError(f"{run}: keep the run's folder in benchmarks/results/ (the results name it, and the tests "
                         "check them against it); copy it there first")
    return path.replace(os.sep, "/")


def _tree(commit: str | None, reason: str | None) -> dict:
    """tree_commit (resolved to its full hash) and tree_reason, or nothing."""
    if (commit is None) != (reason is None):
        raise ValueError("--commit and --reason go together: the commit of the tree that was sent, and why it is "
                         "not the one the device recorded")
    if commit is None:
        return {}
    try:
        full = subprocess.run(["git", "rev-parse", "--verify", f"{commit}^{{commit}}"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
    except subprocess.CalledProcessError:
        raise ValueError(f"--commit {commit}: not a commit of this repository") from None
    return {"tree_commit": full, "tree_reason": reason}


def _provenance(run: str, record: dict, date: str, step: str, command: str, repeats: int, flags: dict,
                tree: dict) -> dict:
    started = re.search(rf"== {step} \((\d\d:\d\d:\d\d)\)", _read(run, "console.log"))
    prov = {"date": f"{date}T{started.group(1) if started else '00:00:00'}+00:00", **record, "flags": flags,
            "command": command, "repeats": repeats, "imported_from": _where(run)}
    return {**prov, **tree}


def _json_in(text: str) -> dict:
    """The JSON document a log starts with (a step's log ends with its exit status)."""
    return json.JSONDecoder().raw_decode(text[text.index("{"):])[0]


def _bench(run, record, date, tree):
    figures = _json_in(_read(run, "bench.log"))
    figures["model"] = os.path.basename(os.path.normpath(figures["model"]))
    prov = _provenance(run, record, date, "bench", "jaxmtp bench --repeats 5 --json (benchmarks/accelerator.sh)",
                       figures["repeats"], _HIGHEST, tree)
    return {"benchmark": "bench", "provenance": prov, "figures": figures,
            "raw": {"note": "this run's bench kept medians only"}}


def _decode_step(run, record, date, tree):
    text = _read(run, "decode_step.log")
    rows = [{"rows": int(t), "main_forward_us": float(m), "mtp_pass_us": float(p)}
            for t, m, p in re.findall(r"T=(\d+): main forward\s+([\d.]+)\s+MTP pass\s+([\d.]+)", text)]
    costs = {int(k): float(c) for k, c in re.findall(r"k=(\d) ([\d.]+)", text.split("round at k")[1])}
    prov = _provenance(run, record, date, "decode_step", "python benchmarks/decode_step.py", 5, _HIGHEST, tree)
    return {"benchmark": "decode_step", "provenance": prov,
            "figures": {"passes": rows, "round_cost_by_k": costs,
                        "setting": text.splitlines()[0].split(": microseconds")[0]},
            "raw": {"log": text}}


def _plan_device(run, record, date, tree):
    device = json.loads(_read(run, "plan_device.json"))
    cpu = json.loads(_read(run, "plan_device.log").splitlines()[0])
    prov = _provenance(run, record, date, "plan_device",
                       "python benchmarks/plan_on_device.py --matmul fp8 (and --plan-only on the CPU)", 1, {}, tree)
    return {"benchmark": "plan_device", "provenance": prov, "figures": {"device_run": device, "cpu_prediction": cpu},
            "raw": {}}


_STEPS = {"bench": ("bench.log", _bench), "decode_step": ("decode_step.log", _decode_step),
          "plan_device": ("plan_device.json", _plan_device)}


def results(run: str, *, date: str, commit: str | None = None, reason: str | None = None,
            only: tuple[str, ...] = ()) -> dict[str, dict]:
    """{step: result} for every step of the run whose output is there (only those named in `only`,
    where given): the results this tool writes, without writing them."""
    record, tree = run_record(run), _tree(commit, reason)
    made = {step: parse(run, record, date, tree) for step, (file, parse) in _STEPS.items()
            if os.path.exists(os.path.join(run, file))}
    for file in sorted(os.listdir(run)):
        if file.endswith(".json") and file not in ("plan_device.json", RUN_RECORD):
            result = json.loads(_read(run, file))
            result["provenance"] = {**result["provenance"], "imported_from": _where(run), **tree}
            made[file.removesuffix(".json")] = result
    unknown = set(only) - set(made)
    if unknown:
        raise ValueError(f"--only {' '.join(sorted(unknown))}: not in {run} (it has {', '.join(sorted(made))})")
    return {step: result for step, result in made.items() if not only or step in only}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="the folder accelerator.sh wrote, kept in benchmarks/results/")
    parser.add_argument("--date", required=True, help="the day of the run (UTC), YYYY-MM-DD")
    parser.add_argument("--name", required=True, help="the results' prefix, e.g. h200")
    parser.add_argument("--only", nargs="+", default=(), help="import only these steps (e.g. decode_step)")
    parser.add_argument("--commit", help="the commit of the tree that was sent (see above); needs --reason")
    parser.add_argument("--reason", help="why the tree's commit is not the one the device recorded")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    try:
        made = results(args.run, date=args.date, commit=args.commit, reason=args.reason, only=tuple(args.only))
    except ValueError as e:
        parser.error(str(e))
    for step, result in made.items():
        path = os.path.join(args.out, f"{args.name}_{step}.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        print("wrote", path)


if __name__ == "__main__":
    main()
