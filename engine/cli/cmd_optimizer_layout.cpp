// `loom optimizer-layout`: the flat buffer layout the engine gives a model's
// parameters (Megatron-LM's rules, from layout_buffer) and, per data-parallel rank,
// the shard of each bucket the distributed optimizer steps, with the world,
// bucket, local and param ranges of every parameter piece in it (Megatron-LM's `distrib_optimizer.py`).
#include "engine/cli/args.hpp"
#include "engine/model/buffer_layout.hpp"
#include "engine/model/shard_ranges.hpp"
#include "engine/runtime/json.hpp"

#include <cerrno>
#include <cstdlib>
#include <iomanip>
#include <iostream>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

namespace loom::cli {

int cmd_optimizer_layout(int argc, char** argv);

namespace {

constexpr const char* kUsage =
    "usage: loom optimizer-layout --param-numels N0,N1,... --dp D [--bucket-size N] [--json]\n"
    "\n"
    "Print where each parameter lives in the flat parameter/gradient buffers and which\n"
    "part of it each data-parallel rank owns under optimizer.strategy = \"distributed\".\n"
    "Layout (Megatron-LM): parameters in reverse model order, each start aligned to 64\n"
    "elements, buckets closed once they reach --bucket-size elements, each bucket end\n"
    "rounded up to a multiple of lcm(dp, 128); rank r owns shard r of every bucket.\n"
    "\n"
    "  --param-numels L  element counts of the parameters in model order, comma-separated\n"
    "                    (required; each >= 1)\n"
    "  --dp D            data-parallel size (required, >= 1)\n"
    "  --bucket-size N   bucket size in elements (default 0 = one bucket)\n"
    "  --json            print {\"buffer_numel\", \"buckets\": [{start, end}], \"params\":\n"
    "                    [{index, start, end}], \"ranks\": [{rank, shards: [{bucket, range,\n"
    "                    params: [{index, world, bucket, local, param}]}]}]}; ranges are\n"
    "                    half-open [start, end) element ranges\n"
    "  --help            print this and exit\n"
    "\n"
    "Ranges per parameter piece: world = in the buffer, bucket = from the bucket's start,\n"
    "local = from the rank's shard start, param = within the flattened parameter.\n"
    "\n"
    "Exit status: 0 ok, 2 bad usage.\n";

constexpr long long kMaxCount = 1LL << 48;

long long parse_count(const std::string& text, const std::string& what, long long min, long long max = kMaxCount) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno == ERANGE || v < min || v > max)
    throw UsageError(what + " must be an integer from " + std::to_string(min) + " to " + std::to_string(max) +
                     (max == kMaxCount ? " (2^48)" : "") + ", got '" + text + "'");
  return v;
}

