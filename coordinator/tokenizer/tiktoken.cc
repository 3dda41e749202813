#include "coordinator/tokenizer/tiktoken.h"

#include <charconv>
#include <optional>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/status_macros.h"
#include "coordinator/tokenizer/pattern.h"
#include "coordinator/tokenizer/unicode.h"

namespace shardserve::tokenizer_internal {
namespace {

constexpr std::string_view kRanksFile = "tiktoken.model";
constexpr std::string_view kConfigFile = "tokenizer_config.json";
// Ranks at or above this are refused, so that id-indexed tables stay small (as tokenizer.json's).
constexpr int64_t kMaxRanks = int64_t{1} << 24;

// Kimi's TikTokenTokenizer (tokenization_kimi.py): its pre-tokenizer regex, alternative by
// alternative as its pat_str joins them, in Rust's regex dialect (pattern.h translates [A&&[^B]]).
constexpr std::string_view kKimiClass = "tokenization_kimi.TikTokenTokenizer";
constexpr std::string_view kKimiPatternParts[] = {
    R"([\p{Han}]+)",
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?)",
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?)",
    R"(\p{N}{1,3})",
    R"( ?[^\s\p{L}\p{N}]+[\r\n]*)",
    R"(\s*[\r\n]+)",
    R"(\s+(?!\S))",
    R"(\s+)",
};
// num_reserved_special_tokens + 2: the ids after the ranks that are special tokens.
constexpr int32_t kKimiSpecialIds = 258;
// The special tokens transformers skips when the config lists no additional_special_tokens (the
// class's defaults).
constexpr std::string_view kKimiAdditionalSpecial[] = {"<|im_end|>",          "<|im_user|>",     "<|im_assistant|>",
                                                       "<|start_header_id|>", "<|end_header_id|>", "[EOT]",
                                                       "<|im_system|>",       "<|im_middle|>"};
// TikTokenTokenizer.encode's cuts: chunks of 400,000 characters, then runs of at most 25,000.
constexpr size_t kKimiChunkChars = 400'000;
constexpr size_t kKimiMaxRun = 25'000;

