#include "engine/cli/reply_text.hpp"

#include <algorithm>

namespace loom::cli {

namespace {

const std::string kReplacement = "\xEF\xBF\xBD";  // U+FFFD

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace

ReplyText::ReplyText(const train::TextCodec& codec, std::vector<int32_t> context, std::vector<std::string> stops)
    : codec_(codec), ids_(std::move(context)), context_size_(ids_.size()), stops_(std::move(stops)) {
  context_text_ = ids_.empty() ? std::string() : codec_.decode(ids_);
}

// The reply's text: the whole decoded less the context's, or, when decoding with the
// reply changed the context's text, the reply's tokens decoded alone.
std::string ReplyText::reply_so_far() const {
  const std::string whole = codec_.decode(ids_);
  if (whole.compare(0, context_text_.size(), context_text_) == 0) return whole.substr(context_text_.size());
  return codec_.decode(std::vector<int32_t>(ids_.begin() + static_cast<std::ptrdiff_t>(context_size_), ids_.end()));
}

std::string ReplyText::give_up_to(size_t end) {
  const std::string reply = reply_so_far();
  end = std::min(end, reply.size());
  // Text given is never taken back: when decoding rewrote it, only what follows it is new.
  if (end <= given_.size() || reply.compare(0, given_.size(), given_) != 0) return {};
  std::string fresh = reply.substr(given_.size(), end - given_.size());
  given_ += fresh;
  return fresh;
}

std::string ReplyText::add(int32_t token) {
  if (stopped_) return {};
  ids_.push_back(token);
  const std::string reply = reply_so_far();
  // Text given held no stop and no start of one, so a stop string begins after it.
  size_t first_stop = std::string::npos;
  for (const std::string& s : stops_) first_stop = std::min(first_stop, reply.find(s, given_.size()));
  if (first_stop != std::string::npos) {
    stopped_ = true;
    return give_up_to(first_stop);
  }
  if (ends_with(reply, kReplacement)) return {};  // a character's first bytes: wait for the rest
  // Hold back the longest tail that a stop string starts with.
  size_t hold = 0;
  for (const std::string& s : stops_)
    for (size_t n = std::min(s.size() - 1, reply.size()); n > hold; --n)
      if (reply.compare(reply.size() - n, n, s, 0, n) == 0) {
        hold = n;
        break;
      }
  return give_up_to(reply.size() - hold);
}

std::string ReplyText::finish() {
  if (stopped_) return {};
  return give_up_to(std::string::npos);
}

}  // namespace loom::cli
