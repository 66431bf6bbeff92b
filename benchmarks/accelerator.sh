#!/usr/bin/env bash
# The figures that need a GPU or TPU, in one short run from the repository root:
#   1. bench: `jaxmtp bench`, plain vs speculative k = 1..4 and auto on the demo model (JSON:
#      tokens/s with and without the prefill, round costs in plain steps, ideal and achieved
#      speedups),
#   2. fp8_gemm: benchmarks/fp8_gemm.py, the compiled FP8 kernels on DeepGEMM's shapes, with their
#      error against the jnp reference (JSON),
#   3. fp8_kernels: tests/test_fp8_gemm.py, whose random tests then run the compiled kernels,
#   4. fp8_accuracy: benchmarks/fp8_accuracy.py, the FP8 demo model (W8A8 kernels) vs its
#      dequantized self,
#   5. generate: the README's command, `jaxmtp generate "def fibonacci(n):"` with the defaults
#      (speculative_k="auto"), as a new user first runs it: from a cold start (an empty
#      JAXMTP_CACHE_DIR, so no compiled programs and no measured round costs), its wall time in
#      the log,
#   6. decode_step: benchmarks/decode_step.py, the main forward and the MTP pass at 1..5 rows, and
#      the round cost at each k they give; decode_step_experts: the demo with one conditional per
#      routed expert, the arrangement the decode layout picks on CPUs only (XLA:GPU fetches each
#      conditional's predicate to the host), to compare with decode_step's stacked experts;
#      decode_step_wide: the widened random-weight dense and MoE configs in benchmarks/configs
#      (1.1-1.2 GiB of float32 weights, memory-bound),
#   7. decode_step_tf32: decode_step at the default matmul precision (TF32 on GPUs): does the cost
#      of 2+ rows come from the full-precision float32 GEMM algorithm?
#   8. hlo: decode_step at 1 and 4 rows with XLA's optimized HLO written to OUT_DIR/hlo: which
#      kernels a 4-row step runs that a 1-row step does not,
#   9. auto_k0: benchmarks/auto_k0.py, a round of the auto loop at k = 0 against a plain step
#      (auto runs its own loop whatever the acceptance; XLA:GPU reads its loop conditions on the
#      host),
#  10. plan_device: benchmarks/plan_on_device.py, DeepSeek-V3 671B widths with 4 layers, FP8
#      weights: the CPU's `jaxmtp plan` prediction, XLA's analysis on the device, and the device's
#      measured peak,
#  11. real_width: benchmarks/real_width.py, DeepSeek-V3 671B widths with 1 dense and 2 MoE layers
#      and the MTP layer, random FP8 weights made on the device: a plain decode step and a round at
#      k = 1..3 at batch 1, 8 and 32, with the bytes each reads and the fraction of the memory
#      bandwidth achieved, then DeepSeek-V3.2's sparse against dense attention at 32K and 128K
#      cached tokens (JSON, written after every row, so that a step cut by its limit keeps what it
#      measured); real_width_cmdbuf: its V3 rows at batch 1 and 32 with XLA's command buffers
#      (CUDA graphs) extended to the decode loop's while loops and conditionals (--command-buffers).
# Each step has its own time limit and log (OUT_DIR/<step>.log); a failing step does not stop the
# others. PROMPTS_FILE holds bench prompts as token ids ("1,2;3,4") in place of the held-out
# prompts shipped with the package (jaxmtp/benchmark_prompts.json, the same text on every machine).
# float32 matmuls run at full precision (no TF32) in bench, fp8_accuracy and the decode_step steps
# but decode_step_tf32 (bench and fp8_accuracy compare numerics; decode_step then times the
# arithmetic that bench runs).
#
# STEPS (names, space-separated) runs only those steps. The step limits add up to more than one
# 10-minute device call; calls that fit one are
#   STEPS="bench real_width real_width_cmdbuf" (at most 570 s): the engine at real widths,
#   STEPS="generate decode_step decode_step_experts hlo" (at most 540 s): the cold start and the
#   demo's decode step,
# and decode_step_wide (90 s) or auto_k0 (60 s) when time is left.
#
#   [STEPS="bench decode_step"] bash benchmarks/accelerator.sh OUT_DIR [PROMPTS_FILE]
set -u
out=${1:?usage: accelerator.sh OUT_DIR [PROMPTS_FILE]}
prompts=${2:-}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
py=${PYTHON:-python3}

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  [[ " ${STEPS:-$name} " == *" $name "* ]] || return 0
  echo "== $name ($(date +%T))"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  echo "exit $?" >>"$out/$name.log"
  tail -n 30 "$out/$name.log"
}

