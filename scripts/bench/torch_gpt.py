#!/usr/bin/env python3
"""PyTorch reference of loom's GPT for scripts/bench-gpu.sh (a benchmark tool; loom never uses it).

The model is loom's default composition (engine/model, plugins/layer/*), layer for layer:
  embedding  word table [Vp, C] (Vp = vocab padded up to a multiple of vocab_divisor * tp = 128,
             50257 -> 50304) + learned position table [T, C]; no dropout (loom's default 0)
  block x L  attention: x + proj(attn(LN(x))), LN eps 1e-5, packed QKV Linear(C, 3C) with bias,
             causal softmax(QK^T / sqrt(C/heads)) V, output projection Linear(C, C) with bias
             mlp:       x + fc2(gelu_tanh(fc1(LN(x)))), fc1 Linear(C, 4C), fc2 Linear(4C, C), biases
  lm_head    final LN, logits = LN(x) W_word^T over the padded vocab (tied to the word table),
             cross-entropy over the real vocab columns only (loom's valid_cols), mean over tokens
  init       N(0, 0.02) for weight matrices and both tables, N(0, 0.02 / sqrt(2L)) for proj and fc2,
             zero biases, LayerNorm weight 1 / bias 0 (loom's LOOM_INIT_*)
  optimizer  AdamW(fused=True), betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on the weight matrices
             and both embedding tables, none on biases and LayerNorm (loom's no_weight_decay);
             clip_grad_norm_(1.0); loom's learning-rate schedule (linear warm-up, cosine decay)
Parameters: Vp*C + T*C + L*(12*C^2 + 13*C) + 2*C (the tied table counted once), e.g. GPT-2 124M
at T = 1024: 124,475,904, the count `loom plan configs/gpt2_124m.toml` prints.

FLOPs per step, the formula of loom's trainer (engine/train/trainer.cpp: 3 x Model::forward_flops(),
the sum of the layers' forward_flops(); plugins/layer/{attention,mlp,lm_head}), used for every row:
  forward, per layer:  2*N*C*3C (QKV) + 4*N*T*C (QK^T and PV, the causal half counted as full)
                       + 2*N*C*C (projection) + 4*N*C*F (fc1, fc2; F = 4C)
  forward, lm_head:    2*N*C*Vp (logits over the padded vocab); embedding 0
  step = 3 x forward (backward = 2 x forward), with N = B*T tokens; i.e.
  FLOPs/step = 6*N*P_gemm + 12*L*N*T*C, P_gemm = L*(4C^2 + 2CF) + C*Vp = the weight-matrix elements of
  the GEMMs (biases, LayerNorm and the position table excluded).
MFU = FLOPs/step / (step time * peak); peak 989.4 TFLOP/s (dense bf16, H100 SXM / H200) for bf16,
494.7 (dense TF32) for fp32, or --peak-tflops.

Modes: eager, or compile (torch.compile of the model, loss included). Precision: bf16 = autocast to
bf16 around forward and loss, fp32 master weights and gradients (loom's device.param_dtype = bf16
keeps fp32 master weights and moments too); fp32 = fp32 with TF32 tensor cores allowed (loom's
device.options.tf32 = true). Attention is F.scaled_dot_product_attention(is_causal=True).

Timing: random token batches [B, T+1] (fixed seed, a pool of 4 pinned host batches copied per step,
as loom copies each microbatch to the device), --warmup steps, then --steps steps each between two
CUDA events; the median is ms/step. Peak memory is torch.cuda.max_memory_allocated() over the timed
steps (reset after warm-up; parameters, gradients and optimizer state are all allocated by then).
No host sync inside a step, so the events time the GPU's throughput; loom's ms (its --metrics) is
each step's wall clock, which ends with a host sync (the loss): the same thing once the GPU is the
bottleneck, slightly more for small launch-bound steps.

Output: '#' lines of information, then one JSON line per measurement:
  {"engine": "torch", "model", "dtype", "mode", "B", "T", "ms_step", "tokens_s", "mfu",
   "peak_mem_gib", "params", "flops_step", "peak_tflops", "loss"}
--params-only prints the parameter count and FLOPs/step without importing torch.
"""
import argparse
import json
import math
import statistics
import sys
import time

