#!/usr/bin/env bash
# The GPU check: one prepared run on one CUDA GPU, at most 9.5 minutes (every step has its own time limit,
# and the limits add up to 550 s), that decides whether the fast path runs, equals the twins, and how fast
# the Qwen3.6-27B and GLM-5.2 shapes go. Each step logs to OUT/<step>.log and leaves JSON where it measures
# something; OUT/summary.txt lists every step with ok / FAILED / TIMEOUT, its seconds and what Triton compiled
# and benchmarked during it (the goal: nothing compiled). The figure that matters comes first.
#   Kernels: scripts/gpu_aot.sh builds every Triton kernel below for sm_90 on the CPU machine; carried as
#   .triton/triton-sm90.tar.xz it is verified (Triton's key, the fixed path /tmp/longstraw-triton-sm90: a
#   mismatch is one line in summary.txt and the check goes on compiling) and unpacked before step 1. At the
#   end, what the device compiled itself and its autotune winners go to OUT/triton_new/ (commit the winners
#   as bench_results/<date>_autotune/: the next gpu_aot.sh pins them). summary.txt ends by saying whether the
#   figures count: only with this call's kernel tests passing (fla's backward on Hopper, fla issue #640).
#   1 ladder           tools/bench_ladder.py: Qwen3.6-27B at full depth (64 layers, random weights, the NF4
#                      QLoRA r16 base of configs/published/qwen3.6-27b-qlora-2m-8xh20-96gb.yaml at tp=1,
#                      defaults otherwise: fla, flash attention, batched branches), R=1K, G=8: detached over
#                      P=32K..2M while each next point is planned to fit the device's memory and predicted to
#                      fit 80 s, exact over 16K..256K within 30 s: tokens/s and TFLOP/s per phase against 989,
#                      peak memory against the plan, the planner's largest fitting prompt -> ladder_27b.json
#                                                                                                     [150 s]
#   2 kernels          tests/gpu: flash-linear-attention's rule and causal conv against the twins in bf16 and
#                      float32 at the 27B head shapes (outputs, states, every gradient incl. the state ones;
#                      the decisive check of fla's backward on Hopper, fla issue #640), torch's flash
#                      attention against its twin, the CUDA twins against the CPU, the DSA kernels (indexer
#                      scores + selection, sparse MLA forward + backward) against their twins at GLM-5.2's
#                      head shapes (KDA's test_fla_kda.py is the --kda call's)                          [60 s]
#   3 warmup           tools/gpu_warmup.py: every Triton path of the later steps once at their shapes (with
#                      the archive: loads and autotune benchmarks only) -> warmup.json            [150 s]
#   4 vs_transformers  side by side with transformers on the same weights (transformers with fla: its own fast
#                      path), configs/bench-hybrid-256.yaml with Gated DeltaNet key and value dims 128 (fla's
#                      backward is refused on Hopper at key dim <= 64 with this Triton, fla issue #640; at 128
#                      both sides run it), bf16, P=16K, R=1K, G=8 -> vs_transformers.json             [50 s]
#   5 glm              GLM's DSA kernels: `longstraw validate` on the tiny GLM (4 layers, float32, exact, a
#                      prefix-tree group) ops.dsa=triton against ops.dsa=plain -> validate_glm.json; then
#                      tools/bench_ladder.py at GLM-5.2's width (4 layers: 3 dense + 1 MoE of 16 experts, bf16,
#                      the kernels), R=1K, G=8, detached over P=8K..128K within 25 s, exact 8K..32K within
#                      10 s: tokens/s and TFLOP/s per phase, peak against the plan -> ladder_glm.json   [60 s]
#   6 validate_fla     `longstraw validate`, tiny model with Gated DeltaNet key dim 128, float32, exact mode,
#                      a prefix-tree group: ops.gdn=fla against ops.gdn=plain (tools/compare_validate.py;
#                      fla's float32 dots are TF32) -> validate_fla.json                              [40 s]
#   7 validate_f64     `longstraw validate`, tiny, float64, exact, on CUDA and on the CPU from the same weights,
#                      compared to 1e-10 normwise -> validate_compare.json                            [40 s]
#   kda (only with --kda, as a call of its own: the steps above already fill 550 s of a 600 s call)
#     kda_kernels      tests/gpu/test_fla_kda.py: fla's Kimi Delta Attention (ops/fla_kda.py) against the twin
#                      (ops/kda.py) at GLM-5.3-Flash's head dims (K = V = 128), bf16 and float32, fla's
#                      bounded-gate path and its general one, initial state and every gradient, and the
#                      piece maps; each case's first call (compile + autotune) printed apart    [300 s]
#     validate_kda     `longstraw validate`, the tiny GLM-5.3-Flash (4 layers: KDA, KDA, KDA, MLA) with KDA
#                      heads of 128, float32, exact mode, a prefix-tree group: ops.gdn=fla (KDA's rule and
#                      conv) against ops.gdn=plain -> validate_kda.json                              [150 s]
# Usage:
#   bash scripts/gpu_check.sh [OUT]                  on the CUDA machine (OUT defaults to $OUT, or runs/gpu_check)
#   bash scripts/gpu_check.sh --kda [OUT]            the KDA steps alone (after versions), as their own call
#   bash scripts/gpu_check.sh --all [OUT]            also the earlier lease's steps after these (smoke, train with a
#                                                    checkpoint, QLoRA train, the memory switches, plan_vs_measured)
#   bash scripts/gpu_check.sh --cpu-rehearsal [OUT]  every step on the CPU at tiny sizes, fla under Triton's interpreter
#                                                    where the GPU run takes fla (float32): tests this script
#   GPU_CHECK_ONLY='^(kernels|ladder)$' bash scripts/gpu_check.sh ...   only the steps whose names match (bash regex)
# On a bare CUDA image, run scripts/gpu_wheels.sh where pip works first and carry .whl/ (megatron-core, torchao,
# fla-core); the check then installs them into /tmp/site. And scripts/gpu_aot.sh OUT, then cp OUT/triton-sm90.tar.xz
# .triton/, and carry .triton too (docs/cpu-gpu.md "A lease, step by step").
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
dev=cuda all=0 kda=0
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-rehearsal) dev=cpu; shift ;;
    --all) all=1; shift ;;
    --kda) kda=1; shift ;;
    *) break ;;
  esac
