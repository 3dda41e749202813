// JSON from outside the process (request bodies, checkpoint and tokenizer files) parsed with its
// nesting bounded: every reader of such bytes calls ParseJson, and nothing else parses them.
//
// nlohmann's parser keeps its own stack and does not recurse, but what walks the result does:
// turning it into chat-template values, dumping it, comparing it. A request body of 100 KB can
// nest arrays 50,000 deep, and the walk overflows its thread's stack and kills the process. So
// nesting past `max_depth` levels is refused while parsing, with an error that names the limit.
// kMaxJsonDepth is far above what real inputs need (an OpenAI tool's JSON Schema nests a few
// dozen levels; config.json and tokenizer.json fewer than ten) and far below what a walk of one
// frame a level can overflow on a thread's stack (8 MiB; a walk frame is at most a few hundred
// bytes, so 10,000 levels fit).
//
//   SHARDSERVE_ASSIGN_OR_RETURN(nlohmann::json config, ParseJson<nlohmann::json>(text, "config.json"));
//
// Threading: plain functions.
#ifndef SHARDSERVE_BASE_JSON_H_
#define SHARDSERVE_BASE_JSON_H_

#include <string>
#include <string_view>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace shardserve {

// Levels of arrays and objects inside one another that outside JSON may have ("[[1]]" has 2).
// Below the chat-template runtime's depth budget (coordinator/chat/budget.h, 200), so that
// a request's tools or template arguments printed by a template (tojson) never reach it: a budget
// exceeded there is the template's fault (500), too deep a request the client's (400).
inline constexpr int kMaxJsonDepth = 128;

// Parses `text` (a string, std::string_view, absl::string_view or literal). InvalidArgument "WHAT is not valid JSON: (where it breaks)" or "WHAT nests arrays and
// objects deeper than MAX levels"; `what` names the input (a file, "the body"). Json is
// nlohmann::json or nlohmann::ordered_json.
template <typename Json, typename Text>
absl::StatusOr<Json> ParseJson(const Text& text, const std::string& what, int max_depth = kMaxJsonDepth) {
  bool too_deep = false;
  // The parser's depth of a container is the number of containers around it: "[[1]]"'s inner
  // array is at depth 1, its level 2. A refused container is dropped, its contents still read
  // (by the parser's own loop, so the depth costs no stack) and dropped with it.
  const typename Json::parser_callback_t bound = [&too_deep, max_depth](int depth, typename Json::parse_event_t event,
                                                                        Json&) {
    if ((event == Json::parse_event_t::object_start || event == Json::parse_event_t::array_start) &&
        depth >= max_depth) {
      too_deep = true;
      return false;
    }
    return true;
  };
  Json json;
  try {
    std::string_view view;
    if constexpr (std::is_convertible_v<const Text&, std::string_view>) {
      view = text;
    } else {
      view = std::string_view(text.data(), text.size());  // absl::string_view where it is not std's
    }
    json = Json::parse(view.data(), view.data() + view.size(), bound);
  } catch (const typename Json::exception& e) {
    // e.what(): where the JSON breaks ("parse error at line 1, column 7: ..."), or a number out of
    // range ("number overflow parsing '1e1111'": out_of_range, not a parse_error).
    return absl::InvalidArgumentError(absl::StrCat(what, " is not valid JSON: ", e.what()));
  }
  if (too_deep) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " nests arrays and objects deeper than ", max_depth, " levels"));
  }
  return json;
}

}  // namespace shardserve

#endif  // SHARDSERVE_BASE_JSON_H_