$py -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
# The run's own provenance (commit, uncommitted changes, the engine's hash, versions), which
# tools/import_device_run.py keeps in every result it imports from OUT_DIR.
$py -c "import json, jaxmtp.provenance as p; print(json.dumps(p.provenance(0), indent=1))" >"$out/provenance.json"
tokens=()
[ -n "$prompts" ] && tokens=(--tokens "$(cat "$prompts")")
step bench 180 env JAX_DEFAULT_MATMUL_PRECISION=highest $py -m jaxmtp.cli bench "${tokens[@]}" --repeats 5 --json
step fp8_gemm 110 $py benchmarks/fp8_gemm.py --repeats 20 --json "$out/fp8_gemm.json"
step fp8_kernels 110 $py -m pytest -q -p no:cacheprovider tests/test_fp8_gemm.py
step fp8_accuracy 110 env JAX_DEFAULT_MATMUL_PRECISION=highest $py benchmarks/fp8_accuracy.py
step generate 300 bash -c 'cache=$(mktemp -d) && start=$(date +%s%N) &&
  env -u JAX_COMPILATION_CACHE_DIR -u JAXMTP_COMPILE_CACHE JAXMTP_CACHE_DIR="$cache" "$0" -m jaxmtp.cli generate \
  "def fibonacci(n):" --quiet; status=$?
  echo "wall $(( ($(date +%s%N) - start) / 1000000 )) ms from a cold start (empty JAXMTP_CACHE_DIR)"; exit $status' "$py"
step decode_step 90 env JAX_DEFAULT_MATMUL_PRECISION=highest $py benchmarks/decode_step.py
step decode_step_experts 60 env JAX_DEFAULT_MATMUL_PRECISION=highest $py benchmarks/decode_step.py --experts split \
  --rows 1,2,4 --calls 100
step decode_step_wide 90 env JAX_DEFAULT_MATMUL_PRECISION=highest bash -c 'for c in benchmarks/configs/wide_*.json; do
  "$0" benchmarks/decode_step.py --config "$c" --calls 20 --rows 1,2,3,4,5 || exit; done' "$py"
step decode_step_tf32 90 $py benchmarks/decode_step.py
# (only the optimized HLO text is kept: XLA also writes objects or PTX per kernel)
step hlo 90 bash -c 'JAX_DEFAULT_MATMUL_PRECISION=highest XLA_FLAGS="--xla_dump_to=$1 --xla_dump_hlo_as_text \
  --xla_dump_hlo_module_re=main_loop" "$0" benchmarks/decode_step.py --rows 1,4 --calls 20 &&
  find "$1" -mindepth 1 ! -name "*after_optimizations.txt" -delete' "$py" "$out/hlo"
step auto_k0 60 $py benchmarks/auto_k0.py --pairs 9
step real_width 270 $py benchmarks/real_width.py --json "$out/real_width.json"
step real_width_cmdbuf 120 $py benchmarks/real_width.py --command-buffers --parts v3 --batches 1,32 \
  --json "$out/real_width_cmdbuf.json"
step plan_device 240 bash -c 'JAX_PLATFORMS=cpu "$0" benchmarks/plan_on_device.py --matmul fp8 --plan-only &&
  "$0" benchmarks/plan_on_device.py --matmul fp8 --json "$1"' "$py" "$out/plan_device.json"
