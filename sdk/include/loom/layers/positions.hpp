// Token positions of a layer's rows, as the device ops take them (int32 device
// arrays): the learned position table's lookup ids (layer/embedding) and the
// rotary embedding's angles (layer/attention). Row s * B + b of a layer's rows holds
// sequence row first + s of this context-parallel rank's slice, so under context
// parallelism (two chunks per rank) and sequence parallelism (a shard: first > 0)
// every token keeps the position it has in the whole sequence.
#pragma once

#include <loom/cpp/plugin.hpp>

#include <cstdint>
#include <vector>

namespace loom::layers {

// "learned_absolute" | "rope": Megatron-LM's --position-embedding-type; set the same
// on layer/embedding (which adds the learned table) and layer/attention (which rotates
// q and k).
inline loom::OptionSpec position_embedding_option_spec(const char* what_rope_does) {
  return loom::opt_string("position_embedding", "learned_absolute",
                          std::string("learned_absolute: a learned position table in layer/embedding (GPT-2); rope: ") +
                              what_rope_does + " (Llama; set the same on layer/embedding and layer/attention)")
      .one_of("learned_absolute|rope");
}

class PositionIds {
 public:
  // The ids of rows [0, rows * B): built on first use, and again only when the shape
  // or the first row changes (a steady-state step copies nothing to the device).
  const int32_t* get(loom_rank* rank, const loom::Device& dev, const loom::ContextSlice& slice, int64_t first,
                     int64_t rows, int64_t B) {
    if (buf_.get<int32_t>() == nullptr || first_ != first || rows_ != rows || B_ != B || seq_ != slice.seq()) {
      std::vector<int32_t> ids(static_cast<size_t>(rows * B));
      for (int64_t s = 0; s < rows; ++s)
        for (int64_t b = 0; b < B; ++b) ids[static_cast<size_t>(s * B + b)] = static_cast<int32_t>(slice.position(first + s));
      loom::Buffer buf(rank, ids.size() * sizeof(int32_t));
      dev.copy(buf.get(), ids.data(), ids.size() * sizeof(int32_t), LOOM_COPY_HOST_TO_DEVICE);
      dev.synchronize();  // the host vector dies here
      buf_ = std::move(buf);
      first_ = first;
      rows_ = rows;
      B_ = B;
      seq_ = slice.seq();
    }
    return buf_.get<int32_t>();
  }

 private:
  loom::Buffer buf_;
  int64_t first_ = -1, rows_ = 0, B_ = 0, seq_ = 0;
};

}  // namespace loom::layers
