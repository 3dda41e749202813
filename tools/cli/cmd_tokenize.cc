// shardserve tokenize / detokenize: a checkpoint's tokenizer (coordinator/tokenizer) from the
// command line, to look at what the server will feed the model and read back what it produced.
#include <cstdio>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"
#include "tools/cli/command.h"
#include "base/flags.h"

namespace shardserve::cli {
namespace {

constexpr char kTokenizeUsage[] =
    "usage: shardserve tokenize --model DIR [--no-special] [--json] [TEXT ...]\n"
    "  Encodes TEXT (the arguments joined by spaces, or all of standard input when there are none)\n"
    "  with the tokenizer.json of checkpoint DIR and prints the token ids, space-separated.\n"
    "  --no-special  do not add the special tokens (BOS) the tokenizer's post-processor adds\n"
    "  --json        print {\"ids\": [...], \"tokens\": [...]} instead\n";

constexpr char kDetokenizeUsage[] =
    "usage: shardserve detokenize --model DIR [--skip-special] [--json] [ID ...]\n"
    "  Decodes token ids (arguments or standard input, separated by spaces, commas or newlines) with\n"
    "  the tokenizer.json of checkpoint DIR and prints the text followed by a newline.\n"
    "  --skip-special  leave special tokens (BOS, EOS ...) out of the text\n"
    "  --json          print {\"text\": ...} instead\n";

std::string ReadStdin() {
  return std::string(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
}

// Parses the common flags and loads the tokenizer; on failure prints why and sets *exit_code.
std::unique_ptr<Tokenizer> Setup(const char* name, const char* usage, const std::vector<std::string>& args,
                                 const std::string& special_switch, Flags* flags, int* exit_code) {
  absl::StatusOr<Flags> parsed = Flags::Parse(args, {"model"}, {"help", "json", special_switch});
  if (!parsed.ok()) {
    std::fprintf(stderr, "shardserve %s: %s\n%s", name, std::string(parsed.status().message()).c_str(), usage);
    *exit_code = 2;
    return nullptr;
  }
  *flags = *std::move(parsed);
  if (flags->Has("help")) {
    std::printf("%s", usage);
    *exit_code = 0;
    return nullptr;
  }
  if (!flags->Has("model")) {
    std::fprintf(stderr, "shardserve %s: --model is required\n%s", name, usage);
    *exit_code = 2;
    return nullptr;
  }
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::FromDirectory(flags->Get("model"));
  if (!tokenizer.ok()) {
    std::fprintf(stderr, "shardserve %s: %s\n", name, tokenizer.status().ToString().c_str());
    *exit_code = 1;
    return nullptr;
  }
  return *std::move(tokenizer);
}

int RunTokenize(const std::vector<std::string>& args) {
  Flags flags;
  int exit_code = 0;
  std::unique_ptr<Tokenizer> tokenizer = Setup("tokenize", kTokenizeUsage, args, "no-special", &flags, &exit_code);
  if (tokenizer == nullptr) return exit_code;

  const std::string text = flags.positional().empty() ? ReadStdin() : absl::StrJoin(flags.positional(), " ");
  absl::StatusOr<std::vector<int32_t>> ids = tokenizer->Encode(text, /*add_special_tokens=*/!flags.Has("no-special"));
  if (!ids.ok()) {
    std::fprintf(stderr, "shardserve tokenize: %s\n", ids.status().ToString().c_str());
    return 1;
  }
  if (flags.Has("json")) {
    nlohmann::json out = {{"ids", *ids}, {"tokens", nlohmann::json::array()}};
    for (int32_t id : *ids) out["tokens"].push_back(std::string(*tokenizer->IdToToken(id)));
    std::printf("%s\n", out.dump().c_str());
  } else {
    std::printf("%s\n", absl::StrJoin(*ids, " ").c_str());
  }
  return 0;
}

int RunDetokenize(const std::vector<std::string>& args) {
  Flags flags;
  int exit_code = 0;
  std::unique_ptr<Tokenizer> tokenizer =
      Setup("detokenize", kDetokenizeUsage, args, "skip-special", &flags, &exit_code);
  if (tokenizer == nullptr) return exit_code;

  const std::string input = flags.positional().empty() ? ReadStdin() : absl::StrJoin(flags.positional(), " ");
  std::vector<int32_t> ids;
  for (absl::string_view piece : absl::StrSplit(input, absl::ByAnyChar(" ,\t\r\n"), absl::SkipEmpty())) {
    int32_t id;
    if (!absl::SimpleAtoi(piece, &id) || !tokenizer->IdToToken(id).has_value()) {
      std::fprintf(stderr, "shardserve detokenize: '%s' is not a token id of this tokenizer (vocabulary size %d)\n",
                   std::string(piece).c_str(), tokenizer->vocab_size());
      return 2;
    }
    ids.push_back(id);
  }
  const std::string text = tokenizer->Decode(ids, /*skip_special_tokens=*/flags.Has("skip-special"));
  if (flags.Has("json")) {
    std::printf("%s\n", nlohmann::json({{"text", text}}).dump().c_str());
  } else {
    std::fwrite(text.data(), 1, text.size(), stdout);  // the text may hold NUL characters
    std::printf("\n");
  }
  return 0;
}

const CommandRegistration kTokenize({"tokenize", "encode text into token ids with a checkpoint's tokenizer",
                                     RunTokenize});
const CommandRegistration kDetokenize({"detokenize", "decode token ids into text with a checkpoint's tokenizer",
                                       RunDetokenize});

}  // namespace
}  // namespace shardserve::cli
