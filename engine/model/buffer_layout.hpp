// Where each parameter lives in the flat parameter/gradient buffers — Megatron-LM's
// rules, so layouts are comparable: parameters in reverse model order (the order
// backward produces their gradients), each start rounded up to 64 elements,
// buckets closed once they reach bucket_size elements, and each bucket's end
// rounded up to a multiple of lcm(dp, 128) so it splits evenly into dp shards.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

namespace loom::model {

struct Range {
  size_t start = 0, end = 0;  // half-open, in elements
  size_t size() const { return end - start; }
  bool operator==(const Range&) const = default;
};

struct BufferLayout {
  size_t numel = 0;             // the whole buffer, padding included
  std::vector<Range> params;    // by model-order index
  std::vector<Range> buckets;   // in buffer order
};

constexpr size_t kParamStartAlign = 64;

// numels: each parameter's element count, in model order. bucket_size 0 = one bucket.
BufferLayout layout_buffer(const std::vector<size_t>& numels, int dp, size_t bucket_size = 0);

// Megatron keeps one buffer per model chunk (pipeline virtual stage): each chunk's
// parameters laid out by layout_buffer on their own, the chunk buffers placed one
// after another. numels[c] are chunk c's parameter sizes in model order; params
// come back indexed in model order over all chunks (chunk 0's first), buckets in
// buffer order, and every bucket still lies inside one chunk's buffer.
BufferLayout layout_chunked_buffer(const std::vector<std::vector<size_t>>& numels, int dp, size_t bucket_size = 0);

// The model's buffer: each parameter in its chunk's region, except expert
// parameters (ABI 1.4, split over ep and reduced over edp), which all go to one
// region after the chunks', so they form the tail of the buffer and never share a
// bucket with a dense parameter. chunk_of[i] / numels[i] / expert[i] describe
// parameter i in model order; params come back indexed the same way.
BufferLayout layout_model_buffer(const std::vector<int>& chunk_of, const std::vector<size_t>& numels,
                                 const std::vector<bool>& expert, size_t chunks, int dp, size_t bucket_size = 0);

// The shard of a bucket that data-parallel rank r of dp owns.
inline Range shard_of(const Range& bucket, int dp, int r) {
  const size_t size = bucket.size() / static_cast<size_t>(dp);
  return {bucket.start + static_cast<size_t>(r) * size, bucket.start + static_cast<size_t>(r + 1) * size};
}

}  // namespace loom::model