std::vector<size_t> parse_numels(const std::string& list) {
  std::vector<size_t> out;
  size_t pos = 0;
  while (true) {
    const size_t comma = list.find(',', pos);
    const std::string item = list.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    out.push_back(static_cast<size_t>(
        parse_count(item, "--param-numels entry " + std::to_string(out.size()), 1)));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

// [start, end] as a two-element array.
nlohmann::ordered_json range_json(const model::Range& r) { return {r.start, r.end}; }

std::string range_text(const model::Range& r) {
  return "[" + std::to_string(r.start) + ", " + std::to_string(r.end) + ")";
}

void print_json(const model::BufferLayout& l, int dp) {
  using nlohmann::ordered_json;
  ordered_json buckets = ordered_json::array(), params = ordered_json::array(), ranks = ordered_json::array();
  for (const model::Range& b : l.buckets) buckets.push_back({{"start", b.start}, {"end", b.end}});
  for (size_t i = 0; i < l.params.size(); ++i)
    params.push_back({{"index", i}, {"start", l.params[i].start}, {"end", l.params[i].end}});
  for (int r = 0; r < dp; ++r) {
    ordered_json shards = ordered_json::array();
    for (const model::RankShard& s : model::shard_ranges(l, dp, r)) {
      ordered_json pieces = ordered_json::array();
      for (const model::ParamShard& p : s.params)
        pieces.push_back({{"index", p.index},
                          {"world", range_json(p.world)},
                          {"bucket", range_json(p.bucket)},
                          {"local", range_json(p.local)},
                          {"param", range_json(p.param)}});
      shards.push_back({{"bucket", s.bucket}, {"range", range_json(s.range)}, {"params", pieces}});
    }
    ranks.push_back({{"rank", r}, {"shards", shards}});
  }
  std::cout << runtime::dump_json({{"buffer_numel", l.numel}, {"buckets", buckets}, {"params", params}, {"ranks", ranks}})
            << "\n";
}

void print_table(const model::BufferLayout& l, const std::vector<size_t>& numels, int dp, size_t bucket_size) {
  size_t used = std::accumulate(numels.begin(), numels.end(), size_t{0});
  std::cout << "buffer " << l.numel << " elements (" << used << " parameter, " << l.numel - used << " padding), "
            << l.buckets.size() << " bucket(s), dp " << dp << "\n"
            << "rules: reverse model order, starts aligned to " << model::kParamStartAlign
            << ", bucket ends to lcm(dp, 128) = " << std::lcm(static_cast<size_t>(dp), size_t{128})
            << ", bucket size " << (bucket_size ? std::to_string(bucket_size) : std::string("unlimited")) << "\n\n";

  std::cout << "buckets\n";
  for (size_t b = 0; b < l.buckets.size(); ++b)
    std::cout << "  " << std::setw(4) << b << "  " << range_text(l.buckets[b]) << "  (" << l.buckets[b].size()
              << " elements, shard " << l.buckets[b].size() / static_cast<size_t>(dp) << ")\n";

  std::cout << "\nparameters (model order)\n  index      numel  buffer range\n";
  for (size_t i = 0; i < l.params.size(); ++i)
    std::cout << "  " << std::setw(5) << i << "  " << std::setw(9) << numels[i] << "  " << range_text(l.params[i])
              << "\n";

  for (int r = 0; r < dp; ++r) {
    std::cout << "\nrank " << r << "\n";
    for (const model::RankShard& s : model::shard_ranges(l, dp, r)) {
      std::cout << "  bucket " << s.bucket << " shard " << range_text(s.range);
      if (s.params.empty()) {
        std::cout << "  (padding only)\n";
        continue;
      }
      std::cout << "\n    " << std::left << std::setw(7) << "index" << std::setw(20) << "world" << std::setw(20)
                << "bucket" << std::setw(20) << "local"
                << "param range" << std::right << "\n";
      for (const model::ParamShard& p : s.params)
        std::cout << "    " << std::left << std::setw(7) << p.index << std::setw(20) << range_text(p.world)
                  << std::setw(20) << range_text(p.bucket) << std::setw(20) << range_text(p.local)
                  << range_text(p.param) << std::right << "\n";
    }
  }
}

}  // namespace

int cmd_optimizer_layout(int argc, char** argv) {
  std::vector<size_t> numels;
  int dp = 1;
  size_t bucket_size = 0;
  bool json = false;
  try {
    Args a(argc, argv, {"--json"}, {"--param-numels", "--dp", "--bucket-size"});
    if (a.flag("--help")) {
      std::cout << kUsage;
      return 0;
    }
    if (!a.positionals().empty()) throw UsageError("unexpected argument '" + a.positionals().front() + "'");
    if (!a.has("--param-numels")) throw UsageError("--param-numels is required");
    if (!a.has("--dp")) throw UsageError("--dp is required");
    numels = parse_numels(*a.get("--param-numels"));
    dp = static_cast<int>(parse_count(*a.get("--dp"), "--dp", 1, 1'000'000));
    if (auto b = a.get("--bucket-size")) bucket_size = static_cast<size_t>(parse_count(*b, "--bucket-size", 0));
    json = a.flag("--json");
  } catch (const UsageError& e) {
    std::cerr << "loom optimizer-layout: " << e.what() << "; see 'loom optimizer-layout --help'\n";
    return 2;
  }

  const model::BufferLayout layout = model::layout_buffer(numels, dp, bucket_size);
  if (json)
    print_json(layout, dp);
  else
    print_table(layout, numels, dp, bucket_size);
  return 0;
}

}  // namespace loom::cli
