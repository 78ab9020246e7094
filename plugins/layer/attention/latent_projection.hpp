// Multi-latent attention's projections (multi_latent_attention = true; DeepSeek-V2,
// 2024, as Megatron-Core's MLASelfAttention computes them). The normalised input x
// (this rank's rows) is projected down by weights every tp rank holds whole, into
//   a query latent   x Wq_down [q_rank]   (q_lora_rank; 0: q = x Wq, no latent),
//   a key/value latent and one rotary key, shared by every head:
//                    x Wkv_down [kv_rank | rope],
// each latent normalised (the layer's norm, its own gamma); the latents [q | kv |
// k_pe] of the sequence (gathered over tp under sequence parallelism: one
// all-gather, summed back by one reduce-scatter in backward, Megatron's order) are
// projected up column-parallel, this rank's heads:
//   q  = q_latent Wq_up   per head [nope | rope],
//   kv = kv_latent Wkv_up per head [k_nope | v].
// The attention then runs as multi-head attention over the packed [q | k | v] rows
// the layer keeps (heads of `width` = max(nope + rope, v) elements): a query head is
// [its rope part | its nope part], a key head [the shared k_pe | its k_nope], a value
// head [v]; the rest of a head is zero, which changes no product. Rotating the first
// `rope` elements of each q and k head is the decoupled rotary embedding (the
// shared k_pe rotates alike in every head). The weights keep Megatron's and
// transformers' column orders ([nope | rope], [kv | rope], [k_nope | v]); only the
// packed heads are reordered.
#pragma once

#include <loom/layers/layer_math.hpp>
#include <loom/layers/param_set.hpp>

#include <algorithm>
#include <vector>

namespace loom::layers {

// rows x heads blocks of `width` elements: block (r, h) at r * ld + h * head_stride on
// each side (a source head_stride of 0 copies one block into every head). One copy when
// both sides' blocks are adjacent.
inline void copy_heads(const loom::Device& dev, void* dst, int64_t dst_ld, int64_t dst_head_stride, const void* src,
                       int64_t src_ld, int64_t src_head_stride, int64_t width, int64_t rows, int64_t heads,
                       int32_t dtype) {
  const size_t eb = loom::dtype_size(dtype);
  if (width == 0 || rows == 0) return;
  if (dst_head_stride == width && src_head_stride == width) {
    dev.copy_2d(dst, dst_ld * eb, src, src_ld * eb, heads * width * eb, static_cast<size_t>(rows),
                LOOM_COPY_DEVICE_TO_DEVICE);
    return;
  }
  for (int64_t h = 0; h < heads; ++h)
    dev.copy_2d(advance(dst, h * dst_head_stride, dtype), dst_ld * eb, advance(src, h * src_head_stride, dtype),
                src_ld * eb, width * eb, static_cast<size_t>(rows), LOOM_COPY_DEVICE_TO_DEVICE);
}

class LatentProjection {
 public:
  struct Dims {
    int64_t hidden = 0, heads = 0, heads_local = 0;
    int64_t q_rank = 0, kv_rank = 0;  // q_rank 0: q projected from the input directly
    int64_t nope = 0, rope = 0, v = 0;  // per head: q/k elements without and with rotation, value elements
    int64_t qk() const { return nope + rope; }
    int64_t width() const { return std::max(qk(), v); }  // one packed head
    int64_t latent() const { return q_rank + kv_rank + rope; }  // a latent row [q | kv | k_pe]
  };

  // What the down projections made, before their norms, and the norms' statistics
  // (mean: layernorm only): kept by a training forward for its backward.
  struct Latents {
    void* q = nullptr;   // [Tl, q_rank]
    void* kv = nullptr;  // [Tl, kv_rank]
    void* pe = nullptr;  // [Tl, rope], k_pe before its rotation
    float *q_mean = nullptr, *q_rstd = nullptr, *kv_mean = nullptr, *kv_rstd = nullptr;
  };
  // Their place in an Arena (laid out, not allocated).
  struct LatentPieces {
    size_t q = 0, kv = 0, pe = 0, q_mean = 0, q_rstd = 0, kv_mean = 0, kv_rstd = 0;
    Latents at(const Arena& mem) const {
      return {.q = mem.at<void>(q), .kv = mem.at<void>(kv), .pe = mem.at<void>(pe), .q_mean = mem.at(q_mean),
              .q_rstd = mem.at(q_rstd), .kv_mean = mem.at(kv_mean), .kv_rstd = mem.at(kv_rstd)};
    }
  };

