#!/usr/bin/env python3
"""PyTorch on the same GPU as the anchors of scripts/gpu_benchmarks.sh's rows.

    python3 scripts/torch_anchors.py OUT.json [--seqs 1024,4096,16384] [--heads 8] [--d 64]
        [--vocabs 32000,128256] [--tokens 4096,16384] [--hidden 2048] [--repeats 5]

- sdpa: causal `scaled_dot_product_attention` forward + backward on [1, heads, seq, d], f32
  (PyTorch's memory-efficient kernel) and bf16 (its FlashAttention-2 kernel), the shapes of
  benches/flash_attention.rs;
- cross_entropy: full logits `hidden @ weight.T` then `cross_entropy`, forward + backward, the
  shapes of benches/fused_linear_cross_entropy.rs, f32;
- matmul: a square f32 product with TF32 off (the like-for-like rate of Burn's f32 matmul) and
  on (what the tensor cores give f32 inputs).

Each row is the median of `repeats` timed runs after one warm-up, timed with CUDA events, and
the peak bytes allocated above the inputs. Rows that do not fit in memory say so.
"""

import argparse
import json
import statistics

import torch
import torch.nn.functional as F


def timed(step, repeats):
    """Median seconds of `step()` and its peak bytes above what was allocated before."""
    step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    times = []
    peak = 0
    for _ in range(repeats):
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
        peak = max(peak, torch.cuda.max_memory_allocated() - before)
    return statistics.median(times), peak


def sdpa_rows(args):
    for dtype in (torch.float32, torch.bfloat16):
        for seq in args.seqs:
            shape = (1, args.heads, seq, args.d)
            q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
                       for _ in range(3))
            d_out = torch.randn(shape, device="cuda", dtype=dtype)

            def step():
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                out.backward(d_out)
                q.grad = k.grad = v.grad = None

            row = {"anchor": "sdpa", "dtype": str(dtype).removeprefix("torch."), "seq": seq,
                   "heads": args.heads, "d": args.d}
            try:
                row["median_s"], row["peak_bytes"] = timed(step, args.repeats)
                # Useful FLOPs of causal attention: half of 4·s²·d forward, 2.5× that backward.
                flops = 3.5 * 4 * seq * seq * args.d * args.heads / 2
                row["tflops"] = flops / row["median_s"] / 1e12
            except torch.OutOfMemoryError as error:
                row["error"] = str(error).splitlines()[0]
            del q, k, v, d_out
            torch.cuda.empty_cache()
            yield row


def cross_entropy_rows(args):
    for vocab in args.vocabs:
        for tokens in args.tokens:
            hidden = torch.randn(tokens, args.hidden, device="cuda", requires_grad=True)
            weight = (torch.randn(vocab, args.hidden, device="cuda") / args.hidden ** 0.5)
            weight.requires_grad_(True)
            targets = torch.randint(0, vocab, (tokens,), device="cuda")

            def step():
                loss = F.cross_entropy(hidden @ weight.T, targets)
                loss.backward()
                hidden.grad = weight.grad = None

            row = {"anchor": "cross_entropy", "dtype": "float32", "vocab": vocab,
                   "tokens": tokens, "d": args.hidden}
            try:
                row["median_s"], row["peak_bytes"] = timed(step, args.repeats)
            except torch.OutOfMemoryError as error:
                row["error"] = str(error).splitlines()[0]
            del hidden, weight, targets
            torch.cuda.empty_cache()
            yield row


def matmul_rows(args):
    n = 8192
    a, b = torch.randn(n, n, device="cuda"), torch.randn(n, n, device="cuda")
    for tf32 in (False, True):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        median_s, _ = timed(lambda: a @ b, args.repeats)
        yield {"anchor": "matmul", "dtype": "tf32" if tf32 else "float32", "n": n,
               "median_s": median_s, "tflops": 2 * n ** 3 / median_s / 1e12}
    torch.backends.cuda.matmul.allow_tf32 = False


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    ints = lambda text: [int(x) for x in text.split(",")]
    parser.add_argument("--seqs", type=ints, default=[1024, 4096, 16384])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--vocabs", type=ints, default=[32000, 128256])
    parser.add_argument("--tokens", type=ints, default=[4096, 16384])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    for rows_of in (matmul_rows, sdpa_rows, cross_entropy_rows):
        for row in rows_of(args):
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(args.out, "w") as out:
        json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
