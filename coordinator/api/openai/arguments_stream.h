// A JSON object's text streamed compact: what tool_calls.h and harmony.h send of a call's
// arguments while the model writes them.
//
// Threading: plain values; an ArgumentsStream is used by one thread at a time.
#ifndef SHARDSERVE_COORDINATOR_API_OPENAI_ARGUMENTS_STREAM_H_
#define SHARDSERVE_COORDINATOR_API_OPENAI_ARGUMENTS_STREAM_H_

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace shardserve::openai {

// A JSON object's text read as it comes, written out compact as DumpArguments writes the parsed
// value: a string's characters as they come (each escaped as the whole is), numbers and literals
// once they end, whitespace dropped. A text that
// is not JSON stops it (kBad), at the first byte not written out.
class ArgumentsStream {
 public:
  enum class State { kMore, kDone, kBad };
  // `start`: the object's '{' in the text Advance is given.
  explicit ArgumentsStream(size_t start) : pos_(start) {}

  // Reads `text` (the text begun at the same place each time, longer) from where it stopped;
  // appends what it writes out to *out.
  State Advance(absl::string_view text, std::string* out) {
    while (state_ == State::kMore && pos_ < text.size()) {
      if (token_ == Token::kString) {
        if (!ReadString(text, out)) return state_;
        continue;
      }
      if (token_ == Token::kScalar) {
        size_t i = pos_;
        while (i < text.size() && (absl::ascii_isalnum(text[i]) || text[i] == '+' || text[i] == '-' || text[i] == '.')) ++i;
        if (i == text.size()) {
          pos_ = i;
          return state_;
        }
        Json v;
        if (!ParseJson(text.substr(token_start_, i - token_start_), &v) || v.is_structured() || v.is_string()) {
          return Bad();
        }
        out->append(Dump(v));
        token_ = Token::kNone;
        pos_ = i;
        ValueDone();
        continue;
      }
      const char c = text[pos_];
      if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
        ++pos_;
        continue;
      }
      Expect& expect = stack_.empty() ? top_ : stack_.back().expect;
      switch (expect) {
        case Expect::kValue:
        case Expect::kValueOrClose:
          if (c == '{' || c == '[') {
            if (stack_.empty() && c != '{') return Bad();
            stack_.push_back({c == '{', c == '{' ? Expect::kKeyOrClose : Expect::kValueOrClose});
            out->push_back(c);
            ++pos_;
          } else if (c == ']' && expect == Expect::kValueOrClose) {
            Close(c, out);
          } else if (c == '"') {
            StartString(/*key=*/false, out);
          } else if (c == '-' || (c >= '0' && c <= '9') || c == 't' || c == 'f' || c == 'n') {
            token_ = Token::kScalar;
            token_start_ = pos_++;
          } else {
            return Bad();
          }
          break;
        case Expect::kKey:
        case Expect::kKeyOrClose:
          if (c == '"') {
            StartString(/*key=*/true, out);
          } else if (c == '}' && expect == Expect::kKeyOrClose) {
            Close(c, out);
          } else {
            return Bad();
          }
          break;
        case Expect::kColon:
          if (c != ':') return Bad();
          out->push_back(c);
          expect = Expect::kValue;
          ++pos_;
          break;
        case Expect::kCommaOrClose:
          if (c == ',') {
            out->push_back(c);
            expect = stack_.back().object ? Expect::kKey : Expect::kValue;
            ++pos_;
          } else if (c == (stack_.back().object ? '}' : ']')) {
            Close(c, out);
          } else {
            return Bad();
          }
          break;
      }
    }
    return state_;
  }

  // Where the text not yet written out begins.
  size_t consumed() const {
    if (token_ == Token::kString && !key_) return segment_;
    return token_ == Token::kNone ? pos_ : token_start_;
  }

 private:
  enum class Expect { kValue, kValueOrClose, kKey, kKeyOrClose, kColon, kCommaOrClose };
  enum class Token { kNone, kString, kScalar };
  struct Level {
    bool object;
    Expect expect;
  };

  using Json = nlohmann::ordered_json;

  static bool ParseJson(absl::string_view text, Json* out) {
    *out = Json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
    return !out->is_discarded();
  }
  static std::string Dump(const Json& v) { return v.dump(-1, ' ', false, Json::error_handler_t::replace); }

  State Bad() { return state_ = State::kBad; }

  void StartString(bool key, std::string* out) {
    token_ = Token::kString;
    key_ = key;
    token_start_ = pos_++;
    segment_ = pos_;
    if (!key) out->push_back('"');
  }

  void Close(char c, std::string* out) {
    out->push_back(c);
    stack_.pop_back();
    ++pos_;
    ValueDone();
  }

  // A value ended: the container's next is a comma or its end (set when the value began), or the
  // object is done.
  void ValueDone() {
    if (stack_.empty()) {
      state_ = State::kDone;
    } else {
      stack_.back().expect = Expect::kCommaOrClose;
    }
  }

  // Writes out one character of a string's text (a byte, a UTF-8 sequence or an escape) as Dump
  // writes it; false when it is not valid JSON. One at a time, so that where a bad one stops the
  // string does not depend on how the text was cut.
  static bool WriteCharacter(absl::string_view raw, std::string* out) {
    const unsigned char c = raw[0];
    if (raw.size() == 1 && c >= 0x20 && c < 0x80 && c != '\\') {
      out->push_back(raw[0]);
      return true;
    }
    Json v;
    if (!ParseJson(absl::StrCat("\"", raw, "\""), &v) || !v.is_string()) return false;
    const std::string d = Dump(v);
    out->append(d, 1, d.size() - 2);
    return true;
  }

  // Reads a string on from pos_: false when it needs more text or is bad (state_ says which).
  bool ReadString(absl::string_view text, std::string* out) {
    size_t i = pos_;
    while (i < text.size()) {
      const unsigned char c = text[i];
      size_t n = 1;
      if (c == '\\') {
        n = 2;
        if (i + 1 < text.size() && text[i + 1] == 'u') {
          n = 6;
          // A high surrogate's escape is read with the low one after it.
          if (i + 6 <= text.size()) {
            const std::string hex(text.substr(i + 2, 4));
            const long u = std::strtol(hex.c_str(), nullptr, 16);
            if (u >= 0xD800 && u <= 0xDBFF) n = 12;
          }
        }
      } else if (c == '"') {
        if (key_) {
          Json v;
          if (!ParseJson(text.substr(token_start_, i + 1 - token_start_), &v) || !v.is_string()) {
            pos_ = i;
            Bad();
            return false;
          }
          out->append(Dump(v));
          stack_.back().expect = Expect::kColon;
        } else {
          out->push_back('"');
          ValueDone();
        }
        token_ = Token::kNone;
        pos_ = i + 1;
        return true;
      } else if (c >= 0xF0) {
        n = 4;
      } else if (c >= 0xE0) {
        n = 3;
      } else if (c >= 0xC0) {
        n = 2;
      }
      if (i + n > text.size()) break;
      if (!key_) {
        if (!WriteCharacter(text.substr(i, n), out)) {
          pos_ = i;
          Bad();
          return false;
        }
        segment_ = i + n;
      }
      i += n;
    }
    pos_ = i;
    return false;
  }

  std::vector<Level> stack_;
  Expect top_ = Expect::kValue;
  size_t pos_;
  State state_ = State::kMore;
  Token token_ = Token::kNone;
  bool key_ = false;
  size_t token_start_ = 0;  // the open token's first byte (a string's quote)
  size_t segment_ = 0;      // the open string's first byte not written out
};

}  // namespace shardserve::openai

#endif  // SHARDSERVE_COORDINATOR_API_OPENAI_ARGUMENTS_STREAM_H_