  LatentProjection() = default;
  LatentProjection(Dims d, loom_rank* rank, const loom::TensorParallel* tp, Norm norm)
      : d_(d), rank_(rank), tp_(tp), norm_(norm) {}

  const Dims& dims() const { return d_; }

  // Declares the parameters (after ln.*, in this order); proj is the layer's.
  void declare(ParamSet& params) {
    const int64_t H = d_.hidden, n = d_.heads;
    auto norm_params = [&](const char* name, int64_t cols, size_t* gamma, size_t* beta) {
      *gamma = params.add({.name = std::string(name) + ".weight", .shape = {cols}, .init = LOOM_INIT_ONES,
                           .no_weight_decay = true});
      if (!norm_.rms)
        *beta = params.add({.name = std::string(name) + ".bias", .shape = {cols}, .init = LOOM_INIT_ZEROS,
                            .no_weight_decay = true});
    };
    if (d_.q_rank > 0) {
      q_down_ = params.add({.name = "q_down.weight", .shape = {H, d_.q_rank}, .init = LOOM_INIT_NORMAL});
      norm_params("q_latent_norm", d_.q_rank, &q_norm_w_, &q_norm_b_);
      q_ = params.add({.name = "q_up.weight", .shape = {d_.q_rank, n * d_.qk()}, .partition_dim = 1,
                       .init = LOOM_INIT_NORMAL});
    } else {
      q_ = params.add({.name = "q.weight", .shape = {H, n * d_.qk()}, .partition_dim = 1, .init = LOOM_INIT_NORMAL});
    }
    kv_down_ = params.add({.name = "kv_down.weight", .shape = {H, d_.kv_rank + d_.rope}, .init = LOOM_INIT_NORMAL});
    norm_params("kv_latent_norm", d_.kv_rank, &kv_norm_w_, &kv_norm_b_);
    kv_up_ = params.add({.name = "kv_up.weight", .shape = {d_.kv_rank, n * (d_.nope + d_.v)}, .partition_dim = 1,
                         .init = LOOM_INIT_NORMAL});
  }

  LatentPieces lay_out(Arena& mem, int64_t Tl, int32_t act) const {
    LatentPieces p;
    p.q = mem.elems(Tl * d_.q_rank, act);
    p.kv = mem.elems(Tl * d_.kv_rank, act);
    p.pe = mem.elems(Tl * d_.rope, act);
    p.q_mean = mem.floats(d_.q_rank > 0 && !norm_.rms ? Tl : 0);
    p.q_rstd = mem.floats(d_.q_rank > 0 ? Tl : 0);
    p.kv_mean = mem.floats(norm_.rms ? 0 : Tl);
    p.kv_rstd = mem.floats(Tl);
    return p;
  }

  // ln: the normalised input, this rank's Tl rows [Tl, H]; ln_full: [T, H] to gather
  // it into (q_rank 0 under sequence parallelism; else unused). Writes the packed
  // [T, 3 * heads_local * width] and the latents into `keep`.
  void forward(const loom::Device& dev, const void* ln, void* ln_full, int64_t Tl, void* packed, const Latents& keep,
               const std::vector<void*>& w, int32_t act) const {
    const int64_t H = d_.hidden, T = full_rows(Tl), L = d_.latent(), hl = d_.heads_local;
    Temps t = forward_temps(Tl, act);
    t.mem.allocate(rank_);
    // Down, with the weights every tp rank holds whole, over this rank's rows.
    if (d_.q_rank > 0) gemm_ld(dev, false, false, Tl, d_.q_rank, H, ln, H, w[q_down_], d_.q_rank, keep.q, d_.q_rank, 0.0f, act, act);
    const int64_t kvw = d_.kv_rank + d_.rope;
    gemm_ld(dev, false, false, Tl, d_.kv_rank, H, ln, H, w[kv_down_], kvw, keep.kv, d_.kv_rank, 0.0f, act, act);
    gemm_ld(dev, false, false, Tl, d_.rope, H, ln, H, advance(w[kv_down_], d_.kv_rank, act), kvw, keep.pe, d_.rope,
            0.0f, act, act);
    const void* lat = latent_rows(dev, keep, w, t, Tl, act);
    // Up, column-parallel: this rank's heads of the whole sequence.
    void* q = t.mem.at(t.q);
    if (d_.q_rank > 0)
      gemm_ld(dev, false, false, T, hl * d_.qk(), d_.q_rank, lat, L, w[q_], hl * d_.qk(), q, hl * d_.qk(), 0.0f, act, act);
    else
      tp_->column_parallel_linear_forward({.rows = T, .in = H, .out = hl * d_.qk(), .x = ln,
                                           .x_full = tp_->sequence_parallel() ? ln_full : nullptr, .weight = w[q_],
                                           .bias = nullptr, .y = q, .dtype = act});
    const int64_t kvu = hl * (d_.nope + d_.v);
    gemm_ld(dev, false, false, T, kvu, d_.kv_rank, advance(lat, d_.q_rank, act), L, w[kv_up_], kvu, t.mem.at(t.kv),
            kvu, 0.0f, act, act);
    pack(dev, q, t.mem.at(t.kv), advance(lat, d_.q_rank + d_.kv_rank, act), L, packed, T, act);
  }

