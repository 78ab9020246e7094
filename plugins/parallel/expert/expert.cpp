// parallel/expert: token dispatch for expert parallelism by all-to-all
// (Megatron's alltoall token dispatcher), the default of manifest key
// parallel.expert.
//
// plan: the per-expert counts go out by one all_to_all of int32 (block j of what
// a rank sends: its counts for the experts of ep rank j), so every rank learns
// how many rows each source sends to each of its local experts.
// dispatch: the dispatch rows are expert-major, so the rows for ep rank j are one
// contiguous block: one all_to_all_v sends them (received source-major, each
// source's rows expert-major), then a row gather sorts them expert-major with the
// sources in order. combine: the inverse gather, then the all_to_all_v back.
#include "../expert_common/dispatcher.hpp"

namespace {

using loom::expert_dispatch::Dispatcher;
using loom::expert_dispatch::gather_rows;

class AllToAll : public Dispatcher {
 public:
  AllToAll(loom_rank* rank, const loom_ep_create_args& a) : Dispatcher(rank, a, "parallel/expert") {}

  void plan(const loom_ep_plan_args& a) override {
    const std::vector<int32_t> mine = counts_of(a.expert_rows);
    // recv[j * local + le]: rows source j routes to local expert le.
    const std::vector<int32_t> recv = exchange_ints(mine, mine.size(), [&](void* s, void* r) {
      ep_.all_to_all(a.stream, s, r, static_cast<size_t>(local_), LOOM_DTYPE_I32);
    });
    Plan p;
    auto rc = [&](int64_t j, int64_t le) { return static_cast<size_t>(recv[static_cast<size_t>(j * local_ + le)]); };
    size_t displ = 0;
    for (int64_t j = 0; j < size_; ++j) {
      p.send.push_back(static_cast<size_t>(a.expert_rows[(j + 1) * local_] - a.expert_rows[j * local_]));
      p.send_displ.push_back(static_cast<size_t>(a.expert_rows[j * local_]));
      size_t n = 0;
      for (int64_t le = 0; le < local_; ++le) n += rc(j, le);
      p.recv.push_back(n);
      p.recv_displ.push_back(displ);
      displ += n;
    }
    p.rows = static_cast<int64_t>(displ);
    std::vector<int32_t> sorted_from(displ), received_from(displ);
    std::vector<size_t> next(p.recv_displ);  // per source: its next received row
    size_t pos = 0;
    a.local_rows[0] = 0;
    for (int64_t le = 0; le < local_; ++le) {
      for (int64_t j = 0; j < size_; ++j)
        for (size_t i = 0; i < rc(j, le); ++i, ++pos) {
          const size_t from = next[static_cast<size_t>(j)]++;
          sorted_from[pos] = static_cast<int32_t>(from);
          received_from[from] = static_cast<int32_t>(pos);
        }
      a.local_rows[le + 1] = static_cast<int64_t>(pos);
    }
    p.sorted_from = loom::expert_dispatch::upload_ids(rank_, dev_, sorted_from);
    p.received_from = loom::expert_dispatch::upload_ids(rank_, dev_, received_from);
    plans_[a.slot] = std::move(p);
  }

  // x [N, w] -> out [R, w] at this rank's experts, expert-major.
  void dispatch(const loom_ep_move_args& a) override {
    const Plan& p = plan_of(plans_, a.slot);
    loom::Buffer received(rank_, bytes(p.rows * a.width, a.dtype));
    exchange(a, p, /*outward=*/true, a.x, received.get());
    gather_rows(dev_, received.get(), p.sorted_from.get<int32_t>(), a.out, p.rows, p.rows, a.width, a.dtype);
  }
  // x [R, w] at this rank's experts -> out [N, w] at the sources.
  void combine(const loom_ep_move_args& a) override {
    const Plan& p = plan_of(plans_, a.slot);
    loom::Buffer unsorted(rank_, bytes(p.rows * a.width, a.dtype));
    gather_rows(dev_, a.x, p.received_from.get<int32_t>(), unsorted.get(), p.rows, p.rows, a.width, a.dtype);
    exchange(a, p, /*outward=*/false, unsorted.get(), a.out);
  }
  void release(int32_t slot) override { plans_.erase(slot); }

 private:
  struct Plan {
    int64_t rows = 0;  // R
    // Per ep rank j, in rows: what goes to j (contiguous from send_displ[j]) and
    // what comes from j (at recv_displ[j]).
    std::vector<size_t> send, send_displ, recv, recv_displ;
    loom::Buffer sorted_from;    // [R] expert-major row -> received row
    loom::Buffer received_from;  // [R] received row -> expert-major row
  };

  static size_t bytes(int64_t n, int32_t dtype) { return static_cast<size_t>(n) * loom::dtype_size(dtype); }
  // One all_to_all_v of rows: out to the experts' ranks, or (outward = false) back.
  void exchange(const loom_ep_move_args& a, const Plan& p, bool outward, const void* in, void* out) const {
    auto scaled = [&](const std::vector<size_t>& rows) {
      std::vector<size_t> v(rows);
      for (size_t& x : v) x *= static_cast<size_t>(a.width);
      return v;
    };
    const std::vector<size_t> in_n = scaled(outward ? p.send : p.recv), in_d = scaled(outward ? p.send_displ : p.recv_displ),
                              out_n = scaled(outward ? p.recv : p.send),
                              out_d = scaled(outward ? p.recv_displ : p.send_displ);
    ep_.all_to_all_v(a.stream, in, in_n.data(), in_d.data(), out, out_n.data(), out_d.data(), a.dtype);
  }

  std::map<int32_t, Plan> plans_;
};

}  // namespace

LOOM_PLUGIN_LIBRARY(loom::raw_plugin("parallel", "expert", "1.0.0",
                                     "expert-parallel token dispatch by all-to-all (counts, then rows; sorted "
                                     "expert-major by a row gather)",
                                     LOOM_API_EXPERT_PARALLEL,
                                     loom::expert_dispatch::expert_parallel_api<AllToAll>()))