done
out="${1:-${OUT:-runs/gpu_check}}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
work="$out/work"
mkdir -p "$work"
if [ "$dev" = cpu ]; then
  py="$(bash scripts/env.sh --test)/bin/python"
else
  py=python3
  if ! $py -c 'import megatron.core, torchao, fla' >/dev/null 2>&1; then
    [ -d .whl ] || { echo "megatron-core / torchao / fla-core missing and there is no .whl/ (run scripts/gpu_wheels.sh)"; exit 1; }
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
  fi
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
: > "$out/summary.txt"
failed=0
slow=1; [ "$dev" = cpu ] && slow=4  # the rehearsal's limits: CPU interpreting, on a 2-core machine
step() {  # step NAME LIMIT_S CMD...: run under a time limit (x slow), log, time, record
  local name=$1 limit=$(($2 * slow)); shift 2
  local t0=$SECONDS rc
  if [ -n "${GPU_CHECK_ONLY:-}" ] && ! [[ $name =~ $GPU_CHECK_ONLY ]]; then
    echo "$name skipped (GPU_CHECK_ONLY=$GPU_CHECK_ONLY)" | tee -a "$out/summary.txt"
    return 0
  fi
  echo "[gpu_check] $name (limit ${limit} s): $*"
  $py tools/triton_cache.py inventory "$TRITON_CACHE_DIR" > "$work/triton_before.json" 2>/dev/null
  if declare -F "$1" > /dev/null; then  # a function of this script: run it in a child bash under the limit
    timeout --kill-after=10 "$limit" bash -c "set -uo pipefail; $(declare -f "$1"); $*" > "$out/$name.log" 2>&1
  else
    timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
  fi
  rc=$?
  local kern; kern="; triton: $($py tools/triton_cache.py since "$work/triton_before.json" "$TRITON_CACHE_DIR" 2>&1 | tail -n 1)"
  if [ $rc = 0 ]; then
    [ "$name" = kernels ] && kernels_state=passed
    echo "$name ok $((SECONDS - t0)) s$kern" | tee -a "$out/summary.txt"
  else
    [ $rc = 124 ] && word=TIMEOUT || word=FAILED
    [ "$name" = kernels ] && kernels_state=failed
    echo "$name $word $((SECONDS - t0)) s$kern" | tee -a "$out/summary.txt"
    tail -n 25 "$out/$name.log"
    failed=1
  fi
}
lt="$py -m longstraw_mcore"
tiny=configs/qwen3.6-tiny.yaml
if [ "$dev" = cuda ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1 || true
  interp="" gdnk=128
else
  # the CPU rehearsal: fla's kernels under Triton's interpreter (float32; key dim 16 keeps it quick)
  interp="env TRITON_INTERPRET=1" gdnk=16
fi
export work out lt py dev interp  # (the step functions run in child shells)
$py -c 'import importlib.util, importlib.metadata as md, sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available(),
      "triton", md.version("triton"), "fla-core", md.version("fla-core") if importlib.util.find_spec("fla") else None,
      "transformers", md.version("transformers"))' | tee "$out/versions.txt"

