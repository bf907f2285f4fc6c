#!/bin/bash
# Where CubeCL's pools put each tensor: builds memgate against a copy of cubecl-server that
# prints, at every reservation of at least MWTRACE_MIN bytes (256 KiB unless set), each page of
# the sliced pools as `offset:size` in KiB (`f` marks a free slice). CubeCL's own memory log
# (cubecl.toml, `level = "full"`) has no offsets; this is how docs/memory-model/cube-pools.md,
# "Where a tied table's gradient lies", was read.
#
#   scripts/slice_trace.sh [WORK_DIR]      # a scratch clone and its own target: ~18 min cold
#   cd any-dir && MWTRACE_MIN=65536 WORK_DIR/target/release/examples/memgate --device wgpu \
#       --model small --seq 64 --batch 2 --steps 8 --stacks counter --worker counter 2> trace.txt
#
# `--worker STACK` runs the stack in this process, so the trace reaches its stderr. Lines read
# `MWTRACE reserve SIZE page_size P found BOOL | P0[...] P1[...]` (the pages after the
# reservation; `P3g` is a page a pending command guards) or `MWTRACE newpage SIZE ...`.
# Nothing here changes the repository: the patch lives in WORK_DIR only.
set -eu
WORK=${1:-/tmp/slice-trace}
REPO=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
SERVER=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cubecl-server-0.11.3 | head -1)
mkdir -p "$WORK"
rm -rf "$WORK/ws" "$WORK/cubecl-server"
git clone -q "$REPO" "$WORK/ws"
cp -r "$SERVER" "$WORK/cubecl-server"
python3 - "$WORK/cubecl-server/src/memory_management/memory_pool" <<'PY'
import sys
root = sys.argv[1]
threshold = 'std::env::var("MWTRACE_MIN").ok().and_then(|v| v.parse().ok()).unwrap_or(262144u64)'

def edit(name, old, new):
    path = f"{root}/{name}"
    text = open(path).read()
    assert old in text, f"{name}: the cubecl-server source is not the one this script knows"
    open(path, "w").write(text.replace(old, new, 1))

edit("sliced_pool.rs", """        if handle.is_some() {
            self.largest_alloc = self.largest_alloc.max(size);
        }
        handle
    }""", f"""        if handle.is_some() {{
            self.largest_alloc = self.largest_alloc.max(size);
        }}
        if size >= {threshold} {{
            std::eprintln!("MWTRACE reserve {{}} page_size {{}} found {{}} | {{}}", size, self.page_size, handle.is_some(), self.slice_trace());
        }}
        handle
    }}

    fn slice_trace(&self) -> alloc::string::String {{
        let mut out = alloc::string::String::new();
        for (i, (page, _)) in self.pages.iter().enumerate() {{
            out += &alloc::format!("P{{}}{{}}[{{}}] ", i, if page.is_guarded() {{ "g" }} else {{ "" }}, page.slice_trace());
        }}
        out
    }}""")
edit("sliced_pool.rs", """        self.pages.push((page, storage_id));""", f"""        self.pages.push((page, storage_id));
        if size >= {threshold} {{
            std::eprintln!("MWTRACE newpage {{}} page_size {{}} | {{}}", size, self.page_size, self.slice_trace());
        }}""")
edit("memory_page.rs", """    /// Whether the page's storage id is backed by a real device allocation.""", """    pub(crate) fn slice_trace(&self) -> String {
        let mut out = String::new();
        for slice in &self.slices {
            let size = slice.effective_size();
            if size < 16384 && slice.is_free() {
                continue;
            }
            let offset = slice.storage.utilization.offset;
            let free = if slice.is_free() { "f" } else { "" };
            out += &format!("{}:{}{} ", offset / 1024, size / 1024, free);
        }
        out
    }

    /// Whether the page's storage id is backed by a real device allocation.""")
PY
printf '\n[patch.crates-io]\ncubecl-server = { path = "%s/cubecl-server" }\n' "$WORK" >> "$WORK/ws/Cargo.toml"
cd "$WORK/ws"
CARGO_TARGET_DIR="$WORK/target" cargo build --release --example memgate -p burn-memwall-examples \
    --no-default-features --features flex,wgpu
echo "built: $WORK/target/release/examples/memgate"
