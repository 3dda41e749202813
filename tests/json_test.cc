// base/json.h: outside JSON parsed with its nesting bounded. The bound is exact (128 levels parse,
// 129 do not), holds for arrays and objects and for 50,000 levels (a 100 KB body that used to
// overflow a thread's stack in what walked it), and the errors say what is wrong and where.
#include "base/json.h"

#include <string>

#include <gtest/gtest.h>

#include "absl/strings/match.h"

namespace shardserve {
namespace {

std::string Arrays(int depth) { return std::string(depth, '[') + std::string(depth, ']'); }

std::string Objects(int depth) {
  std::string s;
  for (int i = 0; i < depth; ++i) s += "{\"a\":";
  s += "1";
  for (int i = 0; i < depth; ++i) s += "}";
  return s;
}

TEST(ParseJsonTest, NestingUpToTheBoundParses) {
  absl::StatusOr<nlohmann::json> arrays = ParseJson<nlohmann::json>(Arrays(kMaxJsonDepth), "the body");
  ASSERT_TRUE(arrays.ok()) << arrays.status();
  EXPECT_TRUE(arrays->is_array());
  absl::StatusOr<nlohmann::ordered_json> objects = ParseJson<nlohmann::ordered_json>(Objects(kMaxJsonDepth), "x");
  ASSERT_TRUE(objects.ok()) << objects.status();
  const nlohmann::ordered_json* v = &*objects;
  int levels = 0;
  while (v->is_object()) {
    v = &(*v)["a"];
    ++levels;
  }
  EXPECT_EQ(levels, kMaxJsonDepth);
  EXPECT_EQ(*v, 1);
}

TEST(ParseJsonTest, NestingPastTheBoundIsRefusedNamingIt) {
  for (const std::string& text : {Arrays(kMaxJsonDepth + 1), Objects(kMaxJsonDepth + 1), Arrays(50000),
                                  "{\"ok\": 1, \"deep\": " + Objects(300) + "}"}) {
    absl::StatusOr<nlohmann::json> json = ParseJson<nlohmann::json>(text, "the body");
    ASSERT_FALSE(json.ok()) << text.substr(0, 40);
    EXPECT_EQ(json.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(json.status().message(), "the body nests arrays and objects deeper than 128 levels");
  }
  // A smaller bound, as a caller may give.
  EXPECT_TRUE(ParseJson<nlohmann::json>(Arrays(3), "x", 3).ok());
  EXPECT_FALSE(ParseJson<nlohmann::json>(Arrays(4), "x", 3).ok());
}

TEST(ParseJsonTest, InvalidJsonSaysWhereItBreaks) {
  absl::StatusOr<nlohmann::json> cut = ParseJson<nlohmann::json>("{\"a\": ", "config.json");
  ASSERT_FALSE(cut.ok());
  EXPECT_TRUE(absl::StartsWith(cut.status().message(), "config.json is not valid JSON: ")) << cut.status();
  EXPECT_TRUE(absl::StrContains(cut.status().message(), "column")) << cut.status();
  absl::StatusOr<nlohmann::json> big = ParseJson<nlohmann::json>("[1e1111]", "x");
  ASSERT_FALSE(big.ok());
  EXPECT_TRUE(absl::StrContains(big.status().message(), "number overflow")) << big.status();
}

}  // namespace
}  // namespace shardserve
