// parallel/expert.allgather: token dispatch for expert parallelism by all-gather
// and reduce-scatter (Megatron's allgather token dispatcher), chosen with
// parallel.expert = "expert.allgather".
//
// plan: every rank's per-expert counts are all-gathered, so each rank knows where
// every source's rows for its experts lie.
// dispatch: all rows of the group are all-gathered ([ep * N, w], each source's
// block padded to the largest N) and each rank gathers the rows of its experts,
// expert-major with the sources in order, as parallel/expert delivers them.
// combine: each rank places its experts' outputs at their rows in a zero
// [ep * N, w] buffer and one reduce-scatter hands every source its block: each row
// is one rank's output plus zeros, so the result equals parallel/expert's bit for
// bit. It moves ep times the rows of all-to-all but needs no per-peer counts in the
// collectives, which suits small groups, few tokens, or a fabric whose all-gather
// and reduce-scatter are faster than its all-to-all.
#include "../expert_common/dispatcher.hpp"

#include <algorithm>

namespace {

using loom::expert_dispatch::Dispatcher;
using loom::expert_dispatch::gather_rows;

class AllGather : public Dispatcher {
 public:
  AllGather(loom_rank* rank, const loom_ep_create_args& a) : Dispatcher(rank, a, "parallel/expert.allgather") {}

  void plan(const loom_ep_plan_args& a) override {
    const std::vector<int32_t> mine = counts_of(a.expert_rows);
    // all[j * E + e]: rows source j routes to expert e.
    const std::vector<int32_t> all = exchange_ints(mine, mine.size() * static_cast<size_t>(size_), [&](void* s, void* r) {
      ep_.all_gather(a.stream, s, r, mine.size(), LOOM_DTYPE_I32);
    });
    Plan p;
    std::vector<std::vector<int64_t>> first(static_cast<size_t>(size_));  // per source: first row of each expert
    for (int64_t j = 0; j < size_; ++j) {
      std::vector<int64_t>& f = first[static_cast<size_t>(j)];
      f.assign(static_cast<size_t>(experts_ + 1), 0);
      for (int64_t e = 0; e < experts_; ++e) f[e + 1] = f[e] + all[static_cast<size_t>(j * experts_ + e)];
      p.block = std::max(p.block, f[experts_]);
    }
    p.rows_here = a.expert_rows[experts_];
    std::vector<int32_t> sorted_from;
    a.local_rows[0] = 0;
    for (int64_t le = 0; le < local_; ++le) {
      const int64_t e = ep_rank_ * local_ + le;
      for (int64_t j = 0; j < size_; ++j)
        for (int64_t i = first[static_cast<size_t>(j)][e]; i < first[static_cast<size_t>(j)][e + 1]; ++i)
          sorted_from.push_back(static_cast<int32_t>(j * p.block + i));
      a.local_rows[le + 1] = static_cast<int64_t>(sorted_from.size());
    }
    p.rows = static_cast<int64_t>(sorted_from.size());
    // combine's placement: gathered row g takes expert output place[g], or the
    // zero row R when another rank's expert has it.
    std::vector<int32_t> place(static_cast<size_t>(size_ * p.block), static_cast<int32_t>(p.rows));
    for (size_t pos = 0; pos < sorted_from.size(); ++pos) place[static_cast<size_t>(sorted_from[pos])] = static_cast<int32_t>(pos);
    p.sorted_from = loom::expert_dispatch::upload_ids(rank_, dev_, sorted_from);
    p.place = loom::expert_dispatch::upload_ids(rank_, dev_, place);
    plans_[a.slot] = std::move(p);
  }

  void dispatch(const loom_ep_move_args& a) override {
    const Plan& p = plan_of(plans_, a.slot);
    const size_t row = row_bytes(a);
    loom::Buffer padded, gathered(rank_, static_cast<size_t>(size_ * p.block) * row);
    const void* send = a.x;
    if (p.rows_here < p.block) {  // all-gather needs equal blocks
      padded = loom::Buffer(rank_, static_cast<size_t>(p.block) * row);
      if (p.rows_here > 0) dev_.copy(padded.get(), a.x, static_cast<size_t>(p.rows_here) * row, LOOM_COPY_DEVICE_TO_DEVICE);
      send = padded.get();
    }
    ep_.all_gather(a.stream, send, gathered.get(), static_cast<size_t>(p.block * a.width), a.dtype);
    gather_rows(dev_, gathered.get(), p.sorted_from.get<int32_t>(), a.out, p.rows, size_ * p.block, a.width, a.dtype);
  }

  void combine(const loom_ep_move_args& a) override {
    const Plan& p = plan_of(plans_, a.slot);
    const size_t row = row_bytes(a);
    // The experts' outputs and one zero row after them.
    loom::Buffer table(rank_, static_cast<size_t>(p.rows + 1) * row), full(rank_, static_cast<size_t>(size_ * p.block) * row);
    if (p.rows > 0) dev_.copy(table.get(), a.x, static_cast<size_t>(p.rows) * row, LOOM_COPY_DEVICE_TO_DEVICE);
    dev_.elementwise({.op = LOOM_EW_FILL, .n = a.width, .out = table.get<char>() + static_cast<size_t>(p.rows) * row,
                      .alpha = 0.f, .dtype = a.dtype, .out_dtype = a.dtype});
    gather_rows(dev_, table.get(), p.place.get<int32_t>(), full.get(), size_ * p.block, p.rows + 1, a.width, a.dtype);
    const size_t count = static_cast<size_t>(p.block * a.width);
    if (p.rows_here == p.block) {
      ep_.reduce_scatter(a.stream, full.get(), a.out, count, a.dtype, LOOM_REDUCE_SUM);
      return;
    }
    loom::Buffer mine(rank_, static_cast<size_t>(p.block) * row);
    ep_.reduce_scatter(a.stream, full.get(), mine.get(), count, a.dtype, LOOM_REDUCE_SUM);
    if (p.rows_here > 0) dev_.copy(a.out, mine.get(), static_cast<size_t>(p.rows_here) * row, LOOM_COPY_DEVICE_TO_DEVICE);
  }

  void release(int32_t slot) override { plans_.erase(slot); }

 private:
  struct Plan {
    int64_t rows = 0;       // R: rows for this rank's experts
    int64_t rows_here = 0;  // N: this rank's dispatch rows
    int64_t block = 0;      // the largest N of the group (each source's block in the all-gather)
    loom::Buffer sorted_from;  // [R] expert-major row -> gathered row
    loom::Buffer place;        // [ep * block] gathered row -> expert-major row, or R (a zero row)
  };
  static size_t row_bytes(const loom_ep_move_args& a) {
    return static_cast<size_t>(a.width) * loom::dtype_size(a.dtype);
  }

  std::map<int32_t, Plan> plans_;
};

}  // namespace

LOOM_PLUGIN_LIBRARY(loom::raw_plugin("parallel", "expert.allgather", "1.0.0",
                                     "expert-parallel token dispatch by all-gather of the rows and reduce-scatter "
                                     "of the experts' outputs",
                                     LOOM_API_EXPERT_PARALLEL,
                                     loom::expert_dispatch::expert_parallel_api<AllGather>()))
