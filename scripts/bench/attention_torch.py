#!/usr/bin/env python3
"""PyTorch's attention backends on the shapes loom_attention_bench times, for a side-by-side
figure on the same GPU: causal bf16, [B, H, S, D] from a packed [B, S, 3, H, D] tensor,
forward and forward+backward, timed with CUDA events after warm-up (median of 20).

FLOPs as loom_attention_bench counts them: forward 4 B H S^2 D halved for causal,
backward 2.5x the forward.

    python3 scripts/bench/attention_torch.py [B S H D]...   (default 16 1024 12 64 4 2048 16 128)
A benchmark tool only; loom does not depend on it.
"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def median_ms(fn, iters=20, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def bench(B, S, H, D):
    qkv = torch.randn(B, S, 3, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = 0.1 * torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    flops = 4.0 * B * H * S * S * D * 0.5
    print(f"B {B} S {S} H {H} D {D} (bf16, causal, packed QKV) - PyTorch {torch.__version__}")
    backends = [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                ("efficient", SDPBackend.EFFICIENT_ATTENTION)]
    for name, backend in backends:
        def fwd():
            q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def fwd_bwd():
            out = fwd()
            out.backward(dout)

        try:
            with sdpa_kernel([backend]):
                f_ms = median_ms(lambda: fwd())
                fb_ms = median_ms(fwd_bwd)
        except RuntimeError as e:  # a backend that does not take this shape
            print(f"  {name:9s} unavailable: {str(e).splitlines()[0][:100]}")
            continue
        print(f"  {name:9s} forward {f_ms:8.3f} ms ({flops / (f_ms * 1e9):6.1f} TFLOP/s) | "
              f"forward+backward {fb_ms:8.3f} ms ({3.5 * flops / (fb_ms * 1e9):6.1f} TFLOP/s)")


def main():
    args = [int(a) for a in sys.argv[1:]]
    shapes = [tuple(args[i:i + 4]) for i in range(0, len(args) - 3, 4)] or [(16, 1024, 12, 64), (4, 2048, 16, 128)]
    for shape in shapes:
        bench(*shape)


if __name__ == "__main__":
    main()
