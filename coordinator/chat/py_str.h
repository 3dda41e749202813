// Python's str operations on UTF-8 text, as jinja2 running in transformers' sandbox shows them: the
// pieces the value type (value.h), the filters (filters.h) and the methods (methods.h) share.
// Known approximations: case mapping is Unicode's simple mapping (one code point to one, through
// utf8proc), where Python uses the full one ('ß'.upper() is 'SS' there, 'ß' here); IsAsciiAlpha
// looks at ASCII only. Inside a render, Replace and Split charge the render's budget (budget.h).
#ifndef SHARDSERVE_COORDINATOR_CHAT_PY_STR_H_
#define SHARDSERVE_COORDINATOR_CHAT_PY_STR_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "coordinator/chat/value.h"

namespace shardserve::chat {

// The code points of `s`; a byte that starts no valid sequence stands for itself.
std::vector<uint32_t> Decode(const std::string& s);
// Code points [begin, end) of `cps` as UTF-8.
std::string Encode(const std::vector<uint32_t>& cps, size_t begin, size_t end);
// Python's str.isspace() code points.
bool IsPySpace(uint32_t c);
bool IsAsciiAlpha(char c);

// str.strip/lstrip/rstrip: whitespace when `chars` is null, else any of chars' code points.
std::string Strip(const std::string& s, const Value* chars, bool left, bool right);
std::string Upper(const std::string& s);
std::string Lower(const std::string& s);
// Python's str.capitalize(): the first character in title case, the rest lower case.
std::string Capitalize(const std::string& s);
// Python's str.title(): a character after a cased one is lowered, any other is title-cased.
std::string PyTitle(const std::string& s);
// jinja2's title filter: words start after whitespace, '-', '(', '{', '[' or '<'; each word is
// word[0].upper() + word[1:].lower().
std::string JinjaTitle(const std::string& s);
// str.replace(from, to, count); count < 0 replaces every occurrence.
std::string Replace(const std::string& s, const std::string& from, const std::string& to, int64_t count);
// str.split(sep, maxsplit): runs of whitespace when `sep` is null or None; maxsplit < 0 is no limit.
std::vector<Value> Split(const std::string& s, const Value* sep, int64_t maxsplit);

}  // namespace shardserve::chat

#endif  // SHARDSERVE_COORDINATOR_CHAT_PY_STR_H_
