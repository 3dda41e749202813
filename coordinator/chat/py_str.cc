// Python semantics, as jinja2 running in transformers' ImmutableSandboxedEnvironment shows them.
#include "coordinator/chat/py_str.h"

#include <utf8proc.h>

#include "coordinator/chat/budget.h"

namespace shardserve::chat {

std::vector<uint32_t> Decode(const std::string& s) {
  std::vector<uint32_t> out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    if (i + n > s.size()) n = 1;
    uint32_t cp = n == 1 ? c : (c & (0xFF >> (n + 1)));
    for (int k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    out.push_back(cp);
    i += n;
  }
  return out;
}

std::string Encode(const std::vector<uint32_t>& cps, size_t begin, size_t end) {
  std::string out;
  for (size_t i = begin; i < end; ++i) AppendUtf8(&out, cps[i]);
  return out;
}

// Python's str.isspace() code points.
bool IsPySpace(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// str.strip/lstrip/rstrip: whitespace when `chars` is null, else any of chars' code points.
std::string Strip(const std::string& s, const Value* chars, bool left, bool right) {
  std::vector<uint32_t> cps = Decode(s);
  std::vector<uint32_t> set;
  const bool whitespace = chars == nullptr || chars->is_none() || chars->is_undefined();
  if (!whitespace) set = Decode(chars->Str());
  auto strip = [&](uint32_t c) { return whitespace ? IsPySpace(c) : std::find(set.begin(), set.end(), c) != set.end(); };
  size_t b = 0, e = cps.size();
  if (left) while (b < e && strip(cps[b])) ++b;
  if (right) while (e > b && strip(cps[e - 1])) --e;
  return Encode(cps, b, e);
}

bool IsAsciiAlpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
namespace {

// Case mapping: Unicode's simple (one code point to one) mappings, through utf8proc. Python uses the
// full mappings, which differ for a few code points ('ß'.upper() is 'SS' there, 'ß' here).
uint32_t ToUpper(uint32_t c) { return static_cast<uint32_t>(utf8proc_toupper(static_cast<utf8proc_int32_t>(c))); }
uint32_t ToLower(uint32_t c) { return static_cast<uint32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(c))); }
uint32_t ToTitle(uint32_t c) { return static_cast<uint32_t>(utf8proc_totitle(static_cast<utf8proc_int32_t>(c))); }
bool IsCased(uint32_t c) {
  const utf8proc_category_t cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LL || cat == UTF8PROC_CATEGORY_LT;
}

std::string MapCase(const std::string& s, uint32_t (*f)(uint32_t)) {
  std::string out;
  for (uint32_t c : Decode(s)) AppendUtf8(&out, f(c));
  return out;
}

}  // namespace

std::string Upper(const std::string& s) { return MapCase(s, ToUpper); }
std::string Lower(const std::string& s) { return MapCase(s, ToLower); }
// Python's str.capitalize(): the first character in title case, the rest lower case.
std::string Capitalize(const std::string& s) {
  std::string out;
  bool first = true;
  for (uint32_t c : Decode(s)) {
    AppendUtf8(&out, first ? ToTitle(c) : ToLower(c));
    first = false;
  }
  return out;
}
// Python's str.title(): a character after a cased one is lowered, any other is title-cased.
std::string PyTitle(const std::string& s) {
  std::string out;
  bool prev_cased = false;
  for (uint32_t c : Decode(s)) {
    AppendUtf8(&out, prev_cased ? ToLower(c) : ToTitle(c));
    prev_cased = IsCased(c);
  }
  return out;
}
// jinja2's title filter: words start after whitespace, '-', '(', '{', '[' or '<'; each word is
// word[0].upper() + word[1:].lower().
std::string JinjaTitle(const std::string& s) {
  std::string out;
  bool start = true;
  for (uint32_t c : Decode(s)) {
    const bool sep = IsPySpace(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<';
    if (sep) {
      AppendUtf8(&out, c);
      start = true;
    } else {
      AppendUtf8(&out, start ? ToUpper(c) : ToLower(c));
      start = false;
    }
  }
  return out;
}

std::string Replace(const std::string& s, const std::string& from, const std::string& to, int64_t count) {
  std::string out;
  if (from.empty()) {  // Python inserts `to` between every code point
    std::vector<uint32_t> cps = Decode(s);
    int64_t done = 0;
    for (size_t i = 0; i <= cps.size(); ++i) {
      if (count < 0 || done < count) CheckGrowth(out, to.size() + 4), out += to, ++done;
      if (i < cps.size()) AppendUtf8(&out, cps[i]);
    }
    return out;
  }
  size_t pos = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    size_t hit = s.find(from, pos);
    if (hit == std::string::npos) break;
    CheckGrowth(out, hit - pos + to.size());
    out.append(s, pos, hit - pos);
    out += to;
    pos = hit + from.size();
    ++done;
  }
  out.append(s, pos, std::string::npos);
  return out;
}

std::vector<Value> Split(const std::string& s, const Value* sep, int64_t maxsplit) {
  std::vector<Value> out;
  if (sep == nullptr || sep->is_none()) {  // runs of whitespace, ends ignored
    std::vector<uint32_t> cps = Decode(s);
    size_t i = 0;
    while (true) {
      while (i < cps.size() && IsPySpace(cps[i])) ++i;
      if (i == cps.size()) break;
      if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
        size_t e = cps.size();
        while (e > i && IsPySpace(cps[e - 1])) --e;
        out.emplace_back(Encode(cps, i, e));
        break;
      }
      size_t j = i;
      while (j < cps.size() && !IsPySpace(cps[j])) ++j;
      CheckElements(static_cast<int64_t>(out.size()) + 2);  // the items so far, this one, the list
      out.emplace_back(Encode(cps, i, j));
      i = j;
    }
    return out;
  }
  const std::string& d = sep->AsString();
  if (d.empty()) throw TemplateError("empty separator", Location{});
  size_t pos = 0;
  while (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) {
    size_t hit = s.find(d, pos);
    if (hit == std::string::npos) break;
    CheckElements(static_cast<int64_t>(out.size()) + 2);  // the items so far, this one, the list
    out.emplace_back(s.substr(pos, hit - pos));
    pos = hit + d.size();
  }
  out.emplace_back(s.substr(pos));
  return out;
}

}  // namespace shardserve::chat