// Python's str.isspace: bidirectional class WS, B or S, or general category Zs.
bool PythonIsSpace(char32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

class KimiPreTokenizerImpl final : public PreTokenizer {
 public:
  explicit KimiPreTokenizerImpl(std::unique_ptr<Pattern> pattern) : pattern_(std::move(pattern)) {}

  absl::Status PreTokenize(PieceList* list) const override {
    SHARDSERVE_RETURN_IF_ERROR(list->Split([&](const Piece& piece, PieceList::Emit emit) {
      CutLongText(list->text(), piece.begin, piece.end, emit);
      return absl::OkStatus();
    }));
    // tiktoken encodes only the regex's matches; this one matches every character, so splitting
    // around the matches (Isolated) leaves no other text.
    return list->SplitOnPattern(*pattern_, SplitBehavior::kIsolated, /*invert=*/false);
  }
  bool byte_level() const override { return true; }

 private:
  // TikTokenTokenizer._split_whitespaces_or_nonwhitespaces on each 400,000-character chunk.
  static void CutLongText(std::string_view text, size_t begin, size_t end, PieceList::Emit emit) {
    size_t start = begin, chars_in_chunk = 0, run = 0;
    bool run_is_space = false;
    for (size_t i = begin; i < end;) {
      size_t len;
      const bool space = PythonIsSpace(DecodeUtf8(text, i, &len));
      if (chars_in_chunk == kKimiChunkChars) {  // a new chunk: the last one ends here
        emit(start, i, -1);
        start = i;
        chars_in_chunk = 0;
      }
      if (chars_in_chunk == 0) {
        run = 0;
        run_is_space = space;
      }
      if (space != run_is_space) {
        run = 1;
        run_is_space = space;
      } else if (++run > kKimiMaxRun) {
        emit(start, i, -1);
        start = i;
        run = 1;
      }
      ++chars_in_chunk;
      i += len;
    }
    emit(start, end, -1);
  }

  std::unique_ptr<Pattern> pattern_;
};

// The class auto_map's AutoTokenizer names ("tokenization_kimi.TikTokenTokenizer"), or empty.
std::string AutoTokenizerClass(const Json& tokenizer_config) {
  const Json* auto_map = Field(tokenizer_config, "auto_map");
  const Json* auto_tokenizer = auto_map == nullptr ? nullptr : Field(*auto_map, "AutoTokenizer");
  if (auto_tokenizer == nullptr || !auto_tokenizer->is_array() || auto_tokenizer->empty() ||
      !(*auto_tokenizer)[0].is_string()) {
    return "";
  }
  return (*auto_tokenizer)[0].get<std::string>();
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ParseTiktokenRanks(std::string_view file) {
  std::vector<std::string> tokens;
  std::vector<bool> seen;
  int64_t line_number = 0;
  for (absl::string_view line : absl::StrSplit(Sv(file), absl::ByAnyChar("\r\n"), absl::SkipEmpty())) {
    ++line_number;
    const std::vector<absl::string_view> fields = absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    auto bad = [&](std::string_view what) {
      return Malformed(kRanksFile, absl::StrCat("line ", line_number, ": ", Sv(what)));
    };
    if (fields.size() != 2) return bad("must be a base64 token, a space and its rank");
    int64_t rank = -1;
    const auto [end, ec] = std::from_chars(fields[1].data(), fields[1].data() + fields[1].size(), rank);
    if (ec != std::errc() || end != fields[1].data() + fields[1].size() || rank < 0 || rank >= kMaxRanks) {
      return bad(absl::StrCat("the rank '", fields[1], "' must be an integer in [0, ", kMaxRanks, ")"));
    }
    std::string token;
    if (!absl::Base64Unescape(fields[0], &token) || token.empty()) {
      return bad(absl::StrCat("'", fields[0], "' is not a base64 token"));
    }
    if (rank >= static_cast<int64_t>(tokens.size())) {
      tokens.resize(rank + 1);
      seen.resize(rank + 1, false);
    }
    if (seen[rank]) return bad(absl::StrCat("rank ", rank, " is given twice"));
    seen[rank] = true;
    tokens[rank] = std::move(token);
  }
  if (tokens.empty()) return Malformed(kRanksFile, "holds no ranks");
  for (size_t r = 0; r < seen.size(); ++r) {
    if (!seen[r]) return Malformed(kRanksFile, absl::StrCat("rank ", r, " is missing; ranks must run from 0 to N-1"));
  }
  return tokens;
}

std::string TiktokenClassFile(const Json& tokenizer_config) {
  const std::string name = AutoTokenizerClass(tokenizer_config);
  const size_t dot = name.rfind('.');
  if (dot == std::string::npos || dot == 0) return "";
  const std::string module = name.substr(0, dot);
  if (module.find_first_of("/\\.") != std::string::npos) return "";  // a module name, never a path
  return module + ".py";
}

absl::StatusOr<std::unique_ptr<PreTokenizer>> KimiPreTokenizer() {
  std::string pattern;
  for (std::string_view part : kKimiPatternParts) absl::StrAppend(&pattern, pattern.empty() ? "" : "|", Sv(part));
  absl::StatusOr<std::unique_ptr<Pattern>> compiled = Pattern::Regex(pattern);
  if (!compiled.ok()) return compiled.status();
  return std::unique_ptr<PreTokenizer>(new KimiPreTokenizerImpl(*std::move(compiled)));
}

absl::StatusOr<TiktokenClass> ReadTiktokenClass(const Json& tokenizer_config, int32_t num_ranks,
                                                std::string_view class_source) {
  if (!tokenizer_config.is_object()) {
    return Malformed(kRanksFile, "needs tokenizer_config.json beside it, naming the tokenizer class");
  }
  const std::string named = AutoTokenizerClass(tokenizer_config);
  if (named != kKimiClass) {
    const Json* cls = Field(tokenizer_config, "tokenizer_class");
    return absl::UnimplementedError(absl::StrCat(
        "tiktoken.model with the tokenizer class ", named.empty() ? "(auto_map names none)" : "'" + named + "'",
        cls != nullptr && cls->is_string() ? absl::StrCat(" (tokenizer_class '", cls->get<std::string>(), "')") : "",
        " is not supported; supported: ", Sv(kKimiClass), " (Kimi K2)"));
  }
  for (std::string_view part : kKimiPatternParts) {
    if (!class_source.empty() && class_source.find(part) == std::string_view::npos) {
      return absl::UnimplementedError(absl::StrCat("tokenization_kimi.py's pat_str has no alternative '", Sv(part),
                                                   "': its regex is not the one shardserve implements for ",
                                                   Sv(kKimiClass)));
    }
  }

  TiktokenClass out;
  absl::StatusOr<std::unique_ptr<PreTokenizer>> pre_tokenizer = KimiPreTokenizer();
  if (!pre_tokenizer.ok()) return pre_tokenizer.status();
  out.pre_tokenizer = *std::move(pre_tokenizer);

  // The special ids: [num_ranks, num_ranks + 258), named by added_tokens_decoder.
  absl::flat_hash_map<int32_t, AddedToken> listed;
  if (const Json* decoder = Field(tokenizer_config, "added_tokens_decoder"); decoder != nullptr && !decoder->is_null()) {
    if (!decoder->is_object()) return Malformed(kConfigFile, "'added_tokens_decoder' must be an object");
    for (auto it = decoder->begin(); it != decoder->end(); ++it) {
      int64_t id = -1;
      const std::string& key = it.key();
      const auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), id);
      const std::string where = absl::StrCat(Sv(kConfigFile), ": added_tokens_decoder '", key, "'");
      if (ec != std::errc() || end != key.data() + key.size() || id < num_ranks || id >= num_ranks + kKimiSpecialIds) {
        return Malformed(where, absl::StrCat("must be an id in [", num_ranks, ", ", num_ranks + kKimiSpecialIds,
                                             "), the special ids after tiktoken.model's ", num_ranks, " ranks"));
      }
      AddedToken t;
      t.id = static_cast<int32_t>(id);
      SHARDSERVE_RETURN_IF_ERROR(ReadAddedToken(it.value(), where, &t));
      if (t.content.empty()) return Malformed(where, "'content' is empty");
      listed.emplace(t.id, std::move(t));
    }
  }
  // What transformers skips with skip_special_tokens: bos, eos, unk, pad and the additional ones.
  absl::flat_hash_set<std::string> skipped;
  for (const char* key : {"bos_token", "eos_token", "unk_token", "pad_token"}) {
    absl::StatusOr<std::optional<std::string>> name = ConfigToken(Field(tokenizer_config, key), key);
    if (!name.ok()) return name.status();
    if (name->has_value()) skipped.insert(**std::move(name));
  }
  if (const Json* extra = Field(tokenizer_config, "additional_special_tokens"); extra != nullptr && !extra->is_null()) {
    if (!extra->is_array()) return Malformed(kConfigFile, "'additional_special_tokens' must be an array");
    for (const Json& item : *extra) {
      absl::StatusOr<std::optional<std::string>> name = ConfigToken(&item, "additional_special_tokens");
      if (!name.ok()) return name.status();
      if (name->has_value()) skipped.insert(**std::move(name));
    }
  } else {
    for (std::string_view name : kKimiAdditionalSpecial) skipped.emplace(name);
  }
  for (int32_t id = num_ranks; id < num_ranks + kKimiSpecialIds; ++id) {
    AddedToken t;
    if (auto it = listed.find(id); it != listed.end()) {
      t = std::move(it->second);
    } else {
      t.id = id;
      t.content = absl::StrCat("<|reserved_token_", id, "|>");
    }
    t.special = skipped.contains(t.content);
    out.special_tokens.push_back(std::move(t));
  }
  return out;
}

}  // namespace shardserve::tokenizer_internal
