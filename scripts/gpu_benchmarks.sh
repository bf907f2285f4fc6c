#!/bin/bash
# The measurements of docs/BENCHMARKS.md's section "On a GPU", on whatever GPU wgpu finds.
#
#   cargo build --release --workspace --no-default-features --features flex,wgpu --benches --examples
#   scripts/gpu_benchmarks.sh [OUT_DIR]
#
# Each memgate stack runs on its own and under its own time limit, so that one stack that hangs
# or runs out of memory costs only its row; a run that could not end within BUDGET_S seconds of
# the start (default 720: a lent GPU gives 15 minutes, its start included) is skipped, so the most
# wanted rows come first: the optimizer-state levers that only a device with memory of its own
# runs (issue 22), beside `memwall` in the same run, then the stacks and op benches measured on
# 2026-12-04, again at this commit. Rows are appended to OUT_DIR/*.jsonl (one JSON
# document per run); the printed tables go to OUT_DIR/log.txt. On a machine without cargo, set
# BIN_DIR to a folder holding the binaries built elsewhere: `memgate` and the benches'
# executables renamed `flash_attention` and `fused_linear_cross_entropy`.
set -u
OUT=${1:-gpu-benchmarks}
FEATURES=(--no-default-features --features flex,wgpu)
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
export BURN_DEVICE=wgpu
BUDGET_S=${BUDGET_S:-720}
start=$(date +%s)
say() { echo "[t+$(($(date +%s) - start))s] $*"; }

# measure LIMIT_S FILE PROGRAM ARGS...: runs the example `memgate` or a bench with ARGS and
# appends its JSON rows to OUT/FILE.
measure() {
  local limit=$1 file=$2 name=$3
  shift 3
  if (($(date +%s) - start + limit > BUDGET_S)); then
    say "skipped, $limit s would pass the budget of $BUDGET_S s: $name $*"
    return
  fi
  local command
  if [ -n "${BIN_DIR:-}" ]; then
    command=("$BIN_DIR/$name")
  elif [ "$name" = memgate ]; then
    command=(cargo run --release "${FEATURES[@]}" --example memgate --)
  else
    command=(cargo bench "${FEATURES[@]}" --bench "$name" --)
  fi
  rm -f "$OUT/.row.json"
  say "${command[*]} $*"
  timeout "$limit" "${command[@]}" "$@" --json "$OUT/.row.json"
  say "exit $?"
  [ -s "$OUT/.row.json" ] && cat "$OUT/.row.json" >>"$OUT/$file"
  rm -f "$OUT/.row.json"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null
llama=(--model llama-1b --seq 2048 --batch 1 --steps 3)
gpt2=(--model gpt2-124m --seq 1024 --batch 8 --steps 4)
# The levers of issue 22. One block at a time measures the first block's turn: llama-1b's head,
# gpt2-124m's top layer (the blocks go down from the output).
measure 120 levers-llama-1b.jsonl memgate "${llama[@]}" --stacks memwall
for stack in memwall-offload memwall-host-update; do
  measure 150 levers-llama-1b.jsonl memgate "${llama[@]}" --stacks "$stack"
done
measure 120 levers-llama-1b.jsonl memgate "${llama[@]}" --stacks memwall-badam --weights-on-host
measure 60 levers-gpt2-124m.jsonl memgate "${gpt2[@]}" --stacks memwall
for stack in memwall-offload memwall-host-update; do
  measure 90 levers-gpt2-124m.jsonl memgate "${gpt2[@]}" --stacks "$stack"
done
for stack in memwall-adam8 memwall-adam4 memwall-badam; do
  measure 120 levers-llama-1b.jsonl memgate "${llama[@]}" --stacks "$stack"
  measure 60 levers-gpt2-124m.jsonl memgate "${gpt2[@]}" --stacks "$stack"
done
for stack in baseline flash+fused flash+fused+savers memwall-sgd; do
  measure 120 memgate-llama-1b.jsonl memgate "${llama[@]}" --stacks "$stack"
done
for stack in baseline flash+fused flash+fused+savers; do
  measure 60 memgate-gpt2-124m.jsonl memgate "${gpt2[@]}" --stacks "$stack"
done
measure 120 flash_attention.jsonl flash_attention --seqs 1024,4096,16384 --repeats 5
measure 120 fused_linear_cross_entropy.jsonl fused_linear_cross_entropy \
  --vocabs 32000,128256 --tokens 4096,16384 --d 2048 --repeats 5
say done
