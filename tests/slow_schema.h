// A JSON Schema that is slow to compile, for the tests that cancel a compile: an object of n
// string properties, each a distinct negated character class repeated 1 to 6 times, so that the
// compiler walks the vocabulary once per class. Header-only, for the test programs.
#ifndef SHARDSERVE_TESTS_SLOW_SCHEMA_H_
#define SHARDSERVE_TESTS_SLOW_SCHEMA_H_

#include <string>

#include "absl/strings/str_cat.h"

namespace shardserve {

inline std::string ManyClassesSchema(int n) {
  std::string props;
  for (int i = 0; i < n; ++i) {
    absl::StrAppend(&props, i ? ", " : "", "\"p", i, "\": {\"type\": \"string\", \"pattern\": \"^[^",
                    std::string(1, 'a' + i % 26), std::string(1, 'A' + (i / 26) % 26), "]{1,", 2 + i % 5, "}$\"}");
  }
  return absl::StrCat(R"({"type": "object", "properties": {)", props, "}}");
}

}  // namespace shardserve

#endif  // SHARDSERVE_TESTS_SLOW_SCHEMA_H_
