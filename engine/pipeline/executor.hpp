// Runs one rank's pipeline order (from a schedule plugin, checked by
// pipeline::simulate before launch) over the rank's model chunks: a forward of
// global chunk g receives its input from the rank holding g - 1 and sends its
// output to the rank holding g + 1; a backward receives the gradient of its
// output from g + 1 and sends the gradient of its input to g - 1. The last global
// chunk computes the loss. Without pipeline parallelism the order is
// [+1, -1] x microbatches over the one chunk, and nothing crosses ranks.
//
// Point-to-point messages go over the pp group with tag 2g (forward into chunk g)
// or 2g + 1 (backward into chunk g); sends do not wait for the receiver, so any
// order that passes the simulation runs without deadlock. With receives posted
// early (pipeline.overlap_p2p_comm, Megatron-LM's overlap_p2p_comm) each step's
// receive is started before the step ahead of it computes, so the transfer runs
// meanwhile; the receives keep their order, so results are bit-identical.
#pragma once

#include "engine/model/model.hpp"
#include "engine/pipeline/schedule.hpp"
#include "engine/runtime/rank_runtime.hpp"

#include <chrono>
#include <cstdint>
#include <vector>

namespace loom::pipeline {

// One microbatch's data on this rank (every stage loads its own copy; only the
// first global chunk reads tokens and only the last reads targets).
struct MicrobatchInput {
  const int32_t* tokens = nullptr;   // device [seq, micro_batch], alive until the step ends
  const int32_t* targets = nullptr;  // device [seq, micro_batch]
  const int32_t* document_start = nullptr;  // device [seq, micro_batch] (data.reset_attention_mask), or null
  const int32_t* position_ids = nullptr;    // device [seq, micro_batch] (data.reset_position_ids), or null
  uint64_t dropout_seed = 0;
  int32_t* predictions = nullptr;    // host [seq, micro_batch] (evaluation), or null
};

// Real timeline of a rank, for `loom run --trace`.
class TraceRecorder {
 public:
  explicit TraceRecorder(std::chrono::steady_clock::time_point origin) : origin_(origin) {}
  // Records [start, now) as an event of this rank.
  void add(int rank, const std::string& name, const std::string& category, std::chrono::steady_clock::time_point start,
           std::vector<std::pair<std::string, long long>> args = {}, TraceLane lane = TraceLane::Rank);
  std::vector<TraceEvent>& events() { return events_; }

 private:
  std::chrono::steady_clock::time_point origin_;
  std::vector<TraceEvent> events_;
};

struct StepStats {
  double loss = 0;             // mean over microbatches of the per-token loss (last stage; 0 elsewhere)
  double aux_loss = 0;         // this rank's layers' weighted auxiliary losses, mean over microbatches
  int peak_in_flight = 0;      // most (chunk, microbatch) forwards awaiting their backward at once
  // Device memory above the step's start, at its highest. When layer steps are
  // replayed from graphs they allocate nothing: a replayed step holds what its
  // capture (or warm-up) allocated, so the highest measurement so far stands for it.
  uint64_t peak_activation_bytes = 0;
};

class Executor {
 public:
  // order: this rank's signed order (2 * chunks * microbatches entries).
  // post_receives_early: start each step's receive before the previous step runs.
  Executor(model::Model& model, runtime::RankRuntime& rank, const std::vector<int32_t>& order, int microbatches,
           TraceRecorder* trace = nullptr, bool post_receives_early = false);

  // One training step's forwards and backwards; gradients accumulate in the
  // model's buffers: each microbatch's loss scaled by 1 / (its tokens * microbatches),
  // its mean, or with `per_token_scale` > 0 by that (dp / the global batch's tokens:
  // Megatron-LM's --calculate-per-token-loss, the loss summed over the batch's tokens
  // and divided by their number whatever the microbatches hold).
  StepStats train_step(const std::vector<MicrobatchInput>& inputs, double per_token_scale = 0);

  // Forward of one microbatch through every local chunk (evaluation). On the last
  // stage, adds the loss sum and token count; elsewhere leaves them.
  void forward_only(int mb, const MicrobatchInput& input, double* loss_sum, int64_t* tokens);

 private:
  // One entry of the order, with what it receives.
  struct Step {
    bool forward = true;
    int chunk = 0, mb = 0;
    bool receives = false;  // an input from another chunk's rank (forward: activations; backward: gradient)
    int grad_slot = 0;      // backward: the chunk_grad_output slot, alternating over receiving backwards
  };
  // Where step s's input comes from and lands: the chunk's input buffer, or its
  // gradient slot.
  struct Receive {
    void* buf;
    int peer, tag;
  };
  // What the steps of one train_step share.
  struct StepState {
    std::vector<float> loss_scale;  // per microbatch, once the last chunk's forward counted its tokens
    double per_token_scale = 0;     // > 0: every microbatch's loss sum times this
    uint64_t base_bytes = 0;        // device memory in use when the step began
    int in_flight = 0;              // forwards awaiting their backward
    loom::CommRequest ahead;        // the next step's receive, posted early
    StepStats stats;
  };
  int peer_of_chunk(int global_chunk) const;
  static int tag_into(int global_chunk, bool forward);
  Receive receive_of(const Step& s);
  // Starts step s's receive.
  loom::CommRequest post_receive(const Step& s);
  // Step s's input is in place: waits for its posted receive, or receives now.
  void finish_receive(const Step& s, loom::CommRequest& posted);
  // Sends a chunk's output (forward) or its input's gradient to global chunk `to_chunk`.
  void send(const void* data, int to_chunk, bool forward);
  // Step i of train_step: posts step i + 1's receive (early posting), takes its own
  // input, computes, sends its output.
  void run_step(size_t i, const std::vector<MicrobatchInput>& inputs, StepState& st);
  void run_forward(const Step& step, const MicrobatchInput& in, StepState& st);
  void run_backward(const Step& step, StepState& st);
  void note_memory(StepState& st) const;  // the step's peak so far

  model::Model& model_;
  runtime::RankRuntime& rank_;
  std::vector<Step> steps_;  // the rank's order, decoded
  int microbatches_;
  bool post_early_;
  TraceRecorder* trace_;
  loom::Group pp_;
  loom::Group cp_;  // context parallelism: the loss of a microbatch is summed over it
  uint64_t measured_activation_bytes_ = 0;  // the highest step measurement so far (see StepStats)
};

}  // namespace loom::pipeline
