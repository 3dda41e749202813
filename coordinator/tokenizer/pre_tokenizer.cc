#include "coordinator/tokenizer/pre_tokenizer.h"

#include <algorithm>
#include <cctype>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "base/status_macros.h"

namespace shardserve::tokenizer_internal {

// ---- PieceList -------------------------------------------------------------------------------

void PieceList::Reset(std::string_view text) {
  text_.assign(text);
  pieces_.clear();
  if (!text.empty()) pieces_.push_back(Piece{0, text.size(), -1, true});
}

absl::Status PieceList::Split(absl::FunctionRef<absl::Status(const Piece&, Emit)> split_piece) {
  next_pieces_.clear();
  for (const Piece& piece : pieces_) {
    if (piece.token_id >= 0) {
      next_pieces_.push_back(piece);
      continue;
    }
    absl::Status status = split_piece(piece, [&](size_t begin, size_t end, int32_t token_id) {
      if (begin == end) return;
      next_pieces_.push_back(Piece{begin, end, token_id, piece.at_input_start && begin == piece.begin});
    });
    if (!status.ok()) return status;
  }
  std::swap(pieces_, next_pieces_);
  return absl::OkStatus();
}

absl::Status PieceList::SplitOnPattern(const Pattern& pattern, SplitBehavior behavior, bool invert) {
  return Split([&](const Piece& piece, Emit emit) -> absl::Status {
    // Cover the piece with alternating segments, matches flagged (Hugging Face's find_matches).
    segments_.clear();
    size_t last = 0;
    absl::Status status = pattern.ForEachMatch(PieceText(piece), [&](size_t begin, size_t end) {
      if (begin > last) segments_.push_back({last, begin, false});
      segments_.push_back({begin, end, true});
      last = end;
    });
    if (!status.ok()) return status;
    const size_t length = piece.end - piece.begin;
    if (last < length) segments_.push_back({last, length, false});
    if (invert) {
      for (Segment& s : segments_) s.is_match = !s.is_match;
    }

    // Apply the delimiter behaviour, in place: segments_[0, n) are the results.
    size_t n = 0;
    switch (behavior) {
      case SplitBehavior::kIsolated:
        n = segments_.size();
        break;
      case SplitBehavior::kRemoved:
        for (const Segment& s : segments_) {
          if (!s.is_match) segments_[n++] = s;
        }
        break;
      case SplitBehavior::kContiguous:
      case SplitBehavior::kMergedWithPrevious: {
        bool previous_match = false;
        for (const Segment& s : segments_) {
          // Contiguous joins runs of equal flags; MergedWithPrevious joins a delimiter to what
          // precedes it.
          const bool join =
              behavior == SplitBehavior::kContiguous ? s.is_match == previous_match : s.is_match && !previous_match;
          if (join && n > 0) {
            segments_[n - 1].end = s.end;
          } else {
            segments_[n++] = s;
          }
          previous_match = s.is_match;
        }
        break;
      }
      case SplitBehavior::kMergedWithNext: {
        // Joins a delimiter to what follows it: the mirror image of MergedWithPrevious.
        std::reverse(segments_.begin(), segments_.end());
        bool next_match = false;
        for (const Segment& s : segments_) {
          if (s.is_match && !next_match && n > 0) {
            segments_[n - 1].begin = s.begin;
          } else {
            segments_[n++] = s;
          }
          next_match = s.is_match;
        }
        std::reverse(segments_.begin(), segments_.begin() + static_cast<std::ptrdiff_t>(n));
        break;
      }
    }
    for (size_t i = 0; i < n; ++i) emit(piece.begin + segments_[i].begin, piece.begin + segments_[i].end, -1);
    return absl::OkStatus();
  });
}

absl::Status PieceList::Rewrite(absl::FunctionRef<absl::Status(const Piece&, std::string_view, std::string*)> rewrite) {
  next_text_.clear();
  next_pieces_.clear();
  for (const Piece& piece : pieces_) {
    if (piece.token_id >= 0) {
      next_pieces_.push_back(Piece{next_text_.size(), next_text_.size(), piece.token_id, piece.at_input_start});
      continue;
    }
    const size_t begin = next_text_.size();
    SHARDSERVE_RETURN_IF_ERROR(rewrite(piece, PieceText(piece), &next_text_));
    if (next_text_.size() > begin) next_pieces_.push_back(Piece{begin, next_text_.size(), -1, piece.at_input_start});
  }
  std::swap(text_, next_text_);
  std::swap(pieces_, next_pieces_);
  return absl::OkStatus();
}

// ---- Pre-tokenizers --------------------------------------------------------------------------

namespace {

constexpr std::string_view kWhere = "tokenizer.json: pre_tokenizer";

// GPT-2's pre-tokenization regex, which ByteLevel applies when use_regex is true.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class SplitPreTokenizer final : public PreTokenizer {
 public:
  SplitPreTokenizer(std::unique_ptr<Pattern> pattern, SplitBehavior behavior, bool invert)
      : pattern_(std::move(pattern)), behavior_(behavior), invert_(invert) {}