  // The transpose. dpacked: the packed [T, 3 * heads_local * width] gradients (the
  // rotations undone); ln (ln_full): the normalised input as in forward, recomputed.
  // Writes dln [Tl, H]; accumulates the weights' gradients into gs.
  void backward(const loom::Device& dev, const void* dpacked, const void* ln, const void* ln_full, const Latents& kept,
                void* dln, int64_t Tl, const std::vector<void*>& w, const GradShadow& gs, int32_t act) const {
    const int64_t H = d_.hidden, T = full_rows(Tl), L = d_.latent(), hl = d_.heads_local;
    const int64_t qu = hl * d_.qk(), kvu = hl * (d_.nope + d_.v), kvw = d_.kv_rank + d_.rope;
    const int32_t gdt = gs.grad_dtype();
    const bool sp = tp_->sequence_parallel();
    Temps t = backward_temps(Tl, act);
    t.mem.allocate(rank_);
    const void* lat = latent_rows(dev, kept, w, t, Tl, act);  // recomputed, as the forward made it
    void* dlat_full = t.mem.at(t.dlat_full);
    unpack_gradients(dev, dpacked, t.mem.at(t.q), t.mem.at(t.kv), advance(dlat_full, d_.q_rank + d_.kv_rank, act), L,
                     T, act);
    const void* dq = t.mem.at(t.q);
    const void* dkv = t.mem.at(t.kv);
    if (d_.q_rank > 0) {
      gemm_ld(dev, true, false, d_.q_rank, qu, T, lat, L, dq, qu, gs[q_], qu, 1.0f, act, gdt);
      gemm_ld(dev, false, true, T, d_.q_rank, qu, dq, qu, w[q_], qu, dlat_full, L, 0.0f, act, act);
    }
    gemm_ld(dev, true, false, d_.kv_rank, kvu, T, advance(lat, d_.q_rank, act), L, dkv, kvu, gs[kv_up_], kvu, 1.0f,
            act, gdt);
    gemm_ld(dev, false, true, T, d_.kv_rank, kvu, dkv, kvu, w[kv_up_], kvu, advance(dlat_full, d_.q_rank, act), L,
            0.0f, act, act);
    // f's backward: each rank's heads' share summed over tp (all-reduce, or
    // reduce-scatter to this rank's rows).
    void* dlat = sp ? t.mem.at<void>(t.dlat) : dlat_full;
    tp_->enter_backward({.rows = T, .cols = L, .x = dlat_full, .out = dlat, .dtype = act});
    // Through the latents' norms, into the down projections' output gradients.
    const size_t eb = loom::dtype_size(act);
    void* dq_down = t.mem.at(t.dq_down);
    void* dkv_down = t.mem.at(t.dkv_down);
    void* dpe = t.mem.at(t.dpe);
    auto column_block = [&](void* out, int64_t offset, int64_t cols) {
      dev.copy_2d(out, cols * eb, advance(dlat, offset, act), L * eb, cols * eb, static_cast<size_t>(Tl),
                  LOOM_COPY_DEVICE_TO_DEVICE);
    };
    if (d_.q_rank > 0) {
      column_block(t.mem.at(t.dnormed), 0, d_.q_rank);
      norm_.backward(dev, t.mem.at(t.dnormed), kept.q, w[q_norm_w_], kept.q_mean, kept.q_rstd, dq_down,
                     gs[q_norm_w_], grad(gs, q_norm_b_), Tl, d_.q_rank, /*accumulate_dx=*/false, act, gs.grad_fp32());
    }
    column_block(t.mem.at(t.dnormed), d_.q_rank, d_.kv_rank);
    norm_.backward(dev, t.mem.at(t.dnormed), kept.kv, w[kv_norm_w_], kept.kv_mean, kept.kv_rstd, dkv_down,
                   gs[kv_norm_w_], grad(gs, kv_norm_b_), Tl, d_.kv_rank, /*accumulate_dx=*/false, act, gs.grad_fp32());
    column_block(dpe, d_.q_rank + d_.kv_rank, d_.rope);
    // The down weights, whole on every rank: without sequence parallelism every rank
    // sums the same rows into the same gradient; under it, the engine sums the shards'.
    if (d_.q_rank > 0) gemm_ld(dev, true, false, H, d_.q_rank, Tl, ln, H, dq_down, d_.q_rank, gs[q_down_], d_.q_rank, 1.0f, act, gdt);
    gemm_ld(dev, true, false, H, d_.kv_rank, Tl, ln, H, dkv_down, d_.kv_rank, gs[kv_down_], kvw, 1.0f, act, gdt);
    gemm_ld(dev, true, false, H, d_.rope, Tl, ln, H, dpe, d_.rope, advance(gs[kv_down_], d_.kv_rank, gdt), kvw, 1.0f,
            act, gdt);
    // dln: the query path's (q_rank 0: column-parallel, summed over tp by its f), then
    // the key/value down projection's.
    if (d_.q_rank > 0)
      gemm_ld(dev, false, true, Tl, H, d_.q_rank, dq_down, d_.q_rank, w[q_down_], d_.q_rank, dln, H, 0.0f, act, act);
    else
      tp_->column_parallel_linear_backward({.rows = T, .in = H, .out = qu, .x = sp ? ln_full : ln, .weight = w[q_],
                                            .dy = dq, .dx = dln, .dweight = gs[q_], .dtype = act,
                                            .grad_fp32 = gs.grad_fp32()});
    gemm_ld(dev, false, true, Tl, H, d_.kv_rank, dkv_down, d_.kv_rank, w[kv_down_], kvw, dln, H, 1.0f, act, act);
    gemm_ld(dev, false, true, Tl, H, d_.rope, dpe, d_.rope, advance(w[kv_down_], d_.kv_rank, act), kvw, dln, H, 1.0f,
            act, act);
  }

