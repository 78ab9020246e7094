#include "engine/train/metrics.hpp"

#include "engine/files/temporaries.hpp"
#include "engine/runtime/json.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <ostream>
#include <sstream>
#include <stdexcept>

namespace loom::train {

namespace {

std::string human(double v) {
  const char* units[] = {"", "k", "M", "G", "T"};
  int u = 0;
  while (std::fabs(v) >= 1000 && u < 4) {
    v /= 1000;
    ++u;
  }
  std::ostringstream os;
  os << std::fixed << std::setprecision(v < 10 ? 2 : 1) << v << units[u];
  return os.str();
}

std::string mib(uint64_t b) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(1) << b / (1024.0 * 1024.0) << " MiB";
  return os.str();
}

void add_evaluation(nlohmann::ordered_json& j, const StepRecord& r) {
  j["val_loss"] = r.val_loss;
  if (r.exact_match >= 0) j["val_exact_match"] = r.exact_match;
  if (r.token_accuracy >= 0) j["val_token_accuracy"] = r.token_accuracy;
}

// The progress line's evaluation part.
void print_evaluation(std::ostream& os, const StepRecord& r) {
  os << " | val loss " << std::fixed << std::setprecision(4) << r.val_loss;
  if (r.exact_match >= 0) os << " | val exact-match " << std::setprecision(1) << 100 * r.exact_match << "%";
}

}  // namespace

std::string step_json(const StepRecord& r) {
  nlohmann::ordered_json j = {{"step", r.step},
                              {"loss", r.loss},
                              {"aux_loss", r.aux_loss},
                              {"lr", r.lr},
                              {"weight_decay", r.weight_decay},
                              {"grad_norm", r.grad_norm},
                              {"global_batch", r.global_batch},
                              {"consumed_samples", r.consumed_samples},
                              {"tokens_per_s", r.tokens_per_s},
                              {"ms", r.ms},
                              {"flops_per_s", r.flops_per_s},
                              {"mfu", r.mfu},
                              {"mem_bytes", r.mem_current},
                              {"mem_peak_bytes", r.mem_peak},
                              {"in_flight", r.in_flight},
                              {"activation_bytes", r.activation_bytes},
                              {"comm", runtime::comm_stats_to_json(r.comm)}};
  if (r.evaluated) add_evaluation(j, r);
  return runtime::dump_json(j);  // inf and nan, which JSON cannot spell, as null
}

namespace {

// A resumed run appends: the lines of steps after its checkpoint (written before the
// earlier run stopped without saving them) are dropped first, as the steps are trained
// again. Lines that are not a step's are kept.
void drop_steps_after(const std::string& path, int64_t step, std::ostream* log) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return;
  files::WholeFile file(path);
  if (!file.replaces()) {  // the process's own stdout redirected to a file: not rewritten
    file.disown();
    return;
  }
  std::ifstream in(path);
  std::string kept, line;
  int64_t dropped = 0;
  bool torn = false;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.contains("step") && j["step"].is_number_integer() && j["step"].get<int64_t>() > step) {
      ++dropped;
      continue;
    }
    // A last line cut short (the disk filled, the process was killed mid-write): the
    // lines appended after it would not be JSON lines either.
    if (in.eof() && j.is_discarded()) {
      torn = true;
      continue;
    }
    kept += line + "\n";
  }
  if (dropped == 0 && !torn) return;
  std::ofstream out(file.path(), file.mode());
  out << kept;
  out.close();
  if (!out || !file.commit())
    throw std::runtime_error("metrics file " + path + ": cannot rewrite it without the steps after " +
                             std::to_string(step) + " (" + std::strerror(errno) + ")");
  if (log && dropped > 0)
    *log << "metrics: dropped " << dropped << " line(s) of steps after " << step << " from " << path
         << ", trained again from the checkpoint" << std::endl;
  if (log && torn) *log << "metrics: dropped the unfinished last line of " << path << std::endl;
}

}  // namespace

MetricsSink::MetricsSink(const std::string& metrics_file, int64_t resumed_step, std::ostream* log, int64_t steps,
                         int64_t log_every)
    : file_(metrics_file), log_(log), steps_(steps), log_every_(log_every) {
  if (file_.empty()) return;
  const bool append = resumed_step >= 0;
  if (append) drop_steps_after(file_, resumed_step, log);
  out_.open(file_, append ? std::ios::app : std::ios::trunc);
  if (!out_) throw std::runtime_error("metrics file " + file_ + ": cannot open the file for writing");
  struct stat st {};
  if (::stat(file_.c_str(), &st) == 0 && S_ISREG(st.st_mode)) whole_bytes_ = st.st_size;
}

void MetricsSink::write_tensorboard(const std::string& dir, int64_t first_step) {
  tensorboard_.emplace(dir, first_step);
}

void MetricsSink::tensorboard_write(int64_t step, const Scalars& values) {
  const bool first = tensorboard_->path().empty();
  tensorboard_->write(step, values);
  if (first && log_) *log_ << "tensorboard: writing " << tensorboard_->path() << std::endl;
}

