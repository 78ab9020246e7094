#include "engine/topology/layer_split.hpp"

#include <stdexcept>
#include <string>

namespace loom::topology {

namespace {
std::vector<int> given_per_chunk(int num_blocks, int chunks, const std::vector<int>& each) {
  const auto fail = [&](const std::string& why) {
    throw std::invalid_argument("pipeline.chunk_layers gives " + std::to_string(each.size()) +
                                " pipeline chunk(s) their blocks: " + why);
  };
  if (static_cast<int>(each.size()) != chunks)
    fail("there are pp * vpp = " + std::to_string(chunks) + " chunks (in model order: stage s's virtual chunk v is "
         "chunk v * pp + s)");
  long long sum = 0;
  for (size_t g = 0; g < each.size(); ++g) {
    sum += each[g];
    if (each[g] == 0 && g > 0 && g + 1 < each.size())
      fail("chunk " + std::to_string(g) + " would hold nothing (only the first and the last, which hold the "
           "embedding and the output layer, may have no blocks)");
  }
  if (sum != num_blocks)
    fail("they add up to " + std::to_string(sum) + ", but the model has " + std::to_string(num_blocks) +
         " transformer layers (model.num_layers)");
  return each;
}
}  // namespace

std::vector<int> blocks_per_chunk(int num_blocks, int pp, int vpp, int first, int last, const std::vector<int>& each) {
  const int chunks = pp * vpp;
  std::vector<int> out(static_cast<size_t>(chunks), 0);
  if (chunks == 1) {  // one chunk holds every block, whatever the counts say (run_plan warns)
    out[0] = num_blocks;
    return out;
  }
  if (!each.empty()) return given_per_chunk(num_blocks, chunks, each);
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