  // ---- Generation with the latent cache (DeepSeek-V2's weight absorption) ----
  // A cached position is its key/value latent and its rotated key [kv | k_pe]
  // (cache_width() elements, the same on every tp rank), not every head's k and v.
  // Since k_h = [k_pe | kv Wk_h] and v_h = kv Wv_h (Wk_h, Wv_h: head h's columns of
  // kv_up), q_h . k_h = [q_pe_h | q_nope_h Wk_h^T] . [k_pe | kv] and softmax(.) v_h =
  // (softmax(.) kv) Wv_h: attention runs over the latent rows with the absorbed
  // queries [q_pe_h | q_nope_h Wk_h^T] and, as values, the latent rows themselves
  // (the context's first kv_rank elements of each head are softmax(.) kv).
  int64_t cache_width() const { return d_.rope + d_.kv_rank; }

  // Rows [k_pe | kv] of T positions into `rows` (row stride ld): the normalised kv
  // latent a forward kept, and the rotated shared key of the packed heads (packed k
  // head 0's first rope elements, as rotated).
  void cache_latents(const loom::Device& dev, const Latents& kept, const std::vector<void*>& w, const void* packed,
                     void* rows, int64_t ld, int64_t T, int32_t act) const {
    const size_t eb = loom::dtype_size(act);
    const int64_t P = 3 * d_.heads_local * d_.width();
    Arena mem;
    const size_t normed = mem.elems(T * d_.kv_rank, act), rstd = mem.floats(T), mean = mem.floats(norm_.rms ? 0 : T);
    mem.allocate(rank_);
    norm_.forward(dev, kept.kv, w[kv_norm_w_], at(w, kv_norm_b_), mem.at(normed), mem.at(mean), mem.at(rstd), T,
                  d_.kv_rank, act);
    dev.copy_2d(rows, ld * eb, advance(packed, d_.heads_local * d_.width(), act), P * eb, d_.rope * eb,
                static_cast<size_t>(T), LOOM_COPY_DEVICE_TO_DEVICE);
    dev.copy_2d(advance(rows, d_.rope, act), ld * eb, mem.at(normed), d_.kv_rank * eb, d_.kv_rank * eb,
                static_cast<size_t>(T), LOOM_COPY_DEVICE_TO_DEVICE);
  }