  absl::Status PreTokenize(PieceList* list) const override {
    return list->SplitOnPattern(*pattern_, behavior_, invert_);
  }

 private:
  const std::unique_ptr<Pattern> pattern_;
  const SplitBehavior behavior_;
  const bool invert_;
};

class ByteLevelPreTokenizer final : public PreTokenizer {
 public:
  // `gpt2_split` is null when use_regex is false.
  ByteLevelPreTokenizer(bool add_prefix_space, std::unique_ptr<Pattern> gpt2_split)
      : add_prefix_space_(add_prefix_space), gpt2_split_(std::move(gpt2_split)) {}

  absl::Status PreTokenize(PieceList* list) const override {
    if (add_prefix_space_) {
      absl::Status s = list->Rewrite([](const Piece&, std::string_view text, std::string* out) {
        if (text.front() != ' ') out->push_back(' ');
        out->append(text);
        return absl::OkStatus();
      });
      if (!s.ok()) return s;
    }
    if (gpt2_split_ == nullptr) return absl::OkStatus();
    return list->SplitOnPattern(*gpt2_split_, SplitBehavior::kIsolated, false);
  }

  bool byte_level() const override { return true; }

 private:
  const bool add_prefix_space_;
  const std::unique_ptr<Pattern> gpt2_split_;
};

class MetaspacePreTokenizer final : public PreTokenizer {
 public:
  enum class Prepend { kAlways, kFirst, kNever };

  MetaspacePreTokenizer(std::string replacement, Prepend prepend, bool split)
      : replacement_(std::move(replacement)),
        prepend_(prepend),
        split_(split ? Pattern::Literal(replacement_) : nullptr) {}

  absl::Status PreTokenize(PieceList* list) const override {
    absl::Status s = list->Rewrite([&](const Piece& piece, std::string_view text, std::string* out) {
      // Prepend the replacement unless the text already starts with it (after replacing
      // spaces); "first" only for the piece at the very start of the input.
      const bool starts_with_space = text.front() == ' ' || text.substr(0, replacement_.size()) == replacement_;
      if (!starts_with_space &&
          (prepend_ == Prepend::kAlways || (prepend_ == Prepend::kFirst && piece.at_input_start))) {
        out->append(replacement_);
      }
      for (char c : text) {
        if (c == ' ') {
          out->append(replacement_);
        } else {
          out->push_back(c);
        }
      }
      return absl::OkStatus();
    });
    if (!s.ok() || split_ == nullptr) return s;
    return list->SplitOnPattern(*split_, SplitBehavior::kMergedWithNext, false);
  }

 private:
  const std::string replacement_;
  const Prepend prepend_;
  const std::unique_ptr<Pattern> split_;  // null when split is false
};

class SequencePreTokenizer final : public PreTokenizer {
 public:
  explicit SequencePreTokenizer(std::vector<std::unique_ptr<PreTokenizer>> steps) : steps_(std::move(steps)) {}

  absl::Status PreTokenize(PieceList* list) const override {
    for (const auto& step : steps_) {
      SHARDSERVE_RETURN_IF_ERROR(step->PreTokenize(list));
    }
    return absl::OkStatus();
  }

  bool byte_level() const override { return !steps_.empty() && steps_.back()->byte_level(); }