MODELS = {
    # name: (layers, hidden, heads, peak lr, min lr) as in configs/gpt2_124m.toml, configs/gpt_1p3b.toml,
    # configs/llama_1b.toml
    "gpt2-124m": (12, 768, 12, 6e-4, 6e-5),
    "gpt-1.3b": (24, 2048, 16, 2e-4, 2e-5),
    "llama-1b": (16, 2048, 32, 2e-4, 2e-5),
}
# Llama-shaped models (configs/llama_1b.toml, the shape of Llama 3.2 1B): RMSNorm (eps 1e-5) before
# each sublayer and the head, no biases, rotary embeddings (rotate-half, base `theta`) on q and k and
# no position table, grouped-query attention with `groups` key/value heads, a SwiGLU MLP of width
# `ffn` (fc1 makes [gate | up], silu(gate) * up), its own vocabulary.
LLAMA = {"llama-1b": {"groups": 8, "ffn": 8192, "vocab": 128256, "theta": 500000.0}}
VOCAB = 50257
VOCAB_DIVISOR = 128  # loom's model.vocab_divisor * tp (tp = 1)
PEAK_TFLOPS = {"bf16": 989.4, "fp32": 494.7}  # dense H100 SXM / H200: bf16, TF32


def padded_vocab(vocab=VOCAB, divisor=VOCAB_DIVISOR):
    return (vocab + divisor - 1) // divisor * divisor


def param_count(L, C, T, Vp, F=None):
    F = F or 4 * C
    per_layer = (2 * C + 3 * C * C + 3 * C + C * C + C) + (2 * C + C * F + F + F * C + C)
    return Vp * C + T * C + L * per_layer + 2 * C


def flops_per_step(L, C, T, Vp, B, F=None):
    F = F or 4 * C
    N = B * T
    layer = 2 * N * C * 3 * C + 4 * N * T * C + 2 * N * C * C + 4 * N * C * F
    return 3.0 * (L * layer + 2 * N * C * Vp)


def vocab_of(model):
    return LLAMA[model]["vocab"] if model in LLAMA else VOCAB


def model_param_count(model, T):
    """The parameter count of MODELS[model] at sequence length T (the tied table once)."""
    L, C, H = MODELS[model][:3]
    Vp = padded_vocab(vocab_of(model))
    if model not in LLAMA:
        return param_count(L, C, T, Vp)
    g, F = LLAMA[model]["groups"], LLAMA[model]["ffn"]
    kv = C // H * g  # the key (and the value) width
    per_layer = C + C * (C + 2 * kv) + C * C + C + C * 2 * F + F * C  # norms, qkv, proj, fc1, fc2
    return Vp * C + L * per_layer + C


def model_flops_per_step(model, B, T):
    """loom's FLOP count of a training step of MODELS[model] (3 x forward): as flops_per_step, with
    grouped-query QKV (C + 2 kv columns) and SwiGLU (fc1 2F columns) for the Llama shapes."""
    L, C, H = MODELS[model][:3]
    Vp = padded_vocab(vocab_of(model))
    if model not in LLAMA:
        return flops_per_step(L, C, T, Vp, B)
    g, F = LLAMA[model]["groups"], LLAMA[model]["ffn"]
    N, kv = B * T, C // H * g
    layer = 2 * N * C * (C + 2 * kv) + 4 * N * T * C + 2 * N * C * C + 2 * N * C * 2 * F + 2 * N * F * C
    return 3.0 * (L * layer + 2 * N * C * Vp)