  // The absorbed queries [T, heads_local, cache_width()]: head h = [q_pe_h | q_nope_h
  // Wk_h^T] from the packed (rotated) q heads.
  void absorb_queries(const loom::Device& dev, const void* packed, void* q_abs, int64_t T,
                      const std::vector<void*>& w, int32_t act) const {
    const int64_t hl = d_.heads_local, Dw = d_.width(), P = 3 * hl * Dw, Lc = cache_width(), kvh = d_.nope + d_.v;
    copy_heads(dev, q_abs, hl * Lc, Lc, packed, P, Dw, d_.rope, T, hl, act);
    for (int64_t h = 0; h < hl; ++h)  // q_nope_h [T, nope] x (Wk_h [kv_rank, nope])^T
      gemm_ld(dev, false, true, T, d_.kv_rank, d_.nope, advance(packed, h * Dw + d_.rope, act), P,
              advance(w[kv_up_], h * kvh, act), hl * kvh, advance(q_abs, h * Lc + d_.rope, act), hl * Lc, 0.0f, act,
              act);
  }

  // The values [T, heads_local * v] from the latent context [T, heads_local,
  // cache_width()] (head h's elements after the first rope: softmax(.) kv): x Wv_h.
  void expand_values(const loom::Device& dev, const void* ctx, void* values, int64_t T,
                     const std::vector<void*>& w, int32_t act) const {
    const int64_t hl = d_.heads_local, Lc = cache_width(), kvh = d_.nope + d_.v;
    for (int64_t h = 0; h < hl; ++h)
      gemm_ld(dev, false, false, T, d_.v, d_.kv_rank, advance(ctx, h * Lc + d_.rope, act), hl * Lc,
              advance(w[kv_up_], h * kvh + d_.nope, act), hl * kvh, advance(values, h * d_.v, act), hl * d_.v, 0.0f,
              act, act);
  }

  // Whether the layer's backward needs the normalised input gathered over tp (the
  // column-parallel q of q_rank 0 under sequence parallelism).
  bool needs_gathered_input() const { return d_.q_rank == 0 && tp_->sequence_parallel(); }

  // What forward and backward allocate for Tl local rows.
  uint64_t temp_bytes(int64_t Tl, bool backward, int32_t act) const {
    return (backward ? backward_temps(Tl, act) : forward_temps(Tl, act)).mem.bytes();
  }

  // Per rank, over Tl local rows (T = the sequence's under sequence parallelism): the
  // down projections (Tl rows), the up projections (T rows, this rank's heads).
  double forward_flops(int64_t Tl) const {
    const double tl = static_cast<double>(Tl), t = static_cast<double>(full_rows(Tl));
    const double H = static_cast<double>(d_.hidden), hl = static_cast<double>(d_.heads_local);
    const double down = 2.0 * tl * H * static_cast<double>(d_.latent());
    const double q_up = d_.q_rank > 0 ? 2.0 * t * static_cast<double>(d_.q_rank) * hl * static_cast<double>(d_.qk())
                                      : 2.0 * t * H * hl * static_cast<double>(d_.qk());
    const double kv_up = 2.0 * t * static_cast<double>(d_.kv_rank) * hl * static_cast<double>(d_.nope + d_.v);
    return down + q_up + kv_up;
  }

 private:
  static constexpr size_t kNone = static_cast<size_t>(-1);
  static void* grad(const GradShadow& gs, size_t i) { return i == kNone ? nullptr : gs[i]; }
  static const void* at(const std::vector<void*>& w, size_t i) { return i == kNone ? nullptr : w[i]; }

  int64_t full_rows(int64_t Tl) const { return tp_->sequence_parallel() ? Tl * tp_->size() : Tl; }

