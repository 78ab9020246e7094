// loom eval CHECKPOINT|MANIFEST --data FILE [--task perplexity|lambada|choice|chat] [--stride N]
//   [--tokenizer DIR|MODEL] [--set key=value]... [--json] [--plugin-path DIR]...
// Evaluation the standard ways: sliding-window perplexity over a text, last-word
// accuracy on LAMBADA-style JSONL, multiple choice on HellaSwag-style JSONL
// (engine/train/eval_data.hpp), the answers of conversations (engine/train/chat_data.hpp),
// at any layout.
#include "engine/cli/args.hpp"
#include "engine/manifest/batches.hpp"
#include "engine/cli/commands.hpp"
#include "engine/cli/model_source.hpp"
#include "engine/files/read.hpp"
#include "engine/runtime/launcher.hpp"
#include "engine/text/token_files.hpp"
#include "engine/train/chat_data.hpp"
#include "engine/train/eval_data.hpp"
#include "engine/train/evaluator.hpp"
#include "engine/train/text_codec.hpp"

#include <boost/filesystem.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <iostream>
#include <optional>

namespace loom::cli {
namespace {

const char* kUsage =
    "usage: loom eval CHECKPOINT|MANIFEST|HF_DIR --data FILE [--task perplexity|lambada|choice|chat] [--format text|tokens|indexed] [options]\n"
    "  CHECKPOINT|MANIFEST|HF_DIR  the model, as loom generate takes it (a checkpoint runs at its own layout)\n"
    "  --task perplexity    FILE is text: perplexity with overlapping windows of the model's seq_length,\n"
    "                       each token predicted once, after up to seq_length - stride tokens of context\n"
    "                       (the Megatron-LM paper's WikiText-103 evaluation); the default\n"
    "  --task lambada       FILE is JSONL with a \"text\" field per line: accuracy of predicting each\n"
    "                       text's last word (all its tokens, greedy) from the words before it\n"
    "  --task choice        FILE is JSONL with HellaSwag's fields (\"ctx\", \"endings\", \"label\"): the\n"
    "                       model picks the ending (after the context and a space) of least loss, summed (accuracy)\n"
    "                       or per token (accuracy_norm, llm.c's HellaSwag number); one candidate\n"
    "                       per microbatch\n"
    "  --task chat          FILE is conversations as data.kind = \"chat\" reads them ({\"messages\": [...]}\n"
    "                       a line), written with the model's chat template: the loss per token of the\n"
    "                       assistant's turns (each conversation's end included), and the share of lines\n"
    "                       whose every such token is the model's most likely (teacher-forced)\n"
    "  --stride N           perplexity: tokens each window adds (default seq_length / 2)\n"
    "  --format F           perplexity: FILE is text (default, encoded as below), tokens (an llm.c .bin)\n"
    "                       or indexed (the PREFIX of a Megatron .bin/.idx: its documents in order)\n"
    "  --tokenizer PATH     any loom preprocess reads (GPT-2 BPE, tokenizer.json, SentencePiece); the run's\n"
    "                       data.tokenizer, a synthetic task's symbols or, for data.kind = \"text\", bytes\n"
    "  --set key=value      override the layout, micro-batch or device (parallel.tp=2, batch.micro_batch_size=8)\n"
    "  --json               one JSON object with the numbers\n";

std::string read_file(const std::string& path) {
  std::string why;
  std::optional<std::string> bytes = files::read_whole_file(path, &why, files::Pipes::Allow);
  if (!bytes) throw UsageError("--data " + path + ": cannot read the file (" + why + ")");
  return std::move(*bytes);
}

int64_t count_words(const std::string& text) {
  int64_t words = 0;
  bool in_word = false;
  for (unsigned char c : text) {
    const bool space = std::isspace(c) != 0;
    if (!space && !in_word) ++words;
    in_word = !space;
  }
  return words;
}

// The run's own layout and micro-batch (or --set's); nothing saved, sampled or
// evaluated on the way. Evaluation has no optimizer step: the global batch is one
// microbatch per dp rank and stage, whatever the micro-batch.
train::RunPlan evaluation_plan(const std::string& toml, const std::string& name, std::vector<std::string> overrides,
                               plugins::Registry& registry) {
  // The sizes as --set leaves them, else the manifest's.
  const auto size = [&](const std::string& key) { return manifest::int_as_overridden(toml, name, overrides, key); };
  const int64_t batch = size("batch.micro_batch_size") * size("parallel.dp") * size("parallel.pp");
  for (const std::string& o : {std::string("checkpoint.dir=\"\""), std::string("checkpoint.init_weights=\"\""),
                              std::string("run.eval_every=0"), std::string("run.sample_every=0")})
    overrides.push_back(o);
  for (const std::string& o : manifest::untrained_schedule_overrides()) overrides.push_back(o);
  // Sizes out of range are the plan's to name; a global batch made of them is not the user's.
  if (batch >= 1) overrides.push_back("batch.global_batch_size=" + std::to_string(batch));
  return train::make_plan(manifest::Manifest::parse(toml, name, overrides), registry);
}

}  // namespace

int cmd_eval(int argc, char** argv) {
  try {
    Args args(argc, argv, {"--json"},
              {"--data", "--task", "--stride", "--format", "--tokenizer", "--set", "--plugin-path"});
    if (args.flag("--help")) {
      std::cout << kUsage;
      return 0;
    }
    if (args.positionals().size() != 1) throw UsageError("eval takes one CHECKPOINT or MANIFEST");
    if (args.all("--data").size() > 1) throw UsageError("--data names one file");
    const std::string data_path = args.get("--data").value_or("");
    if (data_path.empty()) throw UsageError("--data FILE is required");
    const std::string task = args.get("--task").value_or("perplexity");
    if (task != "perplexity" && task != "lambada" && task != "choice" && task != "chat")
      throw UsageError("--task is perplexity, lambada, choice or chat, not " + task);
    if (task != "perplexity" && args.has("--stride")) throw UsageError("--stride is for --task perplexity");
    const std::string format = args.get("--format").value_or("text");
    if (format != "text" && format != "tokens" && format != "indexed")
      throw UsageError("--format is text, tokens or indexed, not " + format);
    if (format != "text" && task != "perplexity") throw UsageError("--format " + format + " is for --task perplexity");
    const std::string file = format == "indexed" ? data_path + ".idx" : data_path;
    if (!boost::filesystem::is_regular_file(file))
      throw UsageError("--data " + file + " is not a file" +
                       (format == "indexed" ? text::indexed_prefix_hint(data_path) : ""));
    const std::string text = format == "text" ? read_file(data_path) : std::string();

    plugins::Registry& r = plugins::registry();
    r.load_dirs(plugins::Registry::search_paths(args.all("--plugin-path")));
    // Multiple choice compares each candidate's own loss: one per microbatch.
    std::vector<std::string> sets = args.all("--set");
    if (task == "choice") {
      for (const std::string& set : sets)
        if (set.find("batch.micro_batch_size") != std::string::npos)
          throw UsageError("--task choice runs one candidate per microbatch: --set " + set + " does not apply");
      sets.push_back("batch.micro_batch_size=1");
    }
    const ModelSource src = load_model_source(args.positionals()[0], sets, r, evaluation_plan);
    // Text needs the model's codec; token files are ids already.
    std::optional<train::TextCodec> codec;
    if (format == "text" && task != "chat") codec.emplace(args.get("--tokenizer").value_or(""), src.plan.config);
    const int64_t seq = src.plan.config.model.seq_length;
    const auto encode = [&codec, &src](const std::string& s) {
      std::vector<int32_t> ids = codec->encode(s);
      for (int32_t t : ids)
        if (t < 0 || t >= src.vocab)
          throw loom::Error("the text encodes to token " + std::to_string(t) + ", outside the model's vocabulary of " +
                            std::to_string(src.vocab) + " (" + codec->describe() + ")");
      return ids;
    };

    std::unique_ptr<train::DataSource> data;
    int64_t samples = 0, words = 0;
    std::vector<train::ChoiceExample> choices;
    if (task == "perplexity") {
      const int64_t stride = args.get_int("--stride", std::max<int64_t>(1, seq / 2));
      if (stride < 1 || stride > seq)
        throw UsageError("--stride " + std::to_string(stride) + " must be in [1, seq_length = " + std::to_string(seq) + "]");
      std::vector<int32_t> tokens;
      if (format == "text") {
        tokens = encode(text);
        words = count_words(text);
      } else if (format == "tokens") {
        tokens = train::read_llmc_tokens(data_path, "--data");
      } else {
        try {
          for (const std::vector<int32_t>& doc : text::IndexedDataset::read(data_path).documents)
            tokens.insert(tokens.end(), doc.begin(), doc.end());
        } catch (const text::TokenFileError& e) {
          throw loom::Error(std::string("--data: ") + e.what());
        }
      }
      for (int32_t t : tokens)
        if (t < 0 || t >= src.vocab)
          throw loom::Error("--data " + data_path + " holds token " + std::to_string(t) +
                            ", outside the model's vocabulary of " + std::to_string(src.vocab));
      auto windows = std::make_unique<train::SlidingWindows>(std::move(tokens), seq, stride, src.vocab, data_path);
      samples = windows->windows();
      data = std::move(windows);
    } else if (task == "choice") {
      choices = train::read_choice_examples(data_path, encode, seq);
      std::vector<train::LastWordExample> candidates;
      for (const train::ChoiceExample& c : choices) candidates.insert(candidates.end(), c.endings.begin(), c.endings.end());
      auto examples = std::make_unique<train::LastWordTask>(std::move(candidates), seq, src.vocab, data_path, "an ending");
      samples = examples->size();
      data = std::move(examples);
    } else if (task == "chat") {
      manifest::RunConfig config = src.plan.config;  // the model's tokenizer and chat template
      config.data.path = data_path;
      if (const auto tokenizer = args.get("--tokenizer")) config.data.tokenizer = *tokenizer;
      if (config.data.tokenizer.empty())
        throw UsageError("--task chat writes conversations with the model's tokenizer, which it does not name "
                         "(data.tokenizer); give --tokenizer");
      data = train::chat_source(config, src.vocab, /*evaluation=*/true);
      samples = static_cast<int64_t>(dynamic_cast<const train::ChatSource&>(*data).lines_of(train::Split::Validation).size());
      if (const std::string w = data->warning(seq); !w.empty()) std::cerr << "loom eval: warning: " << w << "\n";
    } else {
      auto examples = std::make_unique<train::LastWordTask>(train::read_last_word_examples(data_path, encode), seq,
                                                            src.vocab, data_path);
      samples = examples->size();
      data = std::move(examples);
    }

    const auto t0 = std::chrono::steady_clock::now();
    const train::Evaluation e = train::evaluate(src.plan, src.weights, src.vocab, *data, samples, task == "choice");
    const train::ChoiceScores scores =
        task == "choice" ? train::score_choices(choices, e.sample_loss_sums, e.sample_tokens) : train::ChoiceScores{};
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (!std::isfinite(e.loss))
      throw loom::Error("the loss over " + data_path + " is " + std::to_string(e.loss) + ": the weights of " +
                        src.weights.source +
                        " hold non-finite values or its logits overflow, so no perplexity or accuracy can be given");
    // Perplexity per token, and per whitespace-separated word of the text (the token
    // loss scaled by tokens / words, as Megatron-LM's adjusted perplexity).
    const double ppl = std::exp(e.loss);
    const double word_ppl = words > 1 ? std::exp(e.loss * static_cast<double>(e.tokens) / static_cast<double>(words - 1)) : 0.0;

    if (args.flag("--json")) {
      nlohmann::ordered_json j;
      j["task"] = task;
      j["source"] = src.weights.source;
      j["data"] = data_path;
      j["samples"] = e.samples;
      j["tokens"] = e.tokens;
      j["loss"] = e.loss;
      if (task == "perplexity") {
        j["perplexity"] = ppl;
        j["words"] = words;
        if (words > 1) j["word_perplexity"] = word_ppl;
        else j["word_perplexity"] = nullptr;  // a text of fewer than two words has none
      } else if (task == "choice") {
        j["examples"] = scores.examples;
        j["accuracy"] = scores.accuracy;
        j["accuracy_norm"] = scores.accuracy_norm;
      } else if (task == "chat") {
        j["conversations"] = e.samples;
        j["exact_answers"] = e.exact_match;
        j["token_accuracy"] = e.token_accuracy;
        j["answer_perplexity"] = ppl;
      } else {
        j["accuracy"] = e.exact_match;
        j["target_perplexity"] = ppl;
      }
      j["ms"] = ms;
      std::cout << j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) << "\n";
      return 0;
    }
    const std::string described = task == "choice" ? data_path + ": " + std::to_string(choices.size()) +
                                                         " examples, " + std::to_string(samples) + " candidates"
                                                   : data->describe();
    std::cout << "eval: " << described << " | model " << src.weights.source << " (tp " << src.plan.sizes.tp
              << ", pp " << src.plan.sizes.pp << ", dp " << src.plan.dp << ")\n"
              << std::fixed << std::setprecision(4);
    if (task == "perplexity")
      std::cout << "perplexity: " << ppl << " over " << e.tokens << " tokens (loss " << e.loss << ") | per word: "
                << (words > 1 ? std::to_string(word_ppl) + " (" + std::to_string(words) + " words)"
                              : std::string("n/a (fewer than 2 words)"))
                << " | " << std::setprecision(1) << ms << " ms\n";
    else if (task == "choice")
      std::cout << "choice: accuracy " << std::setprecision(2) << 100 * scores.accuracy << "% (summed loss), "
                << 100 * scores.accuracy_norm << "% (loss per token) | endings' tokens: " << e.tokens << ", loss "
                << std::setprecision(4) << e.loss << " | " << std::setprecision(1) << ms << " ms\n";
    else if (task == "chat")
      std::cout << "chat: exact answers " << std::setprecision(2) << 100 * e.exact_match << "% of " << e.samples
                << " lines | answer tokens: " << e.tokens << ", loss " << std::setprecision(4) << e.loss
                << ", perplexity " << ppl << ", " << std::setprecision(2) << 100 * e.token_accuracy << "% right | "
                << std::setprecision(1) << ms << " ms\n";
    else
      std::cout << "lambada: accuracy " << std::setprecision(2) << 100 * e.exact_match << "% of " << e.samples
                << " examples | last-word tokens: loss " << std::setprecision(4) << e.loss << ", perplexity " << ppl
                << " | " << std::setprecision(1) << ms << " ms\n";
    return 0;
  } catch (const UsageError& e) {
    std::cerr << "loom eval: " << e.what() << "\n" << kUsage;
    return 2;
  } catch (const manifest::ManifestError& e) {
    std::cerr << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "loom eval: " << runtime::error_message(e) << "\n";
    return 1;
  }
}

}  // namespace loom::cli