def learning_rate(step, lr, min_lr, decay, warmup=2):
    """loom's schedule (engine/train/trainer.cpp learning_rate), step counted from 1; the manifests'
    optimizer.warmup_steps = 2, decay over run.steps (the driver runs loom for warm-up + timed steps)."""
    if warmup > 0 and step <= warmup:
        return lr * step / warmup
    if step >= decay:
        return min_lr
    progress = (step - warmup) / max(1, decay - warmup)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def build(torch, L, C, H, T, Vp):
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(C, eps=1e-5)
            self.qkv = nn.Linear(C, 3 * C)
            self.proj = nn.Linear(C, C)
            self.ln2 = nn.LayerNorm(C, eps=1e-5)
            self.fc1 = nn.Linear(C, 4 * C)
            self.fc2 = nn.Linear(4 * C, C)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
            q, k, v = (z.view(b, t, H, C // H).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, C))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(Vp, C)
            self.wpe = nn.Embedding(T, C)
            self.blocks = nn.ModuleList(Block() for _ in range(L))
            self.ln_f = nn.LayerNorm(C, eps=1e-5)
            self.register_buffer("pos", torch.arange(T), persistent=False)

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(self.pos[: idx.shape[1]])
            for blk in self.blocks:
                x = blk(x)
            logits = F.linear(self.ln_f(x), self.wte.weight)  # tied head, padded vocab
            # Only the real vocab's columns take part (loom's valid_cols); the padding is computed, as in loom.
            return F.cross_entropy(logits.view(-1, Vp)[:, :VOCAB], targets.reshape(-1))

    model = GPT()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                scaled = name.endswith("proj.weight") or name.endswith("fc2.weight")
                p.normal_(0.0, 0.02 / math.sqrt(2 * L) if scaled else 0.02)
            elif name.endswith("bias"):
                p.zero_()
    return model


def build_llama(torch, L, C, H, T, Vp, vocab, groups, ffn, theta):
    nn, F = torch.nn, torch.nn.functional
    D, kv = C // H, C // H * groups
    # Rotate-half RoPE as loom's device ops (Megatron-LM's default): frequency i of the first and
    # the second half of each head, angles t * theta^(-2i / D) in fp32.
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    ang = torch.outer(torch.arange(T, dtype=torch.float32), inv)
    cos, sin = torch.cat([ang, ang], dim=-1).cos(), torch.cat([ang, ang], dim=-1).sin()

    def rope(x, cos, sin):  # x [b, heads, t, D]
        x1, x2 = x.chunk(2, dim=-1)
        return (x.float() * cos + torch.cat([-x2, x1], dim=-1).float() * sin).to(x.dtype)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1 = nn.RMSNorm(C, eps=1e-5)
            self.qkv = nn.Linear(C, C + 2 * kv, bias=False)
            self.proj = nn.Linear(C, C, bias=False)
            self.n2 = nn.RMSNorm(C, eps=1e-5)
            self.fc1 = nn.Linear(C, 2 * ffn, bias=False)
            self.fc2 = nn.Linear(ffn, C, bias=False)

        def forward(self, x, cos, sin):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.n1(x)).split([C, kv, kv], dim=2)
            q = rope(q.view(b, t, H, D).transpose(1, 2), cos, sin)
            k = rope(k.view(b, t, groups, D).transpose(1, 2), cos, sin)
            v = v.view(b, t, groups, D).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, C))
            gate, up = self.fc1(self.n2(x)).chunk(2, dim=-1)
            return x + self.fc2(F.silu(gate) * up)

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(Vp, C)
            self.blocks = nn.ModuleList(Block() for _ in range(L))
            self.norm = nn.RMSNorm(C, eps=1e-5)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)

        def forward(self, idx, targets):
            t = idx.shape[1]
            x = self.wte(idx)
            for blk in self.blocks:
                x = blk(x, self.cos[:t], self.sin[:t])
            logits = F.linear(self.norm(x), self.wte.weight)  # tied head, padded vocab
            return F.cross_entropy(logits.view(-1, Vp)[:, :vocab], targets.reshape(-1))

    model = Llama()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                scaled = name.endswith("proj.weight") or name.endswith("fc2.weight")
                p.normal_(0.0, 0.02 / math.sqrt(2 * L) if scaled else 0.02)
    return model


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt2-124m")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--mode", choices=["eager", "compile"], default="eager")
    ap.add_argument("--batch", type=int, default=16, help="B, sequences per step")
    ap.add_argument("--seq", type=int, default=1024, help="T, tokens per sequence (and the position table)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (at least 3 with compile)")
    ap.add_argument("--peak-tflops", type=float, default=0.0,
                    help="peak for MFU (default 989.4 for bf16, 494.7 for fp32)")
    ap.add_argument("--device", default="cuda", help="cuda (default), or cpu for a smoke test")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--params-only", action="store_true",
                    help="print the parameter count and FLOPs/step, without torch")
    a = ap.parse_args()

    L, C, H, lr, min_lr = MODELS[a.model]
    B, T = a.batch, a.seq
    vocab = vocab_of(a.model)
    Vp = padded_vocab(vocab)
    n_params = model_param_count(a.model, T)
    flops = model_flops_per_step(a.model, B, T)
    peak = a.peak_tflops or PEAK_TFLOPS[a.dtype]
    print(f"# torch_gpt: {a.model} L{L} C{C} H{H} T{T} B{B} vocab {vocab} padded {Vp}: "
          f"{n_params} parameters (analytic), {flops:.4e} FLOPs/step", flush=True)
    if a.params_only:
        return 0
    warmup = max(a.warmup, 3) if a.mode == "compile" else max(a.warmup, 1)
    total = warmup + a.steps

    import torch

    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    torch.manual_seed(a.seed)
    if a.dtype == "fp32":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if a.model in LLAMA:
        model = build_llama(torch, L, C, H, T, Vp, vocab, **LLAMA[a.model]).to(dev)
    else:
        model = build(torch, L, C, H, T, Vp).to(dev)
    n_torch = sum(p.numel() for p in model.parameters())  # the tied table once
    print(f"# torch_gpt: torch {torch.__version__}, {n_torch} parameters in the module"
          f"{'' if n_torch == n_params else ' (DIFFERS from the analytic count)'}"
          + (f", {torch.cuda.get_device_name(dev)}" if cuda else ""), flush=True)
    if n_torch != n_params:
        return 1
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=learning_rate(1, lr, min_lr, total), betas=(0.9, 0.95), eps=1e-8, fused=True)
    step_fn = torch.compile(model) if a.mode == "compile" else model

    gen = torch.Generator().manual_seed(a.seed)
    pool = [torch.randint(0, vocab, (B, T + 1), generator=gen, dtype=torch.int64) for _ in range(4)]
    if cuda:
        pool = [t.pin_memory() for t in pool]

    def train_step(i):
        batch = pool[i % len(pool)].to(dev, non_blocking=True)
        x, y = batch[:, :-1], batch[:, 1:]
        for g in opt.param_groups:
            g["lr"] = learning_rate(i + 1, lr, min_lr, total)
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
            loss = step_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t_start = time.perf_counter()
    for i in range(warmup):
        loss = train_step(i)
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    print(f"# torch_gpt: {warmup} warm-up steps in {time.perf_counter() - t_start:.1f} s, loss {loss.item():.4f}",
          flush=True)

    times = []
    if cuda:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(a.steps)]
        for i in range(a.steps):
            events[i][0].record()
            loss = train_step(warmup + i)
            events[i][1].record()
        torch.cuda.synchronize(dev)
        times = [s.elapsed_time(e) for s, e in events]
        peak_mem = torch.cuda.max_memory_allocated(dev)
    else:
        for i in range(a.steps):
            t0 = time.perf_counter()
            loss = train_step(warmup + i).item()
            times.append(1e3 * (time.perf_counter() - t0))
        peak_mem = 0
    ms = statistics.median(times)
    row = {"engine": "torch", "model": a.model, "dtype": a.dtype, "mode": a.mode, "B": B, "T": T,
           "ms_step": round(ms, 3), "tokens_s": round(B * T / (ms / 1e3), 1),
           "mfu": round(flops / (ms / 1e3) / (peak * 1e12), 5), "peak_mem_gib": round(peak_mem / 2**30, 3),
           "params": n_params, "flops_step": flops, "peak_tflops": peak, "loss": round(float(loss), 4)}
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
