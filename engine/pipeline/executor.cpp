#include "engine/pipeline/executor.hpp"

#include <algorithm>

namespace loom::pipeline {

using Clock = std::chrono::steady_clock;

void TraceRecorder::add(int rank, const std::string& name, const std::string& category, Clock::time_point start,
                        std::vector<std::pair<std::string, long long>> args, TraceLane lane) {
  const Clock::time_point end = Clock::now();
  TraceEvent e;
  e.rank = rank;
  e.lane = lane;
  e.name = name;
  e.category = category;
  e.start_us = std::chrono::duration<double, std::micro>(start - origin_).count();
  e.dur_us = std::chrono::duration<double, std::micro>(end - start).count();
  e.args = std::move(args);
  events_.push_back(std::move(e));
}

Executor::Executor(model::Model& model, runtime::RankRuntime& rank, const std::vector<int32_t>& order,
                   int microbatches, TraceRecorder* trace, bool post_receives_early)
    : model_(model), rank_(rank), microbatches_(microbatches),
      post_early_(post_receives_early), trace_(trace), pp_(rank.group_or_self("pp")), cp_(rank.group_or_self("cp")) {
  LOOM_REQUIRE(order.size() == 2 * model.chunk_count() * static_cast<size_t>(microbatches),
               "pipeline order of " << order.size() << " entries for " << model.chunk_count() << " chunk(s) and "
                                    << microbatches << " microbatch(es)");
  std::vector<int> next_forward(model.chunk_count(), 0), next_backward(model.chunk_count(), 0);
  int receiving_backwards = 0;
  for (const int32_t entry : order) {
    Step s;
    s.forward = entry > 0;
    s.chunk = std::abs(entry) - 1;
    s.mb = (s.forward ? next_forward : next_backward)[static_cast<size_t>(s.chunk)]++;
    s.receives = s.forward ? !model.is_first_global(s.chunk) : !model.is_last_global(s.chunk);
    if (!s.forward && s.receives) s.grad_slot = post_early_ ? receiving_backwards++ % 2 : 0;
    steps_.push_back(s);
  }
  // The output-gradient slots the order uses, allocated before any step's measure.
  const bool receives_gradients =
      std::any_of(steps_.begin(), steps_.end(), [](const Step& s) { return !s.forward && s.receives; });
  if (receives_gradients) model.chunk_grad_output(0);
  if (post_early_ && receiving_backwards > 1) model.chunk_grad_output(1);
}

int Executor::peer_of_chunk(int global_chunk) const { return global_chunk % pp_.size(); }

// The tag of a message into global chunk g: 2g for its forward input, 2g + 1 for
// its output's gradient.
int Executor::tag_into(int global_chunk, bool forward) { return 2 * global_chunk + (forward ? 0 : 1); }

Executor::Receive Executor::receive_of(const Step& s) {
  const int g = model_.chunk_global_index(s.chunk);
  if (s.forward) return {model_.chunk_input(s.chunk, s.mb), peer_of_chunk(g - 1), tag_into(g, true)};
  return {model_.chunk_grad_output(s.grad_slot), peer_of_chunk(g + 1), tag_into(g, false)};
}

loom::CommRequest Executor::post_receive(const Step& s) {
  const Receive r = receive_of(s);
  return pp_.start_recv(rank_.dev().native_stream(), r.buf, model_.hidden_numel(), model_.act_dtype(), r.peer, r.tag);
}

void Executor::finish_receive(const Step& s, loom::CommRequest& posted) {
  const Clock::time_point t0 = Clock::now();
  if (posted.pending()) {
    posted.wait();
  } else {
    const Receive r = receive_of(s);
    pp_.recv(rank_.dev().native_stream(), r.buf, model_.hidden_numel(), model_.act_dtype(), r.peer, r.tag);
  }
  if (trace_)
    trace_->add(rank_.global_rank(),
                (s.forward ? "recv act c" : "recv grad c") + std::to_string(model_.chunk_global_index(s.chunk)), "p2p",
                t0);
}

void Executor::send(const void* data, int to_chunk, bool forward) {
  const Clock::time_point t0 = Clock::now();
  pp_.send(rank_.dev().native_stream(), data, model_.hidden_numel(), model_.act_dtype(), peer_of_chunk(to_chunk),
           tag_into(to_chunk, forward));
  if (trace_)
    trace_->add(rank_.global_rank(), (forward ? "send act c" : "send grad c") + std::to_string(to_chunk), "p2p", t0);
}

StepStats Executor::train_step(const std::vector<MicrobatchInput>& inputs, double per_token_scale) {
  LOOM_REQUIRE(inputs.size() == static_cast<size_t>(microbatches_),
               "train_step with " << inputs.size() << " microbatch inputs, the order has " << microbatches_);
  StepState st;
  st.loss_scale.assign(static_cast<size_t>(microbatches_), 1.f);
  st.per_token_scale = per_token_scale;
  std::vector<uint64_t> seeds;
  for (const MicrobatchInput& in : inputs) seeds.push_back(in.dropout_seed);
  model_.stage_dropout_seeds(seeds);  // one copy; before base_bytes (allocated once)
  st.base_bytes = rank_.memory().current_bytes;
  // A receive posted early may need this rank's current step (GPipe's first
  // backward needs the last forward): a failure stops the world before the way out
  // waits for it, so that wait fails at once instead of at the comm timeout.
  try {
    if (post_early_ && !steps_.empty() && steps_[0].receives) st.ahead = post_receive(steps_[0]);
    for (size_t i = 0; i < steps_.size(); ++i) run_step(i, inputs, st);
  } catch (const std::exception& e) {
    if (st.ahead.pending()) rank_.abort_world(e.what());
    throw;
  }
  if (model_.replays_steps()) {
    measured_activation_bytes_ = std::max(measured_activation_bytes_, st.stats.peak_activation_bytes);
    st.stats.peak_activation_bytes = measured_activation_bytes_;
  }
  return st.stats;
}

void Executor::note_memory(StepState& st) const {
  st.stats.peak_activation_bytes =
      std::max(st.stats.peak_activation_bytes, rank_.memory().current_bytes - st.base_bytes);
}

void Executor::run_step(size_t i, const std::vector<MicrobatchInput>& inputs, StepState& st) {
  const Step& step = steps_[i];
  loom::CommRequest mine = std::move(st.ahead);
  if (post_early_ && i + 1 < steps_.size() && steps_[i + 1].receives) {
    st.ahead = post_receive(steps_[i + 1]);
    note_memory(st);  // the next input's buffer is held from here: a backward step's peak too
  }
  if (step.receives) finish_receive(step, mine);
  if (step.forward) run_forward(step, inputs[static_cast<size_t>(step.mb)], st);
  else run_backward(step, st);
}

void Executor::run_forward(const Step& step, const MicrobatchInput& in, StepState& st) {
  const int c = step.chunk, mb = step.mb, g = model_.chunk_global_index(c);
  const Clock::time_point t0 = Clock::now();
  float loss_sum = 0, aux_loss = 0;
  int64_t count = 0;
  const void* out = model_.forward_chunk(c, mb, in.tokens, in.targets, true, in.dropout_seed, &loss_sum, &count,
                                         nullptr, &aux_loss, in.document_start, in.position_ids);
  st.stats.aux_loss += aux_loss / microbatches_;
  st.stats.peak_in_flight = std::max(st.stats.peak_in_flight, ++st.in_flight);
  note_memory(st);
  if (trace_)
    trace_->add(rank_.global_rank(), "F mb" + std::to_string(mb + 1) + " c" + std::to_string(g), "forward", t0,
                {{"microbatch", mb + 1}, {"chunk", g}});
  if (!model_.is_last_global(c)) {
    send(out, g + 1, true);
    return;
  }
  // Under context parallelism each cp rank holds other tokens of the microbatch:
  // its loss and token count are summed over cp. Every cp rank's gradient is then a
  // partial sum that the optimizer averages over dp-cp, so the scale carries a
  // factor cp (Megatron's loss * cp_size).
  double sums[2] = {loss_sum, static_cast<double>(count)};
  if (cp_.size() > 1) cp_.all_reduce(nullptr, sums, sums, 2, LOOM_DTYPE_F64);
  const double scale = st.per_token_scale > 0 ? st.per_token_scale : 1.0 / (std::max(sums[1], 1.0) * microbatches_);
  st.loss_scale[static_cast<size_t>(mb)] = static_cast<float>(cp_.size() * scale);
  st.stats.loss += sums[0] * scale;
}

void Executor::run_backward(const Step& step, StepState& st) {
  const int c = step.chunk, mb = step.mb, g = model_.chunk_global_index(c);
  const Clock::time_point t0 = Clock::now();
  // Auxiliary losses are averaged over microbatches; under cp each rank's part of
  // them is a partial sum too, scaled by cp as the loss is.
  const bool last_microbatch = mb + 1 == microbatches_;  // the chunk's gradients become final
  const void* grad_in = model_.backward_chunk(c, mb, st.loss_scale[static_cast<size_t>(mb)],
                                              static_cast<float>(cp_.size()) / static_cast<float>(microbatches_),
                                              last_microbatch, step.grad_slot);
  --st.in_flight;
  if (trace_)
    trace_->add(rank_.global_rank(), "B mb" + std::to_string(mb + 1) + " c" + std::to_string(g), "backward", t0,
                {{"microbatch", mb + 1}, {"chunk", g}});
  if (!model_.is_first_global(c)) send(grad_in, g - 1, false);
}

void Executor::forward_only(int mb, const MicrobatchInput& in, double* loss_sum, int64_t* tokens) {
  for (int c = 0; c < static_cast<int>(model_.chunk_count()); ++c) {
    const Step step{.forward = true, .chunk = c, .mb = mb, .receives = !model_.is_first_global(c)};
    loom::CommRequest none;  // received now
    if (step.receives) finish_receive(step, none);
    float sum = 0;
    int64_t count = 0;
    const void* out =
        model_.forward_chunk(c, mb, in.tokens, in.targets, false, in.dropout_seed, &sum, &count, in.predictions,
                             nullptr, in.document_start, in.position_ids);
    if (model_.is_last_global(c)) {
      *loss_sum += sum;
      *tokens += count;
    } else {
      send(out, model_.chunk_global_index(c) + 1, true);
    }
    model_.release_chunk(c, mb);
  }
}

}  // namespace loom::pipeline
