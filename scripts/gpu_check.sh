#!/usr/bin/env bash
# The GPU check: one command, one CUDA GPU, under 8 minutes. Each step logs to OUT/<step>.log and
# leaves JSON where it measures something; OUT/summary.txt lists every step with ok/FAILED and seconds.
#   1 smoke       `longstraw smoke`, tiny model, bf16 (count_parameters / grad_norm on NCCL)
#   2 train       `longstraw train`, tiny, bf16, exact mode, 3 steps with a checkpoint -> train_metrics.jsonl
#   2b offload    `longstraw train` with memory.optimizer_offload (Megatron's HybridDeviceOptimizer), layer
#                 recompute and the prompt state in host memory; micro_step with memory.grad_offload (pinned
#                 gradient staging); tools/plan_vs_measured.py --points cuda:
#                 the memory-switch points, device and host bytes planned against measured
#   3 validate    `longstraw validate`, tiny, float64, exact, the same HF weights on CUDA and on CPU;
#                 tools/compare_validate.py -> validate_compare.json (loss, log-probs, grads normwise <= 1e-10;
#                 each tensor against its own max <= 1e-6: near-cancelling A_log sums, see the tool)
#   4 tests       the unit tests that apply on CUDA (tests/gpu, cpu_compat's cuda case, the attention ops)
#   5 bench       tools/bench_replay.py at Qwen3.6-27B width, 4 layers, bf16: P=128K detached and
#                 P=32K exact (R=1K, G=2) -> bench_*.json (tokens/s per phase, peak memory, TFLOP/s
#                 and the fraction of the H200's dense bf16 peak, 989 TFLOP/s); P=128K detached again
#                 with recompute, the state in host memory as fp8 (bench_128k_offload.json); the side-by-side
#                 with transformers (its SDPA and, where installed, fla as its fast paths), bf16, P=16K/64K
#                 -> vs_transformers.json
# Usage:
#   bash scripts/gpu_check.sh [OUT]                  on the CUDA machine (OUT defaults to $OUT, or runs/gpu_check)
#   bash scripts/gpu_check.sh --cpu-rehearsal [OUT]  every step on the CPU at tiny sizes: tests this script
#   GPU_CHECK_ONLY='^(smoke|train.*)$' bash scripts/gpu_check.sh ...   only the steps whose names match (bash
#                                                    regex); the rest are listed as skipped. Lets a short device
#                                                    lease run the correctness steps and the benches apart.
# On a bare CUDA image without megatron-core, run scripts/gpu_wheels.sh where pip works first and carry .whl/.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
dev=cuda
if [ "${1:-}" = "--cpu-rehearsal" ]; then dev=cpu; shift; fi
out="${1:-${OUT:-runs/gpu_check}}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
work="$out/work"
mkdir -p "$work"
if [ "$dev" = cpu ]; then
  py="$(bash scripts/env.sh --test)/bin/python"
else
  py=python3
  if ! $py -c 'import megatron.core' >/dev/null 2>&1; then
    [ -d .whl ] || { echo "megatron-core is missing and there is no .whl/ (run scripts/gpu_wheels.sh)"; exit 1; }
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
  fi
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
: > "$out/summary.txt"
failed=0
step() {  # step NAME CMD...: run, log, time, record
  local name=$1; shift
  local t0=$SECONDS
  if [ -n "${GPU_CHECK_ONLY:-}" ] && ! [[ $name =~ $GPU_CHECK_ONLY ]]; then
    echo "$name skipped (GPU_CHECK_ONLY=$GPU_CHECK_ONLY)" | tee -a "$out/summary.txt"
    return 0
  fi
  echo "[gpu_check] $name: $*"
  if "$@" > "$out/$name.log" 2>&1; then
    echo "$name ok $((SECONDS - t0)) s" | tee -a "$out/summary.txt"
  else
    echo "$name FAILED $((SECONDS - t0)) s" | tee -a "$out/summary.txt"
    tail -n 25 "$out/$name.log"
    failed=1
  fi
}
tiny=configs/qwen3.6-tiny.yaml
lt="$py -m longstraw_mcore"
[ "$dev" = cuda ] && { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1 || true; }
$py -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())' \
  | tee "$out/versions.txt"

step smoke $lt smoke --config $tiny --steps 2 --seq-len 256 device=$dev model.dtype=bfloat16
$py tools/make_rollouts.py "$work/rollouts.jsonl" --vocab 512 --groups 4 --prompt-len 300 --group-size 4 \
  --response-len 24 > /dev/null
step train $lt train --config $tiny --rollouts "$work/rollouts.jsonl" --steps 3 --save "$work/ckpt" \
  --metrics-out "$out/train_metrics.jsonl" device=$dev model.dtype=bfloat16 replay.mode=exact replay.chunk_len=64 \
  train.save_every=3 train.lr=1e-3