  // Temporaries: the normalised latents and their rows (gathered under SP), this
  // rank's up-projected q and kv (backward: their gradients); backward also the
  // latent rows' gradients and the down projections' output gradients.
  struct Temps {
    Arena mem;
    size_t q_normed = 0, kv_normed = 0, lat = 0, lat_full = 0, q = 0, kv = 0;
    size_t dlat_full = 0, dlat = 0, dnormed = 0, dq_down = 0, dkv_down = 0, dpe = 0;
  };
  Temps forward_temps(int64_t Tl, int32_t act) const {
    const int64_t T = full_rows(Tl), hl = d_.heads_local, L = d_.latent();
    Temps t;
    t.q_normed = t.mem.elems(Tl * d_.q_rank, act);
    t.kv_normed = t.mem.elems(Tl * d_.kv_rank, act);
    t.lat = t.mem.elems(Tl * L, act);
    t.lat_full = t.mem.elems(tp_->sequence_parallel() ? T * L : 0, act);
    t.q = t.mem.elems(T * hl * d_.qk(), act);
    t.kv = t.mem.elems(T * hl * (d_.nope + d_.v), act);
    return t;
  }
  Temps backward_temps(int64_t Tl, int32_t act) const {
    Temps t = forward_temps(Tl, act);
    const int64_t T = full_rows(Tl), L = d_.latent();
    t.dlat_full = t.mem.elems(T * L, act);
    t.dlat = t.mem.elems(tp_->sequence_parallel() ? Tl * L : 0, act);
    t.dnormed = t.mem.elems(Tl * std::max(d_.q_rank, d_.kv_rank), act);
    t.dq_down = t.mem.elems(Tl * d_.q_rank, act);
    t.dkv_down = t.mem.elems(Tl * d_.kv_rank, act);
    t.dpe = t.mem.elems(Tl * d_.rope, act);
    return t;
  }

  // The latent rows [q | kv | k_pe] of the whole sequence from the kept latents: each
  // normalised (statistics written to `keep`), laid side by side, gathered over tp
  // under sequence parallelism. Returns [T, latent()] in t.
  const void* latent_rows(const loom::Device& dev, const Latents& keep, const std::vector<void*>& w, const Temps& t,
                          int64_t Tl, int32_t act) const {
    const Arena& mem = t.mem;
    const int64_t L = d_.latent();
    const size_t eb = loom::dtype_size(act);
    void* lat = mem.at(t.lat);
    auto place = [&](int64_t offset, const void* block, int64_t cols) {
      dev.copy_2d(advance(lat, offset, act), L * eb, block, cols * eb, cols * eb, static_cast<size_t>(Tl),
                  LOOM_COPY_DEVICE_TO_DEVICE);
    };
    if (d_.q_rank > 0) {
      norm_.forward(dev, keep.q, w[q_norm_w_], at(w, q_norm_b_), mem.at(t.q_normed), keep.q_mean, keep.q_rstd, Tl,
                    d_.q_rank, act);
      place(0, mem.at(t.q_normed), d_.q_rank);
    }
    norm_.forward(dev, keep.kv, w[kv_norm_w_], at(w, kv_norm_b_), mem.at(t.kv_normed), keep.kv_mean, keep.kv_rstd, Tl,
                  d_.kv_rank, act);
    place(d_.q_rank, mem.at(t.kv_normed), d_.kv_rank);
    place(d_.q_rank + d_.kv_rank, keep.pe, d_.rope);
    if (!tp_->sequence_parallel()) return lat;
    tp_->enter_forward({.rows = full_rows(Tl), .cols = L, .x = lat, .out = mem.at(t.lat_full), .dtype = act});
    return mem.at(t.lat_full);
  }

