#include "engine/topology/layer_split.hpp"

#include <stdexcept>
#include <string>

namespace loom::topology {

std::vector<int> blocks_per_chunk(int num_blocks, int pp, int vpp, int first, int last) {
  const int chunks = pp * vpp;
  std::vector<int> out(static_cast<size_t>(chunks), 0);
  if (chunks == 1) {
    out[0] = num_blocks;
    return out;
  }
  int rest = num_blocks, rest_chunks = chunks;
  if (first > 0) rest -= first, --rest_chunks;
  if (last > 0) rest -= last, --rest_chunks;
  const auto fail = [&](const std::string& why) {
    throw std::invalid_argument("cannot divide " + std::to_string(num_blocks) + " transformer layers over pp * vpp = " +
                                std::to_string(chunks) + " pipeline chunks (first chunk " +
                                (first > 0 ? std::to_string(first) : std::string("even")) + ", last chunk " +
                                (last > 0 ? std::to_string(last) : std::string("even")) + "): " + why);
  };
  if (rest < 0) fail("the first and last chunks alone need more layers than the model has");
  if (rest_chunks == 0 && rest != 0) fail("no chunk is left for the remaining " + std::to_string(rest) + " layers");
  if (rest_chunks > 0 && (rest % rest_chunks != 0 || rest / rest_chunks == 0))
    fail("the other " + std::to_string(rest_chunks) + " chunks would share " + std::to_string(rest) +
         " layers, which is not a positive multiple of " + std::to_string(rest_chunks));
  for (int g = 0; g < chunks; ++g) out[static_cast<size_t>(g)] = rest_chunks > 0 ? rest / rest_chunks : 0;
  if (first > 0) out.front() = first;
  if (last > 0) out.back() = last;
  return out;
}

}  // namespace loom::topology
