// What the expert-parallel dispatch plugins (parallel/expert: all-to-all;
// parallel/expert.allgather: all-gather + reduce-scatter) share: the handle's
// base class, the per-slot plan bookkeeping, the device row gather, and the C
// table (loom_expert_parallel_api, ABI 1.4) built from a Dispatcher subclass.
//
// The contract (loom_ep.h): a rank's dispatch rows [N, w] are expert-major over
// the E experts; dispatch delivers [R, w] to the rank holding each expert,
// expert-major over its local experts, the rows of one expert ordered by source
// ep rank, then by their row at the source; combine is the inverse. Collectives
// take the caller's stream, which the ABI fixes as the rank's compute stream, the
// one dev_ runs the gathers and copies on, so both are ordered.
#pragma once

#include <loom/cpp/plugin.hpp>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace loom::expert_dispatch {

// out [n, w] = table [table_rows, w] at ids (int32, device): the device's row
// gather (embedding_fwd).
inline void gather_rows(const loom::Device& dev, const void* table, const int32_t* ids, void* out, int64_t n,
                        int64_t table_rows, int64_t w, int32_t dtype) {
  if (n == 0) return;
  dev.embedding_fwd({.n = n, .dim = w, .vocab_rows = table_rows, .vocab_start = 0, .ids = ids, .table = table,
                     .out = out, .dtype = dtype});
}

// A device copy of host int32 ids (empty buffer for none).
inline loom::Buffer upload_ids(loom_rank* rank, const loom::Device& dev, const std::vector<int32_t>& ids) {
  loom::Buffer b(rank, ids.size() * sizeof(int32_t));
  if (!ids.empty()) dev.copy(b.get(), ids.data(), ids.size() * sizeof(int32_t), LOOM_COPY_HOST_TO_DEVICE);
  return b;
}

// One layer's handle. Subclasses keep their plans per slot.
class Dispatcher {
 public:
  Dispatcher(loom_rank* rank, const loom_ep_create_args& a, std::string plugin)
      : rank_(rank), ep_(a.ep), dev_(loom::Rank(rank).device()), plugin_(std::move(plugin)),
        name_(a.instance_name ? a.instance_name : "moe") {
    size_ = std::max(1, a.ep.size);
    ep_rank_ = std::max(0, a.ep.rank);
    experts_ = a.num_experts;
    LOOM_REQUIRE(experts_ >= 1 && experts_ % size_ == 0, plugin_ << ": " << name_ << " has " << experts_
                                                                 << " experts, which do not split over the ep group of "
                                                                 << size_ << " ranks");
    local_ = experts_ / size_;
  }
  virtual ~Dispatcher() = default;
  virtual void plan(const loom_ep_plan_args& a) = 0;
  virtual void dispatch(const loom_ep_move_args& a) = 0;
  virtual void combine(const loom_ep_move_args& a) = 0;
  virtual void release(int32_t slot) = 0;

 protected:
  // This rank's counts per global expert from expert_rows [E + 1].
  std::vector<int32_t> counts_of(const int64_t* expert_rows) const {
    LOOM_REQUIRE(expert_rows[0] == 0, plugin_ << ": " << name_ << ": expert_rows must start at 0 (got "
                                              << expert_rows[0] << ")");
    std::vector<int32_t> c(static_cast<size_t>(experts_));
    for (int64_t e = 0; e < experts_; ++e) {
      LOOM_REQUIRE(expert_rows[e + 1] >= expert_rows[e], plugin_ << ": " << name_ << ": expert_rows must not decrease");
      c[static_cast<size_t>(e)] = static_cast<int32_t>(expert_rows[e + 1] - expert_rows[e]);
    }
    return c;
  }
  // Host ints through device memory and a collective: `run` gets (send, recv) device pointers.
  template <typename Run>
  std::vector<int32_t> exchange_ints(const std::vector<int32_t>& sent, size_t received, Run&& run) const {
    loom::Buffer s(rank_, sent.size() * sizeof(int32_t)), r(rank_, received * sizeof(int32_t));
    dev_.copy(s.get(), sent.data(), sent.size() * sizeof(int32_t), LOOM_COPY_HOST_TO_DEVICE);
    run(s.get(), r.get());
    std::vector<int32_t> out(received);
    dev_.copy(out.data(), r.get(), received * sizeof(int32_t), LOOM_COPY_DEVICE_TO_HOST);
    dev_.synchronize();
    return out;
  }
  template <typename Plan>
  Plan& plan_of(std::map<int32_t, Plan>& plans, int32_t slot) const {
    auto it = plans.find(slot);
    LOOM_REQUIRE(it != plans.end(), plugin_ << ": " << name_ << ": no plan for slot " << slot
                                            << " (plan it first, and not after release)");
    return it->second;
  }

  loom_rank* rank_;
  loom::Group ep_;
  loom::Device dev_;
  std::string plugin_, name_;
  int size_ = 1, ep_rank_ = 0;
  int64_t experts_ = 0, local_ = 0;
};

namespace detail {
inline Dispatcher* handle(loom_ep* h) { return reinterpret_cast<Dispatcher*>(h); }

// fn(handle, args widened to this build's layout: an older caller's missing members read as zero).
template <typename Args, typename Fn>
loom_status call(loom_ep* h, const Args* a, const char* what, Fn&& fn) {
  return loom::guard([&] {
    LOOM_REQUIRE(h != nullptr, what << ": a handle is required");
    fn(*handle(h), loom::detail::widened(a, what));
  });
}
}  // namespace detail

// The C table of a Dispatcher subclass T (constructible from (loom_rank*, const
// loom_ep_create_args&)).
template <typename T>
const loom_expert_parallel_api* expert_parallel_api() {
  static const loom_expert_parallel_api api = [] {
    loom_expert_parallel_api t = loom::make<loom_expert_parallel_api>();
    t.create = [](loom_rank* rank, const loom_ep_create_args* args, loom_ep** out) -> loom_status {
      return loom::guard([&] {
        LOOM_REQUIRE(out != nullptr, "expert-parallel create needs out");
        *out = reinterpret_cast<loom_ep*>(
            static_cast<Dispatcher*>(new T(rank, loom::detail::widened(args, "expert-parallel create"))));
      });
    };
    t.destroy = [](loom_ep* h) { delete detail::handle(h); };
    t.plan = [](loom_ep* h, const loom_ep_plan_args* a) {
      return detail::call(h, a, "expert-parallel plan", [](Dispatcher& d, const loom_ep_plan_args& r) {
        LOOM_REQUIRE(r.expert_rows != nullptr && r.local_rows != nullptr,
                     "expert-parallel plan: expert_rows and local_rows are required");
        d.plan(r);
      });
    };
    t.dispatch = [](loom_ep* h, const loom_ep_move_args* a) {
      return detail::call(h, a, "expert-parallel dispatch", [](Dispatcher& d, const loom_ep_move_args& r) { d.dispatch(r); });
    };
    t.combine = [](loom_ep* h, const loom_ep_move_args* a) {
      return detail::call(h, a, "expert-parallel combine", [](Dispatcher& d, const loom_ep_move_args& r) { d.combine(r); });
    };
    t.release = [](loom_ep* h, int32_t slot) {
      if (h) (void)loom::guard([&] { detail::handle(h)->release(slot); });
    };
    return t;
  }();
  return &api;
}

}  // namespace loom::expert_dispatch