# Triton's kernels: one fixed cache path (a carried archive's group files name it), autotune results kept on
# disk (a pinned archive's records are read, a full archive's configs benchmarked once and their winners kept)
cache_default=/tmp/longstraw-triton-sm90; [ "$dev" = cpu ] && cache_default="$work/triton"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$cache_default}" TRITON_CACHE_AUTOTUNING=1 TRITON_STORE_BINARY_ONLY=1
kernels_state="not run"
if [ "$dev" = cuda ]; then  # scripts/gpu_aot.sh's archive, carried as .triton/ (a refusal: one line, and compiling)
  echo "kernel archive: $($py tools/triton_cache.py unpack .triton/triton-sm90.tar.xz --cache "$TRITON_CACHE_DIR" 2>&1 \
    | tail -n 1)" | tee -a "$out/summary.txt"
fi
$py tools/triton_cache.py inventory "$TRITON_CACHE_DIR" > "$work/triton_start.json" 2>/dev/null
finish() {  # the device's own compiles and autotune winners into $OUT (kernels packed), then the summary
  $py tools/triton_cache.py harvest "$work/triton_start.json" "$TRITON_CACHE_DIR" "$out/triton_new" \
    | tee -a "$out/summary.txt"
  if [ -d "$out/triton_new/kernels" ]; then
    tar -C "$out/triton_new" -cJf "$out/triton_new/kernels.tar.xz" kernels && rm -rf "$out/triton_new/kernels"
  fi
  case "$kernels_state" in
    passed) echo "figures count: this call's kernel tests passed" ;;
    failed) echo "figures do NOT count: this call's kernel tests failed" ;;
    *) echo "figures do not count yet: this call ran no kernel tests (a figure counts with a passing kernels step)" ;;
  esac | tee -a "$out/summary.txt"
  echo "[gpu_check] summary ($out/summary.txt):"
  cat "$out/summary.txt"
  exit $failed
}

# kernel_vs_twin NAME HF ROLLOUTS CHUNK TOL SWITCH FAST OP...: `validate` (float32, exact, gradients dumped)
# with SWITCH=plain and SWITCH=FAST (under Triton's interpreter in the CPU rehearsal), compared by
# tools/compare_validate.py -> OUT/validate_NAME.json; the FAST run's receipt names FAST for every OP
kernel_vs_twin() {
  local name=$1 hf=$2 roll=$3 chunk=$4 tol=$5 switch=$6 fast=$7
  shift 7
  rm -rf "$work/${name}_plain" "$work/${name}_fast"
  local v=(validate --hf "$hf" --rollouts "$roll" --mode exact --dump-grads)
  local o=(device=$dev model.dtype=float32 replay.chunk_len=$chunk)
  $lt "${v[@]}" --out "$work/${name}_plain" "${o[@]}" "$switch=plain" \
    && $interp $lt "${v[@]}" --out "$work/${name}_fast" "${o[@]}" "$switch=$fast" \
    && $py tools/compare_validate.py "$work/${name}_fast" "$work/${name}_plain" --tol "$tol" \
      --json "$out/validate_$name.json" \
    && $py -c 'import json, sys; k = json.load(open(sys.argv[1]))["kernels"]; print("kernels", k)
assert all(set(k[op]) == {sys.argv[2]} for op in sys.argv[3:]), k' "$work/${name}_fast/receipt.json" "$fast" "$@"
}
export -f kernel_vs_twin  # (the step functions run in child shells)

if [ "$kda" = 1 ]; then  # Kimi Delta Attention through fla (the rehearsal: the interpreter's checks, K = 16)
  if [ "$dev" = cuda ]; then
    step kda_kernels 300 $py -m pytest -q -s -p no:cacheprovider tests/gpu/test_fla_kda.py
  else
    step kda_kernels 90 $py -m pytest -q -s -p no:cacheprovider tests/unit/test_fla_interpreter.py -k kda \
      tests/gpu/test_fla_kda.py
  fi
  $py tools/make_hf_model.py "$work/hf_kda" --config configs/glm5.3-flash-tiny.yaml --seed 3 model.num_layers=4 \
    model.linear_num_heads=4 model.linear_head_dim=$gdnk > /dev/null
  $py tools/make_rollouts.py "$work/tree_kda.jsonl" --vocab 256 --prompt-len 40 --tree > /dev/null
  validate_kda() { kernel_vs_twin kda "$work/hf_kda" "$work/tree_kda.jsonl" 16 5e-3 ops.gdn fla kda_rule gdn_conv; }
  step validate_kda 150 validate_kda
  finish
