// shardserve bench's structured outputs (--json-schema, --compare's /json layouts): reading the
// schema file, and checking that a constrained request's output is the start of a JSON text.
#include <cctype>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"
#include "tools/cli/bench.h"

namespace shardserve::cli::bench {
namespace {

// The server's bound on a constraint's text (docs/structured-outputs.md, "Bounds and errors").
constexpr size_t kMaxSchemaBytes = 64 * 1024;

// A JSON text read byte by byte (RFC 8259), far enough to say whether some JSON text starts with
// the bytes read so far: the containers open, and where the reader is in the current token.
class JsonPrefixReader {
 public:
  // False, with why(), at the first byte no JSON text has there.
  bool Read(unsigned char b) {
    ++offset_;
    switch (state_) {
      case State::kString:
        if (b == '"') return EndValue();
        if (b == '\\') state_ = State::kEscape;
        return b >= 0x20 || Fail("a control character in a string");
      case State::kEscape:
        if (b == 'u') {
          state_ = State::kUnicode;
          hex_left_ = 4;
          return true;
        }
        state_ = State::kString;
        return absl::string_view("\"\\/bfnrt").find(static_cast<char>(b)) != absl::string_view::npos ||
               Fail("an unknown escape");
      case State::kUnicode:
        if (--hex_left_ == 0) state_ = State::kString;
        return std::isxdigit(b) || Fail("a \\u escape without 4 hex digits");
      case State::kLiteral:
        if (b != static_cast<unsigned char>(*literal_left_)) return Fail("a misspelt true, false or null");
        if (*++literal_left_ == '\0') return EndValue();
        return true;
      case State::kNumber:
        return ReadNumber(b);
      default:
        return ReadBetweenTokens(b);
    }
  }
  const std::string& why() const { return why_; }

 private:
  enum class State {
    kValue,        // a value must come (after ':' or ',' in an array, or at the start)
    kValueOrEnd,   // after '[': a value or ']'
    kKey,          // after ',' in an object: a key
    kKeyOrEnd,     // after '{': a key or '}'
    kColon,        // after a key
    kAfterValue,   // ',' or the container's end; at the top level, nothing (whitespace)
    kString, kEscape, kUnicode, kLiteral, kNumber,
  };
  // Where in a number: after '-', after a leading 0, in the integer digits, after '.', in the
  // fraction, after 'e', after the exponent's sign, in the exponent.
  enum class Num { kMinus, kZero, kInt, kDot, kFrac, kE, kESign, kExp };