step train_qlora $lt train --config $tiny --rollouts "$work/rollouts.jsonl" --steps 2 \
  device=$dev model.dtype=bfloat16 adapter.rank=4 adapter.base_dtype=nf4 replay.mode=exact replay.chunk_len=64 \
  train.lr=1e-3
# the memory switches (config/memory.py): Megatron's HybridDeviceOptimizer (CUDA parameters only; the CPU
# rehearsal offloads the micro_step shards), layer recompute, the prompt state in host memory
offload_red=step; [ "$dev" = cpu ] && offload_red=micro_step
step train_offload $lt train --config $tiny --rollouts "$work/rollouts.jsonl" --steps 2 \
  --metrics-out "$out/train_offload_metrics.jsonl" device=$dev model.dtype=bfloat16 replay.mode=exact \
  replay.chunk_len=64 train.lr=1e-3 train.grad_reduction=$offload_red memory.optimizer_offload=true \
  memory.recompute=layer memory.state_offload=true
# no full-size gradient on the device: micro_step shards, gradients staged in pinned host memory as
# autograd completes them (memory/grad_stage.py), the optimizer on the host too
step train_grad_offload $lt train --config $tiny --rollouts "$work/rollouts.jsonl" --steps 2 \
  --metrics-out "$out/train_grad_offload_metrics.jsonl" device=$dev model.dtype=bfloat16 replay.mode=exact \
  replay.chunk_len=64 train.lr=1e-3 train.grad_reduction=micro_step memory.grad_offload=true \
  memory.optimizer_offload=true train.grad_bucket_mib=1
if [ "$dev" = cuda ]; then
  step plan_vs_measured_switches $py tools/plan_vs_measured.py --points cuda --out "$out/plan_vs_measured_cuda.json"
fi
$py tools/make_hf_model.py "$work/hf" --config $tiny model.dtype=float64 > /dev/null
step validate_$dev $lt validate --hf "$work/hf" --rollouts "$work/rollouts.jsonl" --out "$work/validate_$dev" \
  --mode exact --dump-grads device=$dev model.dtype=float64 replay.chunk_len=64
if [ "$dev" = cuda ]; then
  step validate_cpu $lt validate --hf "$work/hf" --rollouts "$work/rollouts.jsonl" --out "$work/validate_cpu" \
    --mode exact --dump-grads device=cpu model.dtype=float64 replay.chunk_len=64
  step validate_compare $py tools/compare_validate.py "$work/validate_cuda" "$work/validate_cpu" --tol 1e-10 \
    --tol-own 1e-6 --json "$out/validate_compare.json"
fi
step tests $py -m pytest -q -p no:cacheprovider tests/gpu tests/unit/test_cpu_compat.py \
  tests/unit/test_attention_entry.py tests/unit/test_block_attention.py
if [ "$dev" = cuda ]; then
  big="--config configs/qwen3.6-27b.yaml --response-lens 1024 --group-sizes 2 --naive-max-prompt 0 --peak-tflops 989"
  step bench_128k_detached $py tools/bench_replay.py $big --prompt-lens 131072 --modes detached \
    --out "$out/bench_128k_detached.json" model.num_layers=4 parallel.tp=1 device=cuda
  step bench_32k_exact $py tools/bench_replay.py $big --prompt-lens 32768 --modes exact \
    --out "$out/bench_32k_exact.json" model.num_layers=4 parallel.tp=1 device=cuda
  step bench_128k_offload $py tools/bench_replay.py $big --prompt-lens 131072 --modes detached \
    --out "$out/bench_128k_offload.json" model.num_layers=4 parallel.tp=1 device=cuda memory.recompute=layer \
    memory.state_offload=true memory.state_dtype=fp8
  step vs_transformers $py tools/bench_replay.py --vs-transformers --config configs/bench-hybrid-256.yaml \
    --prompt-lens 16384,65536 --response-lens 1024 --group-sizes 8 --hf-full-copies 1 --out "$out/vs_transformers.json" \
    device=cuda model.dtype=bfloat16 replay.keep_prompt_graph_mib=16384
else
  step bench_rehearsal $py tools/bench_replay.py --config $tiny --prompt-lens 512 --response-lens 32 --group-sizes 2 \
    --modes detached,exact --naive-max-prompt 0 --peak-tflops 1 --out "$out/bench_rehearsal.json" device=cpu
  step vs_transformers_rehearsal $py tools/bench_replay.py --vs-transformers --config configs/bench-hybrid-256.yaml \
    --prompt-lens 256 --response-lens 16 --group-sizes 2 --out "$out/vs_transformers.json" device=cpu \
    replay.keep_prompt_graph_mib=64
fi
echo "[gpu_check] summary ($out/summary.txt):"
cat "$out/summary.txt"
exit $failed
