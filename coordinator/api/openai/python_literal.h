#ifndef SHARDSERVE_COORDINATOR_API_OPENAI_PYTHON_LITERAL_H_
#define SHARDSERVE_COORDINATOR_API_OPENAI_PYTHON_LITERAL_H_

// A tool call's argument that a model wrote as a Python literal (`{'city': 'Paris'}`,
// `['a', 'b']`, `True`), read as vLLM's glm45 and qwen3_coder parsers read it: Python's
// ast.literal_eval, then json.dumps.

#include <optional>

#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace shardserve::openai {

// What ast.literal_eval reads from `text`, as the JSON json.dumps writes of it: strings (quoted
// with ' or ", triple-quoted, u- or r-prefixed, their escapes as Python reads them, adjacent ones
// joined), integers (decimal, 0x, 0o, 0b, with underscores) within 64 bits and floats, one sign
// before a number, True, False and None, lists and tuples as arrays (a bare `1, 2` too), dicts as
// objects (a key as json.dumps writes it: a string as it is, a number as its text, true, false,
// null); newlines and comments inside brackets. nullopt where ast.literal_eval raises, and where
// json.dumps would or this has no JSON for the value: sets, bytes, complex numbers, Ellipsis, f-strings,
// \N{...} escapes, surrogate code points, a float past double's range, an integer past 64 bits,
// two keys json.dumps would write alike.
std::optional<nlohmann::ordered_json> ReadPythonLiteral(absl::string_view text);

}  // namespace shardserve::openai

#endif  // SHARDSERVE_COORDINATOR_API_OPENAI_PYTHON_LITERAL_H_