  bool Fail(absl::string_view what) {
    why_ = absl::StrCat(what, " at byte ", offset_ - 1);
    return false;
  }
  // A string, literal or number ended: a key needs its ':', a value what follows values.
  bool EndValue() {
    state_ = key_ ? State::kColon : State::kAfterValue;
    key_ = false;
    return true;
  }
  bool ReadNumber(unsigned char b) {
    const bool digit = b >= '0' && b <= '9';
    switch (num_) {
      case Num::kMinus:
        if (!digit) return Fail("a '-' without digits");
        num_ = b == '0' ? Num::kZero : Num::kInt;
        return true;
      case Num::kDot:
        if (!digit) return Fail("a '.' without digits");
        num_ = Num::kFrac;
        return true;
      case Num::kE:
        if (b == '+' || b == '-') {
          num_ = Num::kESign;
          return true;
        }
        [[fallthrough]];
      case Num::kESign:
        if (!digit) return Fail("an exponent without digits");
        num_ = Num::kExp;
        return true;
      case Num::kInt:
      case Num::kFrac:
      case Num::kExp:
        if (digit) return true;
        [[fallthrough]];
      case Num::kZero:
        if (digit) return Fail("a number with a leading 0");
        if (b == '.' && (num_ == Num::kZero || num_ == Num::kInt)) {
          num_ = Num::kDot;
          return true;
        }
        if ((b == 'e' || b == 'E') && num_ != Num::kExp) {
          num_ = Num::kE;
          return true;
        }
        EndValue();
        return ReadBetweenTokens(b);  // the byte after the number is the next token's
    }
    return true;
  }
  bool ReadBetweenTokens(unsigned char b) {
    if (b == ' ' || b == '\t' || b == '\n' || b == '\r') return true;
    switch (state_) {
      case State::kKeyOrEnd:
        if (b == '}') return Close('{');
        [[fallthrough]];
      case State::kKey:
        if (b != '"') return Fail("an object key that is not a string");
        key_ = true;
        state_ = State::kString;
        return true;
      case State::kColon:
        if (b != ':') return Fail("a key without ':'");
        state_ = State::kValue;
        return true;
      case State::kAfterValue:
        if (open_.empty()) return Fail("more after the JSON text");
        if (b == ',') {
          state_ = open_.back() == '{' ? State::kKey : State::kValue;
          return true;
        }
        return Close(b == ']' ? '[' : b == '}' ? '{' : 0);
      case State::kValueOrEnd:
        if (b == ']') return Close('[');
        [[fallthrough]];
      default:
        return ReadValueStart(b);
    }
  }
  bool ReadValueStart(unsigned char b) {
    switch (b) {
      case '{':
      case '[':
        open_.push_back(static_cast<char>(b));
        state_ = b == '{' ? State::kKeyOrEnd : State::kValueOrEnd;
        return true;
      case '"':
        state_ = State::kString;
        return true;
      case 't':
      case 'f':
      case 'n':
        literal_left_ = b == 't' ? "rue" : b == 'f' ? "alse" : "ull";
        state_ = State::kLiteral;
        return true;
      default:
        if (b != '-' && !(b >= '0' && b <= '9')) return Fail("a byte that starts no JSON value");
        state_ = State::kNumber;
        num_ = b == '-' ? Num::kMinus : b == '0' ? Num::kZero : Num::kInt;
        return true;
    }
  }
  // `opener` ('[' or '{'; 0: neither) closed by the byte just read.
  bool Close(char opener) {
    if (opener == 0 || open_.empty() || open_.back() != opener) return Fail("a ',' or closing bracket missing");
    open_.pop_back();
    state_ = State::kAfterValue;
    return true;
  }

  State state_ = State::kValue;
  Num num_ = Num::kInt;
  bool key_ = false;                 // the string being read is an object key
  const char* literal_left_ = "";    // kLiteral: the bytes still to come
  int hex_left_ = 0;                 // kUnicode: hex digits still to come
  std::string open_;                 // the containers open, outermost first: '[' or '{'
  size_t offset_ = 0;
  std::string why_;
};

}  // namespace

absl::StatusOr<std::string> ReadJsonSchema(const std::string& path) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("--json-schema ", path, ": ", why));
  };
  std::ifstream in(path, std::ios::binary);
  if (!in) return bad("cannot open the file");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return bad("cannot read the file");
  const std::string s = text.str();
  const nlohmann::json j = nlohmann::json::parse(s, nullptr, false);
  if (j.is_discarded()) return bad("is not JSON");
  if (!j.is_object()) return bad("must be a JSON object (a JSON Schema)");
  std::string compact = j.dump();
  if (compact.size() > kMaxSchemaBytes) {
    return bad(absl::StrCat("is ", compact.size(), " bytes written compactly; servers take at most ", kMaxSchemaBytes));
  }
  return compact;
}

std::string JsonPrefixError(absl::string_view text) {
  JsonPrefixReader reader;
  for (char c : text) {
    if (!reader.Read(static_cast<unsigned char>(c))) return reader.why();
  }
  return "";
}

std::string ShortOutputError(const LoadConfig& c, int64_t wanted, int64_t got, absl::string_view finish) {
  if (c.json_schema.empty()) {
    return absl::StrCat("a request for ", wanted, " tokens (ignore_eos) returned ", got, " (finish reason ", finish, ")");
  }
  return absl::StrCat("a request for ", wanted, " tokens with the JSON Schema of ", c.json_schema_file, " returned ", got,
                      " (finish reason ", finish,
                      "): the output ended where the schema allows; a fair comparison needs a schema whose shortest "
                      "instance is longer than --output-len tokens (tools/bench/bench_schema.json)");
}

std::string NotJsonError(absl::string_view why) {
  return absl::StrCat("the output is not the start of a JSON text (was the JSON Schema applied?): ", why);
}

}  // namespace shardserve::cli::bench
