#include "coordinator/tokenizer/decoder.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "coordinator/tokenizer/unicode.h"

namespace shardserve::tokenizer_internal {
namespace {

constexpr std::string_view kWhere = "tokenizer.json: decoder";

// The byte of a "<0xXX>" token (either case of hex digit, as Rust's from_str_radix), or -1.
int ByteToken(std::string_view token) {
  if (token.size() != 6 || token.substr(0, 3) != "<0x" || token[5] != '>') return -1;
  auto hex = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  const int hi = hex(token[3]), lo = hex(token[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

// `piece` with every match of `pattern` replaced by `content` (Replace). ForEachMatch fails only on
// PCRE2 resource limits, which a token-sized subject cannot hit; the text is then left as it is.
std::string ReplaceMatches(const Pattern& pattern, std::string_view content, std::string_view piece) {
  std::string text;
  size_t copied = 0;
  pattern
      .ForEachMatch(piece,
                    [&](size_t begin, size_t end) {
                      text.append(piece.substr(copied, begin - copied));
                      text.append(content);
                      copied = end;
                    })
      .IgnoreError();
  text.append(piece.substr(copied));
  return text;
}

// Metaspace: each `ch` becomes a space, or is dropped with `drop`.
std::string MetaspaceToSpaces(std::string_view piece, std::string_view ch, bool drop) {
  std::string text;
  for (size_t i = 0; i < piece.size();) {
    if (piece.substr(i, ch.size()) == ch) {
      if (!drop) text.push_back(' ');
      i += ch.size();
    } else {
      text.push_back(piece[i++]);
    }
  }
  return text;
}

// Strip of one token: up to `start` copies of `c` off its front and `stop` off its back.
std::string_view StripToken(std::string_view rest, char32_t c, size_t start, size_t stop) {
  std::string encoded;
  AppendUtf8(c, &encoded);
  for (size_t n = 0; n < start && rest.substr(0, encoded.size()) == encoded; ++n) rest.remove_prefix(encoded.size());
  for (size_t n = 0; n < stop && rest.size() >= encoded.size() && rest.substr(rest.size() - encoded.size()) == encoded;
       ++n) {
    rest.remove_suffix(encoded.size());
  }
  return rest;
}

// ByteLevel: appends the bytes `piece`'s characters stand for, or its UTF-8 as is if one of them is
// outside the alphabet.
void AppendByteLevelBytes(std::string_view piece, std::string* out) {
  const size_t before = out->size();
  for (size_t i = 0; i < piece.size();) {
    size_t len;
    const int byte = CharToByte(DecodeUtf8(piece, i, &len));
    if (byte < 0) {
      out->resize(before);
      out->append(piece);
      return;
    }
    out->push_back(static_cast<char>(byte));
    i += len;
  }
}

// Reads a one-character string field.
absl::StatusOr<char32_t> GetChar(const Json& config, std::string_view key, std::string_view where) {
  absl::StatusOr<std::string> s = GetString(config, key, where);
  if (!s.ok()) return s.status();
  size_t len = 0;
  if (s->empty() || FindInvalidUtf8(*s) != std::string_view::npos || (DecodeUtf8(*s, 0, &len), len != s->size())) {
    return Malformed(where, absl::StrCat("'", Sv(key), "' must be one character"));
  }
  return DecodeUtf8(*s, 0, &len);
}

absl::StatusOr<size_t> GetCount(const Json& config, std::string_view key, std::string_view where) {
  const Json* v = Field(config, key);
  if (v == nullptr || !v->is_number_unsigned())
    return Malformed(where, absl::StrCat("'", Sv(key), "' must be a count"));
  return v->get<size_t>();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Decoder>> Decoder::FromJson(const Json& config) {
  std::unique_ptr<Decoder> d(new Decoder());
  if (config.is_null()) {
    d->join_with_spaces_ = true;
    return d;
  }
  SHARDSERVE_RETURN_IF_ERROR(AddStages(config, &d->stages_));
  return d;
}

absl::Status Decoder::AddStages(const Json& config, std::vector<Stage>* stages) {
  absl::StatusOr<std::string> type = ComponentType(config, kWhere);
  if (!type.ok()) return type.status();
  const std::string where = absl::StrCat(Sv(kWhere), " ", *type);
  if (*type == "Sequence") {
    absl::StatusOr<const Json*> items = GetArray(config, "decoders", where);
    if (!items.ok()) return items.status();
    for (const Json& item : **items) {
      SHARDSERVE_RETURN_IF_ERROR(AddStages(item, stages));
    }
    return absl::OkStatus();
  }

  Stage stage;
  stage.fused = !stages->empty() && (stages->back().fused || stages->back().kind == Stage::Kind::kFuse ||
                                     stages->back().kind == Stage::Kind::kByteLevel);
  if (*type == "ByteLevel") {
    stage.kind = Stage::Kind::kByteLevel;
  } else if (*type == "Fuse") {
    stage.kind = Stage::Kind::kFuse;
  } else if (*type == "ByteFallback") {
    stage.kind = Stage::Kind::kByteFallback;
  } else if (*type == "Replace") {
    stage.kind = Stage::Kind::kReplace;
    std::string pattern;
    bool is_regex = false;
    SHARDSERVE_RETURN_IF_ERROR(GetPattern(config, where, &pattern, &is_regex));
    if (pattern.empty()) return Unsupported(where, "an empty pattern");
    absl::StatusOr<std::string> content = GetString(config, "content", where);
    if (!content.ok()) return content.status();
    stage.content = *std::move(content);
    if (is_regex) {
      absl::StatusOr<std::unique_ptr<Pattern>> re = Pattern::Regex(pattern);
      if (!re.ok()) return absl::Status(re.status().code(), absl::StrCat(where, ": ", re.status().message()));
      stage.pattern = *std::move(re);
    } else {
      stage.pattern = Pattern::Literal(pattern);
    }
  } else if (*type == "Strip") {
    stage.kind = Stage::Kind::kStrip;
    absl::StatusOr<char32_t> c = GetChar(config, "content", where);
    absl::StatusOr<size_t> start = GetCount(config, "start", where);
    absl::StatusOr<size_t> stop = GetCount(config, "stop", where);
    if (!c.ok()) return c.status();
    if (!start.ok()) return start.status();
    if (!stop.ok()) return stop.status();
    stage.strip_char = *c;
    stage.strip_start = *start;
    stage.strip_stop = *stop;
  } else if (*type == "Metaspace") {
    stage.kind = Stage::Kind::kMetaspace;
    absl::StatusOr<char32_t> c = GetChar(config, "replacement", where);
    if (!c.ok()) return c.status();
    AppendUtf8(*c, &stage.content);
    // prepend_scheme "always" (the default) or "first" drop the character in the first token;
    // "never", or the older add_prefix_space = false, keep it.
    stage.strip_first = true;
    if (const Json* scheme = Field(config, "prepend_scheme"); scheme != nullptr && scheme->is_string()) {
      stage.strip_first = scheme->get_ref<const std::string&>() != "never";
    }
    absl::StatusOr<bool> add_prefix_space = GetBool(config, "add_prefix_space", true, where);
    if (!add_prefix_space.ok()) return add_prefix_space.status();
    if (!*add_prefix_space) stage.strip_first = false;
  } else {
    return Unsupported(kWhere, absl::StrCat("type '", *type, "'"));
  }
  if (stage.fused &&
      !(stage.kind == Stage::Kind::kFuse || (stage.kind == Stage::Kind::kStrip && stage.strip_stop == 0))) {
    return Unsupported(where, "this step after Fuse or ByteLevel");
  }
  stages->push_back(std::move(stage));
  return absl::OkStatus();
}

void Decoder::Push(Stream* stream, std::string_view token, std::string* out) const {
  if (join_with_spaces_) {
    if (!stream->first_token_) out->push_back(' ');
    stream->first_token_ = false;
    out->append(token);
    return;
  }
  Feed(stream, 0, token, out);
}

void Decoder::Finish(Stream* stream, std::string* out) const {
  for (size_t i = 0; i < stages_.size(); ++i) Flush(stream, i, out);
}

void Decoder::Flush(Stream* stream, size_t index, std::string* out) const {
  Stream::StageState& state = stream->states_[index];
  if (state.held.empty()) return;
  std::string text;
  switch (stages_[index].kind) {
    case Stage::Kind::kByteLevel:
      AppendLossyUtf8(state.held, /*final=*/true, &text);
      state.held.clear();
      Feed(stream, index + 1, text, out);
      break;
    case Stage::Kind::kByteFallback: {
      const std::string run = std::move(state.held);
      state.held.clear();
      if (FindInvalidUtf8(run) == std::string_view::npos) {
        Feed(stream, index + 1, run, out);
      } else {
        for (size_t i = 0; i < run.size(); ++i) Feed(stream, index + 1, kReplacementChar, out);
      }
      break;
    }
    default:
      break;  // other stages hold nothing back
  }
}

std::string Decoder::TokenBytes(std::string_view token) const {
  if (join_with_spaces_) return " " + std::string(token);
  std::string piece(token);
  for (const Stage& stage : stages_) {
    switch (stage.kind) {
      case Stage::Kind::kFuse:
        break;
      case Stage::Kind::kReplace:
        piece = ReplaceMatches(*stage.pattern, stage.content, piece);
        break;
      case Stage::Kind::kByteFallback:
        if (const int byte = ByteToken(piece); byte >= 0) piece = std::string(1, static_cast<char>(byte));
        break;
      case Stage::Kind::kMetaspace:
        piece = MetaspaceToSpaces(piece, stage.content, /*drop=*/false);
        break;
      case Stage::Kind::kStrip:
        if (!stage.fused) piece = std::string(StripToken(piece, stage.strip_char, stage.strip_start, stage.strip_stop));
        break;  // a fused Strip acts on the start of the whole text only
      case Stage::Kind::kByteLevel: {
        std::string bytes;
        AppendByteLevelBytes(piece, &bytes);
        piece = std::move(bytes);
        break;
      }
    }
  }
  return piece;
}

void Decoder::Feed(Stream* stream, size_t index, std::string_view piece, std::string* out) const {
  if (index == stages_.size()) {
    out->append(piece);
    return;
  }
  const Stage& stage = stages_[index];
  Stream::StageState& state = stream->states_[index];
  std::string text;
  switch (stage.kind) {
    case Stage::Kind::kFuse:
      Feed(stream, index + 1, piece, out);
      return;

    case Stage::Kind::kReplace:
      Feed(stream, index + 1, ReplaceMatches(*stage.pattern, stage.content, piece), out);
      return;

    case Stage::Kind::kByteFallback:
      if (const int byte = ByteToken(piece); byte >= 0) {
        state.held.push_back(static_cast<char>(byte));
        return;
      }
      Flush(stream, index, out);
      Feed(stream, index + 1, piece, out);
      return;

    case Stage::Kind::kMetaspace: {
      const bool first = state.count++ == 0;
      Feed(stream, index + 1, MetaspaceToSpaces(piece, stage.content, /*drop=*/first && stage.strip_first), out);
      return;
    }

    case Stage::Kind::kStrip: {
      std::string_view rest = piece;
      std::string encoded;
      AppendUtf8(stage.strip_char, &encoded);
      if (stage.fused) {
        // Strip the start of the whole text: continue across pieces until a character stays.
        while (!state.done && !rest.empty()) {
          if (state.count < stage.strip_start && rest.substr(0, encoded.size()) == encoded) {
            rest.remove_prefix(encoded.size());
            ++state.count;
          } else {
            state.done = true;
          }
        }
      } else {
        rest = StripToken(rest, stage.strip_char, stage.strip_start, stage.strip_stop);
      }
      Feed(stream, index + 1, rest, out);
      return;
    }

    case Stage::Kind::kByteLevel: {
      // The token's characters mapped back to bytes, or its UTF-8 if one is not in the alphabet.
      AppendByteLevelBytes(piece, &state.held);
      const size_t consumed = AppendLossyUtf8(state.held, /*final=*/false, &text);
      state.held.erase(0, consumed);
      Feed(stream, index + 1, text, out);
      return;
    }
  }
}

}  // namespace shardserve::tokenizer_internal