 private:
  const std::vector<std::unique_ptr<PreTokenizer>> steps_;
};

absl::StatusOr<SplitBehavior> ParseBehavior(const Json& config, std::string_view where) {
  absl::StatusOr<std::string> name = GetString(config, "behavior", where);
  if (!name.ok()) return name.status();
  // Serialized as the enum name ("Isolated") or in snake case ("isolated").
  const std::string lower = absl::StrReplaceAll(*name, {{"_", ""}});
  auto is = [&](std::string_view want) {
    return std::equal(lower.begin(), lower.end(), want.begin(), want.end(),
                      [](char a, char b) { return std::tolower(static_cast<unsigned char>(a)) == b; });
  };
  if (is("removed")) return SplitBehavior::kRemoved;
  if (is("isolated")) return SplitBehavior::kIsolated;
  if (is("mergedwithprevious")) return SplitBehavior::kMergedWithPrevious;
  if (is("mergedwithnext")) return SplitBehavior::kMergedWithNext;
  if (is("contiguous")) return SplitBehavior::kContiguous;
  return Malformed(where, absl::StrCat("unknown behavior '", *name, "'"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<PreTokenizer>> PreTokenizer::FromJson(const Json& config) {
  absl::StatusOr<std::string> type = ComponentType(config, kWhere);
  if (!type.ok()) return type.status();
  const std::string where = absl::StrCat(Sv(kWhere), " ", *type);

  if (*type == "Split") {
    std::string pattern;
    bool is_regex = false;
    SHARDSERVE_RETURN_IF_ERROR(GetPattern(config, where, &pattern, &is_regex));
    absl::StatusOr<SplitBehavior> behavior = ParseBehavior(config, where);
    if (!behavior.ok()) return behavior.status();
    absl::StatusOr<bool> invert = GetBool(config, "invert", false, where);
    if (!invert.ok()) return invert.status();
    std::unique_ptr<Pattern> compiled;
    if (is_regex) {
      absl::StatusOr<std::unique_ptr<Pattern>> re = Pattern::Regex(pattern);
      if (!re.ok()) return absl::Status(re.status().code(), absl::StrCat(where, ": ", re.status().message()));
      compiled = *std::move(re);
    } else {
      compiled = Pattern::Literal(pattern);
    }
    return std::make_unique<SplitPreTokenizer>(std::move(compiled), *behavior, *invert);
  }
  if (*type == "ByteLevel") {
    absl::StatusOr<bool> add_prefix_space = GetBool(config, "add_prefix_space", true, where);
    absl::StatusOr<bool> use_regex = GetBool(config, "use_regex", true, where);
    if (!add_prefix_space.ok()) return add_prefix_space.status();
    if (!use_regex.ok()) return use_regex.status();
    std::unique_ptr<Pattern> split;
    if (*use_regex) {
      absl::StatusOr<std::unique_ptr<Pattern>> re = Pattern::Regex(kGpt2Pattern);
      if (!re.ok()) return re.status();
      split = *std::move(re);
    }
    return std::make_unique<ByteLevelPreTokenizer>(*add_prefix_space, std::move(split));
  }
  if (*type == "Metaspace") {
    absl::StatusOr<std::string> replacement = GetString(config, "replacement", where);
    if (!replacement.ok()) return replacement.status();
    if (replacement->empty()) return Malformed(where, "'replacement' must be one character");
    absl::StatusOr<bool> split = GetBool(config, "split", true, where);
    if (!split.ok()) return split.status();
    // Older files have add_prefix_space instead of prepend_scheme; false means "never".
    MetaspacePreTokenizer::Prepend prepend = MetaspacePreTokenizer::Prepend::kAlways;
    if (const Json* scheme = Field(config, "prepend_scheme"); scheme != nullptr && !scheme->is_null()) {
      if (!scheme->is_string()) return Malformed(where, "'prepend_scheme' must be a string");
      const std::string& s = scheme->get_ref<const std::string&>();
      if (s == "first") {
        prepend = MetaspacePreTokenizer::Prepend::kFirst;
      } else if (s == "never") {
        prepend = MetaspacePreTokenizer::Prepend::kNever;
      } else if (s != "always") {
        return Malformed(where, absl::StrCat("unknown prepend_scheme '", s, "'"));
      }
    }
    absl::StatusOr<bool> add_prefix_space = GetBool(config, "add_prefix_space", true, where);
    if (!add_prefix_space.ok()) return add_prefix_space.status();
    if (!*add_prefix_space) prepend = MetaspacePreTokenizer::Prepend::kNever;
    return std::make_unique<MetaspacePreTokenizer>(*std::move(replacement), prepend, *split);
  }
  if (*type == "Sequence") {
    absl::StatusOr<const Json*> items = GetArray(config, "pretokenizers", where);
    if (!items.ok()) return items.status();
    std::vector<std::unique_ptr<PreTokenizer>> steps;
    for (const Json& item : **items) {
      if (!steps.empty() && steps.back()->byte_level()) {
        return Unsupported(where, "a pre-tokenizer after ByteLevel");
      }
      absl::StatusOr<std::unique_ptr<PreTokenizer>> step = FromJson(item);
      if (!step.ok()) return step.status();
      steps.push_back(*std::move(step));
    }
    return std::make_unique<SequencePreTokenizer>(std::move(steps));
  }
  return Unsupported(kWhere, absl::StrCat("type '", *type, "'"));
}

}  // namespace shardserve::tokenizer_internal
