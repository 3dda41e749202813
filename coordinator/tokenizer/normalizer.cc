#include "coordinator/tokenizer/normalizer.h"

#include <utf8proc.h>

#include <cstdlib>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "coordinator/tokenizer/pattern.h"
#include "coordinator/tokenizer/unicode.h"

namespace shardserve::tokenizer_internal {
namespace {

bool IsAscii(std::string_view s) {
  for (char c : s) {
    if (static_cast<uint8_t>(c) >= 0x80) return false;
  }
  return true;
}

// NFC, NFD, NFKC, NFKD through utf8proc.
class UnicodeForm final : public Normalizer {
 public:
  explicit UnicodeForm(utf8proc_option_t options) : options_(options) {}

  absl::Status Normalize(std::string* text, std::string* scratch) const override {
    if (IsAscii(*text)) return absl::OkStatus();  // ASCII is invariant under all four forms
    utf8proc_uint8_t* result = nullptr;
    const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text->data()),
                                            static_cast<utf8proc_ssize_t>(text->size()), &result, options_);
    if (n < 0) {
      return absl::InternalError(absl::StrCat("utf8proc normalization failed: ", utf8proc_errmsg(n)));
    }
    scratch->assign(reinterpret_cast<const char*>(result), static_cast<size_t>(n));
    std::free(result);
    std::swap(*text, *scratch);
    return absl::OkStatus();
  }

 private:
  const utf8proc_option_t options_;
};

// Full lowercase mapping per character, as Rust's char::to_lowercase.
class Lowercase final : public Normalizer {
 public:
  absl::Status Normalize(std::string* text, std::string* scratch) const override {
    scratch->clear();
    for (size_t i = 0; i < text->size();) {
      const auto b = static_cast<uint8_t>((*text)[i]);
      if (b < 0x80) {
        scratch->push_back(static_cast<char>(b >= 'A' && b <= 'Z' ? b + 32 : b));
        ++i;
        continue;
      }
      size_t len;
      const char32_t cp = DecodeUtf8(*text, i, &len);
      i += len;
      if (cp == 0x130) {
        // U+0130 is the one character whose full lowercase mapping (SpecialCasing.txt) is two
        // code points; utf8proc only has the simple mapping.
        scratch->append("i\xCC\x87");
      } else {
        AppendUtf8(static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(cp))), scratch);
      }
    }
    std::swap(*text, *scratch);
    return absl::OkStatus();
  }
};

class Replace final : public Normalizer {
 public:
  Replace(std::unique_ptr<Pattern> pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}

  absl::Status Normalize(std::string* text, std::string* scratch) const override {
    scratch->clear();
    size_t copied = 0;
    bool matched = false;
    absl::Status status = pattern_->ForEachMatch(*text, [&](size_t begin, size_t end) {
      scratch->append(*text, copied, begin - copied);
      scratch->append(content_);
      copied = end;
      matched = true;
    });
    if (!status.ok()) return status;
    if (!matched) return absl::OkStatus();
    scratch->append(*text, copied);
    std::swap(*text, *scratch);
    return absl::OkStatus();
  }

 private:
  const std::unique_ptr<Pattern> pattern_;
  const std::string content_;
};

// Prepends a string to non-empty text.
class Prepend final : public Normalizer {
 public:
  explicit Prepend(std::string prefix) : prefix_(std::move(prefix)) {}

  absl::Status Normalize(std::string* text, std::string*) const override {
    if (!text->empty()) text->insert(0, prefix_);
    return absl::OkStatus();
  }

 private:
  const std::string prefix_;
};

// Removes leading and/or trailing Unicode whitespace.
class Strip final : public Normalizer {
 public:
  Strip(bool left, bool right) : left_(left), right_(right) {}

  absl::Status Normalize(std::string* text, std::string*) const override {
    size_t first = text->size(), end = 0;  // first non-space character, end of the last one
    for (size_t i = 0; i < text->size();) {
      size_t len;
      const char32_t cp = DecodeUtf8(*text, i, &len);
      if (!IsWhitespace(cp)) {
        if (first == text->size()) first = i;
        end = i + len;
      }
      i += len;
    }
    if (first == text->size()) {  // all whitespace
      if (left_ || right_) text->clear();
      return absl::OkStatus();
    }
    if (right_) text->erase(end);
    if (left_) text->erase(0, first);
    return absl::OkStatus();
  }

 private:
  const bool left_, right_;
};

class SequenceNormalizer final : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> steps) : steps_(std::move(steps)) {}

  absl::Status Normalize(std::string* text, std::string* scratch) const override {
    for (const auto& step : steps_) {
      SHARDSERVE_RETURN_IF_ERROR(step->Normalize(text, scratch));
    }
    return absl::OkStatus();
  }

 private:
  const std::vector<std::unique_ptr<Normalizer>> steps_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Normalizer>> Normalizer::FromJson(const Json& config) {
  constexpr std::string_view kWhere = "tokenizer.json: normalizer";
  absl::StatusOr<std::string> type = ComponentType(config, kWhere);
  if (!type.ok()) return type.status();
  const std::string where = absl::StrCat(Sv(kWhere), " ", *type);

  auto form = [](int options) { return std::make_unique<UnicodeForm>(static_cast<utf8proc_option_t>(options)); };
  if (*type == "NFC") return form(UTF8PROC_STABLE | UTF8PROC_COMPOSE);
  if (*type == "NFD") return form(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE);
  if (*type == "NFKC") return form(UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT);
  if (*type == "NFKD") return form(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT);
  if (*type == "Lowercase") return std::make_unique<Lowercase>();
  if (*type == "Replace") {
    std::string pattern;
    bool is_regex = false;
    SHARDSERVE_RETURN_IF_ERROR(GetPattern(config, where, &pattern, &is_regex));
    absl::StatusOr<std::string> content = GetString(config, "content", where);
    if (!content.ok()) return content.status();
    std::unique_ptr<Pattern> compiled;
    if (is_regex) {
      absl::StatusOr<std::unique_ptr<Pattern>> re = Pattern::Regex(pattern);
      if (!re.ok()) return absl::Status(re.status().code(), absl::StrCat(where, ": ", re.status().message()));
      compiled = *std::move(re);
    } else {
      compiled = Pattern::Literal(pattern);
    }
    return std::make_unique<Replace>(std::move(compiled), *std::move(content));
  }
  if (*type == "Prepend") {
    absl::StatusOr<std::string> prepend = GetString(config, "prepend", where);
    if (!prepend.ok()) return prepend.status();
    return std::make_unique<Prepend>(*std::move(prepend));
  }
  if (*type == "Strip") {
    absl::StatusOr<bool> left = GetBool(config, "strip_left", true, where);
    absl::StatusOr<bool> right = GetBool(config, "strip_right", true, where);
    if (!left.ok()) return left.status();
    if (!right.ok()) return right.status();
    return std::make_unique<Strip>(*left, *right);
  }
  if (*type == "Sequence") {
    absl::StatusOr<const Json*> items = GetArray(config, "normalizers", where);
    if (!items.ok()) return items.status();
    std::vector<std::unique_ptr<Normalizer>> steps;
    for (const Json& item : **items) {
      absl::StatusOr<std::unique_ptr<Normalizer>> step = FromJson(item);
      if (!step.ok()) return step.status();
      steps.push_back(*std::move(step));
    }
    return std::make_unique<SequenceNormalizer>(std::move(steps));
  }
  return Unsupported(kWhere, absl::StrCat("type '", *type, "'"));
}

}  // namespace shardserve::tokenizer_internal