fi
small="model.num_layers=2 model.full_attention_interval=2 model.linear_key_head_dim=$gdnk model.linear_value_head_dim=$gdnk"

# 1 ladder: the 27B shape at full depth (the rehearsal: the tiny model, fla under the interpreter)
if [ "$dev" = cuda ]; then
  step ladder 150 $py tools/bench_ladder.py --config configs/published/qwen3.6-27b-qlora-2m-8xh20-96gb.yaml \
    --prompt-lens 32768,131072,524288,1048576,2097152 --response-len 1024 --group-size 8 \
      --budget-s 80 --exact-prompt-lens 16384,65536,262144 --exact-budget-s 30 --peak-tflops 989.4 \
    --out "$out/ladder_27b.json" parallel.tp=1 device=cuda
else
  step ladder 75 $interp $py tools/bench_ladder.py --config $tiny --prompt-lens 64,128,100000 \
    --response-len 8 --group-size 2 --budget-s 20 --exact-prompt-lens 64,100000 --exact-budget-s 20 \
    --peak-tflops 1 --warmup-prompt 32 --out "$out/ladder_27b.json" $small model.dtype=float32 \
    replay.chunk_len=64 adapter.rank=4 adapter.base_dtype=nf4 ops.gdn=fla
fi

# 2 kernels
if [ "$dev" = cuda ]; then
  step kernels 60 $py -m pytest -q -s -p no:cacheprovider tests/gpu tests/unit/test_cpu_compat.py \
    tests/unit/test_attention_entry.py tests/unit/test_block_attention.py --ignore=tests/gpu/test_fla_kda.py
else
  step kernels 90 $py -m pytest -q -s -p no:cacheprovider tests/unit/test_fla_interpreter.py \
    tests/unit/test_dsa_interpreter.py tests/gpu
fi

# 3 warmup: every Triton path of the later steps compiled and autotuned once (the rehearsal: tiny, interpreted)
if [ "$dev" = cuda ]; then
  step warmup 150 $py tools/gpu_warmup.py --out "$out/warmup.json"
else
  step warmup 30 $interp $py tools/gpu_warmup.py --tiny --device cpu --out "$out/warmup.json"
fi

# 4 vs_transformers: the side by side (the rehearsal: tiny, the twins)
if [ "$dev" = cuda ]; then
  step vs_transformers 50 $py tools/bench_replay.py --vs-transformers --config configs/bench-hybrid-256.yaml \
    --prompt-lens 16384 --response-lens 1024 --group-sizes 8 --hf-full-copies 1 --out "$out/vs_transformers.json" \
    device=cuda model.dtype=bfloat16 model.linear_key_head_dim=128 model.linear_value_head_dim=128
else
  step vs_transformers 75 $py tools/bench_replay.py --vs-transformers --config configs/bench-hybrid-256.yaml \
    --prompt-lens 256 --response-lens 16 --group-sizes 2 --out "$out/vs_transformers.json" device=cpu
fi

# 5 glm: the DSA kernels against the twins through `validate` (the tiny GLM, 4 layers: three full indexer
# layers and a shared one, top-k 8 of a 40-token prompt), then GLM-5.2's width on the kernels
$py tools/make_hf_model.py "$work/hf_glm" --config configs/glm-5.2-tiny.yaml --seed 3 model.num_layers=4 > /dev/null
$py tools/make_rollouts.py "$work/tree_glm.jsonl" --vocab 256 --prompt-len 40 --tree > /dev/null
glm_check() {
  kernel_vs_twin glm "$work/hf_glm" "$work/tree_glm.jsonl" 16 1e-4 ops.dsa triton dsa_indexer dsa_attention \
    || return 1
  if [ "$dev" = cuda ]; then
    $py tools/bench_ladder.py --config configs/glm-5.2.yaml --prompt-lens 8192,32768,131072 --response-len 1024 \
      --group-size 8 --budget-s 25 --exact-prompt-lens 8192,32768 --exact-budget-s 10 --peak-tflops 989.4 \
      --out "$out/ladder_glm.json" model.num_layers=4 model.n_routed_experts=16 parallel.ep=1 device=cuda
  else
    $interp $py tools/bench_ladder.py --config configs/glm-5.2-tiny.yaml --prompt-lens 48,96 --response-len 4 \
      --group-size 2 --budget-s 30 --exact-prompt-lens 48 --exact-budget-s 30 --peak-tflops 1 --warmup-prompt 24 \
      --out "$out/ladder_glm.json" model.num_layers=4 model.dtype=float32 ops.dsa=triton device=cpu
  fi
}
step glm 60 glm_check

