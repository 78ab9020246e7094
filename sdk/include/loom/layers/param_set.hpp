// A layer's parameters, declared once. The layer adds each parameter (its full
// shape and how it splits) when it is created; params() returns those
// declarations, bind() checks what the engine bound against them (count, one
// dtype for the parameters and one for the gradients, this rank's element count)
// and hands out the views, by the index add() returned.
#pragma once

#include <loom/layers/layer_math.hpp>

#include <string>
#include <vector>

namespace loom::layers {

class ParamSet {
 public:
  // How this rank's slices are cut, as the engine cuts them: an expert
  // parameter's dim 0 over ep, then its partition_dim over etp; any other
  // parameter's partition_dim over tp.
  struct Split {
    int64_t tp = 1, ep = 1, etp = 1;
  };

  ParamSet() = default;
  ParamSet(std::string layer, Split split) : layer_(std::move(layer)), split_(split) {}

  // Declares the next parameter; returns its index.
  size_t add(loom::ParamSpec spec) {
    specs_.push_back(std::move(spec));
    return specs_.size() - 1;
  }
  const std::vector<loom::ParamSpec>& specs() const { return specs_; }
  size_t size() const { return specs_.size(); }

  // Elements of parameter i on this rank.
  int64_t local_numel(size_t i) const {
    const loom::ParamSpec& s = specs_[i];
    int64_t n = 1;
    for (size_t d = 0; d < s.shape.size(); ++d) {
      int64_t extent = s.shape[d];
      if (s.expert && d == 0) extent /= split_.ep;
      if (s.partition_dim == static_cast<int32_t>(d)) extent /= s.expert ? split_.etp : split_.tp;
      n *= extent;
    }
    return n;
  }
  std::vector<int64_t> local_numels() const {
    std::vector<int64_t> out;
    for (size_t i = 0; i < specs_.size(); ++i) out.push_back(local_numel(i));
    return out;
  }

  // Checks the engine's views and writes parameter i's into params_out[i] and its
  // gradient's into grads_out[i] (arrays of size()). Returns the dtypes.
  Dtypes bind(std::span<const DLTensor> params, std::span<const DLTensor> grads, void** params_out,
              void** grads_out) const {
    LOOM_REQUIRE(params.size() == specs_.size() && grads.size() == specs_.size(),
                 layer_ << ": bind expects " << specs_.size() << " parameters, got " << params.size());
    const Dtypes dt = bound_dtypes(params, grads, layer_);
    for (size_t i = 0; i < specs_.size(); ++i) {
      params_out[i] = bound(params[i], local_numel(i), layer_, specs_[i].name, dt.act);
      grads_out[i] = bound(grads[i], local_numel(i), layer_, specs_[i].name + " (grad)", dt.grad);
    }
    return dt;
  }

 private:
  std::string layer_;
  Split split_;
  std::vector<loom::ParamSpec> specs_;
};

}  // namespace loom::layers
