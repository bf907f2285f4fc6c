#!/bin/bash
# Builds what scripts/gpu_benchmarks.sh runs on a GPU machine and packs it under .gpu/ (keep it
# out of git: `echo /.gpu/ >> .git/info/exclude`):
# - .gpu/wgpu: the default features (Flex, autotune) with wgpu, as a user builds for a GPU;
# - .gpu/vulkan: the same with the SPIR-V compiler (`vulkan`), for the `vulkan` stage.
# Each binary is stripped and packed with xz, so that each folder fits what one device call
# carries (64 MiB with the working tree): carry `.gpu/wgpu` to the first call and `.gpu/vulkan`
# to a second on the same machine. Each set builds in a target folder of its own (a cold build
# each), so that switching features rebuilds nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

# pack DIR FEATURES TARGETS...: builds TARGETS with FEATURES and packs their executables in DIR.
pack() {
  local dir=$1 features=$2
  shift 2
  mkdir -p "$dir"
  CARGO_TARGET_DIR="target/gpu-$features" cargo build --release --features "$features" \
    --message-format=json-render-diagnostics "$@" |
    python3 -c '
import json, sys
for line in sys.stdin:
    message = json.loads(line)
    if message.get("reason") == "compiler-artifact" and message.get("executable"):
        print(message["target"]["name"], message["executable"])
' |
    while read -r name executable; do
      cp "$executable" "$dir/$name"
      strip "$dir/$name"
      xz -9 -T2 -f "$dir/$name"
      echo "$dir/$name.xz: $(du -h "$dir/$name.xz" | cut -f1)"
    done
}

pack .gpu/wgpu wgpu --example memgate --bench flash_attention --bench fused_linear_cross_entropy \
  --bench matmul_rate
pack .gpu/vulkan vulkan --bench flash_attention --bench fused_linear_cross_entropy \
  --bench matmul_rate