  // The packed heads from this rank's up-projected q [T, hl * (nope + rope)], kv [T,
  // hl * (nope + v)] and the shared k_pe (pe, rows of pe_ld).
  void pack(const loom::Device& dev, const void* q, const void* kv, const void* pe, int64_t pe_ld, void* packed,
            int64_t T, int32_t act) const {
    const int64_t hl = d_.heads_local, Dw = d_.width(), P = 3 * hl * Dw, qk = d_.qk(), kvh = d_.nope + d_.v;
    if (Dw > qk || Dw > d_.v) fill_zero(dev, packed, T * P, act);
    void* pq = packed;
    void* pk = advance(packed, hl * Dw, act);
    void* pv = advance(packed, 2 * hl * Dw, act);
    copy_heads(dev, pq, P, Dw, advance(q, d_.nope, act), hl * qk, qk, d_.rope, T, hl, act);
    copy_heads(dev, advance(pq, d_.rope, act), P, Dw, q, hl * qk, qk, d_.nope, T, hl, act);
    copy_heads(dev, pk, P, Dw, pe, pe_ld, 0, d_.rope, T, hl, act);
    copy_heads(dev, advance(pk, d_.rope, act), P, Dw, kv, hl * kvh, kvh, d_.nope, T, hl, act);
    copy_heads(dev, pv, P, Dw, advance(kv, d_.nope, act), hl * kvh, kvh, d_.v, T, hl, act);
  }

  // pack's transpose: dq and dkv in the up projections' layouts, dk_pe summed over the
  // heads (into dpe, rows of dpe_ld).
  void unpack_gradients(const loom::Device& dev, const void* dpacked, void* dq, void* dkv, void* dpe, int64_t dpe_ld,
                        int64_t T, int32_t act) const {
    const int64_t hl = d_.heads_local, Dw = d_.width(), P = 3 * hl * Dw, qk = d_.qk(), kvh = d_.nope + d_.v;
    const void* pq = dpacked;
    const void* pk = advance(dpacked, hl * Dw, act);
    const void* pv = advance(dpacked, 2 * hl * Dw, act);
    copy_heads(dev, advance(dq, d_.nope, act), hl * qk, qk, pq, P, Dw, d_.rope, T, hl, act);
    copy_heads(dev, dq, hl * qk, qk, advance(pq, d_.rope, act), P, Dw, d_.nope, T, hl, act);
    copy_heads(dev, dkv, hl * kvh, kvh, advance(pk, d_.rope, act), P, Dw, d_.nope, T, hl, act);
    copy_heads(dev, advance(dkv, d_.nope, act), hl * kvh, kvh, pv, P, Dw, d_.v, T, hl, act);
    // The sum over heads as one GEMM with [I; 0; I; 0; ...] (fp32 sums, rounded once).
    gemm_ld(dev, false, false, T, d_.rope, hl * Dw, pk, P, head_sum_matrix(dev, act), d_.rope, dpe, dpe_ld, 0.0f, act,
            act);
  }

  // [hl * width, rope]: an identity over the first rope elements of each head, zero
  // elsewhere, in the activations' dtype (exact: 0 and 1), built once.
  const void* head_sum_matrix(const loom::Device& dev, int32_t act) const {
    if (head_sum_.get() != nullptr) return head_sum_.get();
    const int64_t Dw = d_.width(), rows = d_.heads_local * Dw, R = d_.rope;
    const size_t eb = loom::dtype_size(act);
    std::vector<uint8_t> host(static_cast<size_t>(rows * R) * eb, 0);
    for (int64_t h = 0; h < d_.heads_local; ++h)
      for (int64_t i = 0; i < R; ++i) {
        const size_t at = static_cast<size_t>((h * Dw + i) * R + i) * eb;
        if (act == LOOM_DTYPE_BF16) {
          const uint16_t one = 0x3f80;
          std::copy_n(reinterpret_cast<const uint8_t*>(&one), 2, host.data() + at);
        } else {
          const float one = 1.0f;
          std::copy_n(reinterpret_cast<const uint8_t*>(&one), 4, host.data() + at);
        }
      }
    loom::Buffer buf(rank_, host.size());
    dev.copy(buf.get(), host.data(), host.size(), LOOM_COPY_HOST_TO_DEVICE);
    dev.synchronize();  // the host vector dies here
    head_sum_ = std::move(buf);
    return head_sum_.get();
  }

  Dims d_;
  loom_rank* rank_ = nullptr;
  const loom::TensorParallel* tp_ = nullptr;
  Norm norm_;
  size_t q_down_ = kNone, q_norm_w_ = kNone, q_norm_b_ = kNone, q_ = kNone;
  size_t kv_down_ = kNone, kv_norm_w_ = kNone, kv_norm_b_ = kNone, kv_up_ = kNone;
  mutable loom::Buffer head_sum_;
};

}  // namespace loom::layers