// Megatron-LM's validation tags (the perplexity's exponent capped at 20, as its).
void MetricsSink::tensorboard_evaluation(const StepRecord& r, Scalars& values) const {
  values.emplace_back("lm loss validation", static_cast<float>(r.val_loss));
  values.emplace_back("lm loss validation ppl", static_cast<float>(std::exp(std::min(20.0, r.val_loss))));
  if (r.exact_match >= 0) values.emplace_back("exact-match validation", static_cast<float>(r.exact_match));
  if (r.token_accuracy >= 0) values.emplace_back("token-accuracy validation", static_cast<float>(r.token_accuracy));
}

void MetricsSink::complete(StepRecord& r) const {
  r.tokens_per_s = rates_.tokens_per_sample * static_cast<double>(r.global_batch) / (r.ms / 1000.0);
  r.flops_per_s = rates_.flops_per_sample * static_cast<double>(r.global_batch) / (r.ms / 1000.0);
  r.mfu = rates_.peak_tflops > 0 ? r.flops_per_s / (rates_.peak_tflops * 1e12 * rates_.world) : 0;
}

void MetricsSink::write(const StepRecord& r, bool stopping) {
  window_ms_ += r.ms;
  window_samples_ += static_cast<double>(r.global_batch);
  ++window_steps_;
  if (log_ && (r.step % log_every_ == 0 || r.step == steps_ || r.evaluated || stopping)) {
    const double avg_ms = window_ms_ / window_steps_, seconds = window_ms_ / 1000;
    std::ostream& os = *log_;
    os << "step " << std::setw(5) << r.step << "/" << steps_ << " | loss " << std::fixed << std::setprecision(4)
       << r.loss;
    if (r.aux_loss != 0) os << " | aux loss " << std::setprecision(4) << r.aux_loss;
    if (r.global_batch != rates_.global_batch) os << " | batch " << r.global_batch;
    os << " | lr " << std::scientific << std::setprecision(2) << r.lr << std::fixed << " | grad norm "
       << std::setprecision(3) << r.grad_norm << " | " << human(rates_.tokens_per_sample * window_samples_ / seconds)
       << " tok/s | " << std::setprecision(1) << avg_ms << " ms/step | "
       << human(rates_.flops_per_sample * window_samples_ / seconds) << "FLOP/s";
    if (rates_.peak_tflops > 0) os << " (MFU " << std::setprecision(1) << 100 * r.mfu << "%)";
    os << " | mem " << mib(r.mem_current) << " (peak " << mib(r.mem_peak) << ")";
    if (r.evaluated) print_evaluation(os, r);
    os << std::endl;
    window_ms_ = 0;
    window_samples_ = 0;
    window_steps_ = 0;
  }
  append(step_json(r), r.step);
  if (!tensorboard_) return;
  // Megatron-LM's training tags (its throughput: TFLOP/s per rank), and loom's own.
  Scalars values = {{"lm loss", static_cast<float>(r.loss)},
                    {"learning-rate", r.lr},
                    {"weight-decay", r.weight_decay},
                    {"batch-size", static_cast<float>(r.global_batch)},
                    {"grad-norm", static_cast<float>(r.grad_norm)},
                    {"iteration-time", static_cast<float>(r.ms / 1000)},
                    {"throughput", static_cast<float>(r.flops_per_s / 1e12 / std::max(1, rates_.world))},
                    {"tokens-per-second", static_cast<float>(r.tokens_per_s)},
                    {"mem-allocated-bytes", static_cast<float>(r.mem_current)},
                    {"mem-max-allocated-bytes", static_cast<float>(r.mem_peak)}};
  if (r.aux_loss != 0) values.emplace_back("load_balancing_loss", static_cast<float>(r.aux_loss));
  if (rates_.peak_tflops > 0) values.emplace_back("mfu", static_cast<float>(r.mfu));
  if (r.evaluated) tensorboard_evaluation(r, values);
  tensorboard_write(r.step, values);
}

void MetricsSink::write_evaluation(const StepRecord& r) {
  if (log_) {
    *log_ << "step " << std::setw(5) << r.step << "/" << steps_;
    print_evaluation(*log_, r);
    *log_ << " (the evaluation a stop signal cut short)" << std::endl;
  }
  nlohmann::ordered_json j = {{"step", r.step}};
  add_evaluation(j, r);
  append(runtime::dump_json(j), r.step);
  if (!tensorboard_) return;
  Scalars values;
  tensorboard_evaluation(r, values);
  tensorboard_write(r.step, values);
}

void MetricsSink::append(const std::string& line, int64_t step) {
  if (!out_.is_open()) return;
  out_ << line << "\n" << std::flush;
  if (!out_) {  // a failed write (a full disk, /dev/full) stops the run
    const int error = errno;
    out_.close();  // what the stream still held goes now, or never
    // A regular file is cut back to its whole lines: no torn last one.
    if (whole_bytes_ >= 0) (void)::truncate(file_.c_str(), whole_bytes_);
    throw std::runtime_error("metrics file " + file_ + ": writing step " + std::to_string(step) + " failed (" +
                             std::strerror(error) + ")");
  }
  if (whole_bytes_ >= 0) whole_bytes_ += static_cast<off_t>(line.size() + 1);
}

}  // namespace loom::train
