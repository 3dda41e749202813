// bench_tokenizer: encoding speed of coordinator/tokenizer on one thread.
//
//   bench_tokenizer --model DIR --text FILE [--chunk-bytes N] [--repeat R]
//
// Cuts FILE into chunks of about N bytes (default 4096, each ending at a newline, like prompts),
// encodes every chunk once to warm up, then R times (default 5) more, and prints one JSON line:
// bytes, tokens, the median seconds of one pass over all chunks, tokens/s, MB/s (10^6 bytes) and
// an FNV-1a checksum of all ids. tools/bench/bench_tokenizer_hf.py cuts the text the same way, so equal
// checksums mean both produced the same ids.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "coordinator/tokenizer/tokenizer.h"
#include "tools/cli/bench_stats.h"
#include "base/flags.h"

namespace {

constexpr char kUsage[] = "usage: bench_tokenizer --model DIR --text FILE [--chunk-bytes N] [--repeat R]\n";

// Chunks of at least `size` bytes that end at a newline (or at the end of the text).
std::vector<std::string> Chunks(const std::string& text, size_t size) {
  std::vector<std::string> chunks;
  for (size_t begin = 0; begin < text.size();) {
    size_t end = text.find('\n', std::min(begin + size, text.size()) - 1);
    end = end == std::string::npos ? text.size() : end + 1;
    chunks.push_back(text.substr(begin, end - begin));
    begin = end;
  }
  return chunks;
}

int Fail(const std::string& message) {
  std::fprintf(stderr, "bench_tokenizer: %s\n", message.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  using shardserve::Tokenizer;
  absl::StatusOr<shardserve::Flags> flags = shardserve::Flags::Parse(
      std::vector<std::string>(argv + 1, argv + argc), {"model", "text", "chunk-bytes", "repeat"});
  if (!flags.ok() || !flags->Has("model") || !flags->Has("text")) {
    std::fprintf(stderr, "%s", kUsage);
    return 2;
  }
  absl::StatusOr<int64_t> chunk_bytes = flags->GetInt("chunk-bytes", 4096);
  absl::StatusOr<int64_t> repeat = flags->GetInt("repeat", 5);
  if (!chunk_bytes.ok() || *chunk_bytes < 1 || !repeat.ok() || *repeat < 1) {
    return Fail("--chunk-bytes and --repeat must be positive integers");
  }

  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::FromDirectory(flags->Get("model"));
  if (!tokenizer.ok()) return Fail(tokenizer.status().ToString());
  std::ifstream in(flags->Get("text"), std::ios::binary);
  if (!in) return Fail("cannot open " + flags->Get("text"));
  std::ostringstream contents;
  contents << in.rdbuf();
  const std::string text = contents.str();
  const std::vector<std::string> chunks = Chunks(text, static_cast<size_t>(*chunk_bytes));

  // One pass over all chunks; returns the number of tokens and updates the checksum.
  uint64_t checksum = 14695981039346656037ull;
  auto pass = [&](bool hash) -> absl::StatusOr<size_t> {
    size_t tokens = 0;
    for (const std::string& chunk : chunks) {
      absl::StatusOr<std::vector<int32_t>> ids = (*tokenizer)->Encode(chunk);
      if (!ids.ok()) return ids.status();
      tokens += ids->size();
      if (!hash) continue;
      for (int32_t id : *ids) checksum = (checksum ^ static_cast<uint32_t>(id)) * 1099511628211ull;
    }
    return tokens;
  };
  absl::StatusOr<size_t> tokens = pass(/*hash=*/true);  // warm-up, and the checksum
  if (!tokens.ok()) return Fail(tokens.status().ToString());

  std::vector<double> seconds;
  for (int64_t r = 0; r < *repeat; ++r) {
    const auto start = std::chrono::steady_clock::now();
    if (absl::StatusOr<size_t> n = pass(/*hash=*/false); !n.ok()) return Fail(n.status().ToString());
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  const double median = shardserve::cli::Percentile(seconds, 50);  // as bench_tokenizer_hf.py's statistics.median
  std::printf(
      "{\"impl\": \"shardserve\", \"bytes\": %zu, \"chunks\": %zu, \"tokens\": %zu, \"median_s\": %.6f, "
      "\"tokens_per_s\": %.0f, \"mb_per_s\": %.3f, \"checksum\": \"%016llx\"}\n",
      text.size(), chunks.size(), *tokens, median, static_cast<double>(*tokens) / median, text.size() / median / 1e6,
      static_cast<unsigned long long>(checksum));
  return 0;
}
