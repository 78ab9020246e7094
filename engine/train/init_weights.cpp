#include "engine/train/init_weights.hpp"

#include <cstring>

namespace loom::train {

namespace {

std::string shape_text(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

float element(const WholeTensor& t, int64_t i) {
  float f = 0;
  if (t.dtype == LOOM_DTYPE_BF16) {
    uint32_t bits = 0;
    std::memcpy(reinterpret_cast<char*>(&bits) + 2, t.data.data() + 2 * i, 2);  // little-endian: the high half
    std::memcpy(&f, &bits, 4);
  } else {
    std::memcpy(&f, t.data.data() + 4 * i, 4);
  }
  return f;
}

const WholeTensor* source_of(const InitialWeights& w, const model::ParamEntry& e) {
  for (const WholeTensor& t : w.tensors)
    if (t.name == e.name) return &t;
  if (!e.tie_key.empty())
    for (const WholeTensor& t : w.tensors)
      if (t.tie_key == e.tie_key) return &t;
  return nullptr;
}

}  // namespace

void load_initial_weights(const InitialWeights& w, int64_t vocab, model::Model& model) {
  model.assign_params([&](const model::ParamEntry& e) {
    const WholeTensor* t = source_of(w, e);
    if (t == nullptr)
      throw loom::Error("checkpoint.init_weights: " + w.source + " has no parameter " + e.name +
                        " (the model declares it; is it the same architecture?)");
    const std::vector<int64_t>& want = e.full_shape;
    const bool rows_only = t->shape.size() == want.size() && want.size() == 2 && t->shape[1] == want[1] &&
                           t->shape[0] >= vocab && want[0] >= vocab;  // a vocabulary table, padded otherwise
    if (t->shape != want && !rows_only)
      throw loom::Error("checkpoint.init_weights: " + w.source + "'s " + t->name + " is " + shape_text(t->shape) +
                        ", the model's " + e.name + " " + shape_text(want));
    int64_t n = 1;
    for (int64_t d : want) n *= d;
    std::vector<float> full(static_cast<size_t>(n), 0.0f);
    const int64_t copy = t->shape == want ? n : vocab * want[1];
    for (int64_t i = 0; i < copy; ++i) full[static_cast<size_t>(i)] = element(*t, i);
    return full;
  });
}

}  // namespace loom::train
