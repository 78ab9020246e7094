// The hidden states of the (chunk, microbatch) forwards in flight, in one pool of
// equal buffers: per (c, mb) the state received as the chunk's input (none on the
// first global chunk) and the state after each of its layers, in that order (their
// positions). Each state takes the lowest free slot of the pool, so in a fixed
// schedule order a (c, mb) gets the same slots, at the same addresses, every step,
// and the pool never holds more buffers than the schedule has in use at once. When
// steps are replayed from graphs the buffers stay allocated for the next step,
// which the graphs need; else each is freed as its slot is given back.
#pragma once

#include "engine/runtime/rank_runtime.hpp"

#include <loom/cpp/core.hpp>

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

namespace loom::model {

class HiddenStates {
 public:
  // shape: one hidden state, [rows, micro_batch, hidden], of LOOM_DTYPE_* dtype.
  // keep_buffers: slots given back keep their memory (replays_steps).
  HiddenStates(runtime::RankRuntime& rank, std::vector<int64_t> shape, int32_t dtype, bool keep_buffers);
  HiddenStates(const HiddenStates&) = delete;
  HiddenStates& operator=(const HiddenStates&) = delete;

  size_t numel() const;
  size_t bytes() const;
  // A view of one hidden state (or its gradient) at `data`.
  DLTensor view(void* data) const;

  // How many states (c, mb) holds (0: none, or given back).
  size_t count(int c, int mb) const;
  // Takes the lowest free slot for (c, mb)'s next state; returns its memory.
  void* push(int c, int mb);
  // The memory of (c, mb)'s state at `position`.
  void* at(int c, int mb, size_t position) const;
  // Gives back the slot at `position` before the others (activation
  // recomputation drops states it will make again); the position stays, empty.
  void drop(int c, int mb, size_t position);
  // An empty position takes the lowest free slot again; returns its memory.
  void* refill(int c, int mb, size_t position);
  // Gives back all of (c, mb)'s slots.
  void give_back(int c, int mb);
  // Frees every buffer.
  void clear();

 private:
  struct Slot {
    loom::Buffer buffer;
    bool in_use = false;
  };
  static constexpr size_t kDropped = static_cast<size_t>(-1);  // an empty position
  size_t take_slot();
  void drop_slot(size_t k);

  runtime::RankRuntime& rank_;
  std::vector<int64_t> shape_;
  int32_t dtype_;
  bool keep_buffers_;
  std::vector<Slot> pool_;
  std::map<std::pair<int, int>, std::vector<size_t>> held_;  // (c, mb) -> a slot per position
};

}  // namespace loom::model
