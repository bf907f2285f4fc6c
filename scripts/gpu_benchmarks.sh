#!/bin/bash
# The measurements of docs/BENCHMARKS.md's section "On a GPU", on whatever GPU wgpu finds, with
# PyTorch on the same GPU as the anchor. Both sides autotuned: build with the default features.
#
#   scripts/pack_gpu_binaries.sh             # here: builds, strips and packs the binaries in .gpu/
#   STAGES=anchors,flash,fused scripts/gpu_benchmarks.sh OUT_DIR     # on the GPU machine
#   STAGES=memgate,vulkan,levers scripts/gpu_benchmarks.sh OUT_DIR   # a second call, same machine
#
# Stages, in the order of issue 61's questions (STAGES picks and orders them; default all):
# - anchors: a square f32 matmul through Burn (the GPU's measured rate) and PyTorch's anchors
#   (scripts/torch_anchors.py: SDPA forward + backward f32 and bf16, full-logits cross-entropy,
#   square matmuls), at the benches' shapes;
# - flash: flash attention forward + backward beside Burn's path at 1024/4096/16384 tokens;
# - fused: the fused linear + cross-entropy beside Burn's path at vocab 32000/128256;
# - memgate: `baseline` and `memwall` on llama-1b (seq 2048) and gpt2-124m;
# - vulkan: flash and fused again from the SPIR-V build (cooperative matrices where the kernels
#   use them);
# - levers: issue 22's optimizer-state and offload levers beside `memwall`.
# Each run has its own time limit, so one that hangs or runs out of memory costs only its row;
# a run that could not end within BUDGET_S seconds of the start (default 540: one device call
# may run 600) is skipped. Rows are appended to OUT_DIR/*.jsonl (one JSON document per run);
# the printed tables go to OUT_DIR/log.txt. BIN_DIR (default .gpu/wgpu) and VULKAN_BIN_DIR
# (default .gpu/vulkan) hold the binaries `memgate`, `flash_attention`,
# `fused_linear_cross_entropy` and `matmul_rate`, unpacked from their `.xz` if need be; without
# them the stages build with cargo.
set -u
OUT=${1:-gpu-benchmarks}
STAGES=${STAGES:-anchors,flash,fused,memgate,vulkan,levers}
BUDGET_S=${BUDGET_S:-540}
BIN_DIR=${BIN_DIR:-.gpu/wgpu}
VULKAN_BIN_DIR=${VULKAN_BIN_DIR:-.gpu/vulkan}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
start=$(date +%s)
say() { echo "[t+$(($(date +%s) - start))s] $*"; }

for dir in "$BIN_DIR" "$VULKAN_BIN_DIR"; do
  for packed in "$dir"/*.xz; do
    [ -e "$packed" ] && [ ! -e "${packed%.xz}" ] && xz -dk "$packed" && chmod +x "${packed%.xz}"
  done
done

# run LIMIT_S FILE DIR FEATURES PROGRAM ARGS...: runs the example `memgate` or a bench from DIR
# (or built with FEATURES) with ARGS and appends its JSON rows to OUT/FILE.
run() {
  local limit=$1 file=$2 dir=$3 features=$4 name=$5
  shift 5
  if (($(date +%s) - start + limit > BUDGET_S)); then
    say "skipped, $limit s would pass the budget of $BUDGET_S s: $name $*"
    return
  fi
  local command
  if [ -x "$dir/$name" ]; then
    command=("$dir/$name")
  elif [ "$name" = memgate ]; then
    command=(cargo run --release --features "$features" --example memgate --)
  else
    command=(cargo bench --features "$features" --bench "$name" --)
  fi
  rm -f "$OUT/.row.json"
  say "${command[*]} $*"
  timeout "$limit" "${command[@]}" "$@" --json "$OUT/.row.json"
  say "exit $?"
  [ -s "$OUT/.row.json" ] && cat "$OUT/.row.json" >>"$OUT/$file"
  rm -f "$OUT/.row.json"
}
wgpu() { BURN_DEVICE=wgpu run "$1" "$2" "$BIN_DIR" wgpu "${@:3}"; }
vulkan() { BURN_DEVICE=vulkan run "$1" "vulkan-$2" "$VULKAN_BIN_DIR" vulkan "${@:3}"; }

flash_args=(--seqs 1024,4096,16384 --paths flash,blockwise,burn --repeats 5)
fused_args=(--vocabs 32000,128256 --tokens 4096,16384 --d 2048 --repeats 5)
llama=(--model llama-1b --seq 2048 --batch 1 --steps 3)
gpt2=(--model gpt2-124m --seq 1024 --batch 8 --steps 4)

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null
IFS=, read -ra stages <<<"$STAGES"
for stage in "${stages[@]}"; do
  say "stage $stage"
  case $stage in
  anchors)
    wgpu 60 matmul_rate.jsonl matmul_rate --sizes 4096,8192 --repeats 5
    if (($(date +%s) - start + 150 > BUDGET_S)); then
      say "skipped, 150 s would pass the budget of $BUDGET_S s: scripts/torch_anchors.py"
    else
      say "python3 scripts/torch_anchors.py"
      PYTHONUNBUFFERED=1 timeout 150 python3 scripts/torch_anchors.py "$OUT/torch_anchors.json"
      say "exit $?"
    fi
    ;;
  flash) wgpu 150 flash_attention.jsonl flash_attention "${flash_args[@]}" ;;
  fused) wgpu 150 fused_linear_cross_entropy.jsonl fused_linear_cross_entropy "${fused_args[@]}" ;;
  memgate)
    for stack in baseline memwall; do
      wgpu 120 memgate-llama-1b.jsonl memgate "${llama[@]}" --stacks "$stack"
      wgpu 60 memgate-gpt2-124m.jsonl memgate "${gpt2[@]}" --stacks "$stack"
    done
    ;;
  vulkan)
    vulkan 60 matmul_rate.jsonl matmul_rate --sizes 8192 --repeats 5
    vulkan 150 flash_attention.jsonl flash_attention "${flash_args[@]}"
    vulkan 150 fused_linear_cross_entropy.jsonl fused_linear_cross_entropy "${fused_args[@]}"
    ;;
  levers)
    for stack in memwall-offload memwall-host-update memwall-adam8 memwall-adam4 memwall-badam; do
      wgpu 150 levers-llama-1b.jsonl memgate "${llama[@]}" --stacks "$stack"
    done
    wgpu 120 levers-llama-1b.jsonl memgate "${llama[@]}" --stacks memwall-badam --weights-on-host
    ;;
  *) say "unknown stage $stage" ;;
  esac
done
say done