# 6 validate_fla: the tiny hybrid with 2 layers (Gated DeltaNet + attention), float32, a prefix-tree group
# (tests/hf_reference.py's weights: a decay that matters, so no gradient is a near-cancelling sum)
$py - "$work/hf32" "$gdnk" <<'PY'
import sys
sys.path.insert(0, "tests")
from hf_reference import build_hf_model, tiny_model_config
d = int(sys.argv[2])
build_hf_model(tiny_model_config(num_layers=2, full_attention_interval=2, vocab_size=512, linear_key_head_dim=d,
                                 linear_value_head_dim=d, dtype="float32"), seed=5).save_pretrained(sys.argv[1])
PY
$py tools/make_rollouts.py "$work/tree.jsonl" --vocab 512 --prompt-len 150 --tree > /dev/null
validate_fla() { kernel_vs_twin fla "$work/hf32" "$work/tree.jsonl" 64 5e-3 ops.gdn fla gdn_rule gdn_conv; }
step validate_fla 40 validate_fla

# 7 validate_f64: CUDA against the CPU (the rehearsal: the CPU run alone)
$py tools/make_hf_model.py "$work/hf" --config $tiny model.dtype=float64 > /dev/null
$py tools/make_rollouts.py "$work/rollouts.jsonl" --vocab 512 --groups 4 --prompt-len 300 --group-size 4 \
  --response-len 24 > /dev/null
validate_f64() {
  rm -rf "$work/validate_cuda" "$work/validate_cpu"
  local v=(validate --hf "$work/hf" --rollouts "$work/rollouts.jsonl" --mode exact --dump-grads)
  local o=(model.dtype=float64 replay.chunk_len=64)
  $lt "${v[@]}" --out "$work/validate_cpu" "${o[@]}" device=cpu || return 1
  [ "$dev" = cpu ] && return 0
  $lt "${v[@]}" --out "$work/validate_cuda" "${o[@]}" device=cuda \
    && $py tools/compare_validate.py "$work/validate_cuda" "$work/validate_cpu" --tol 1e-10 --tol-own 1e-6 \
      --json "$out/validate_compare.json"
}
step validate_f64 40 validate_f64

if [ "$all" = 1 ]; then  # the earlier lease's steps (bench_results/h200_gpu_check_20261204)
  step smoke 120 $lt smoke --config $tiny --steps 2 --seq-len 256 device=$dev model.dtype=bfloat16
  step train 180 $lt train --config $tiny --rollouts "$work/rollouts.jsonl" --steps 3 --save "$work/ckpt" \
    --metrics-out "$out/train_metrics.jsonl" device=$dev model.dtype=bfloat16 replay.mode=exact replay.chunk_len=64 \
    train.save_every=3 train.lr=1e-3
  step train_qlora 180 $lt train --config $tiny --rollouts "$work/rollouts.jsonl" --steps 2 \
    device=$dev model.dtype=bfloat16 adapter.rank=4 adapter.base_dtype=nf4 replay.mode=exact replay.chunk_len=64 \
    train.lr=1e-3
  offload_red=step; [ "$dev" = cpu ] && offload_red=micro_step
  step train_offload 180 $lt train --config $tiny --rollouts "$work/rollouts.jsonl" --steps 2 \
    --metrics-out "$out/train_offload_metrics.jsonl" device=$dev model.dtype=bfloat16 replay.mode=exact \
    replay.chunk_len=64 train.lr=1e-3 train.grad_reduction=$offload_red memory.optimizer_offload=true \
    memory.recompute=layer memory.state_offload=true
  step train_grad_offload 180 $lt train --config $tiny --rollouts "$work/rollouts.jsonl" --steps 2 \
    --metrics-out "$out/train_grad_offload_metrics.jsonl" device=$dev model.dtype=bfloat16 replay.mode=exact \
    replay.chunk_len=64 train.lr=1e-3 train.grad_reduction=micro_step memory.grad_offload=true \
    memory.optimizer_offload=true train.grad_bucket_mib=1
  [ "$dev" = cuda ] && step plan_vs_measured_switches 300 $py tools/plan_vs_measured.py --points cuda \
    --out "$out/plan_vs_measured_cuda.json"
fi
finish
