// model/step_limits.h: the one set of step limits. Each bad field is refused with its name and
// numbers; the undecided fields (0) pass Validate() but not ValidateDecided(); the block-table
// width is derived; the wire form round-trips.
#include "model/step_limits.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "kernels/backend.h"
#include "shardserve/v1/worker.pb.h"

namespace shardserve {
namespace {

using ::testing::HasSubstr;

constexpr StepLimits kDecided{.max_tokens_per_step = 512, .max_seqs_per_step = 64, .block_size = 16,
                              .num_kv_blocks = 1000, .max_model_len = 4000};

TEST(StepLimits, BlocksPerSequenceIsDerivedFromMaxModelLenAndBlockSize) {
  EXPECT_EQ(kDecided.max_blocks_per_seq(), 250);  // 4000 / 16
  StepLimits l = kDecided;
  l.max_model_len = 4001;
  EXPECT_EQ(l.max_blocks_per_seq(), 251);  // rounded up
  l.max_model_len = 0;
  EXPECT_EQ(l.max_blocks_per_seq(), 0);
  EXPECT_EQ(kDecided.kv_cache_tokens(), 16000);
}

TEST(StepLimits, DecidedLimitsPassBothChecks) {
  EXPECT_TRUE(kDecided.Validate().ok()) << kDecided.Validate();
  EXPECT_TRUE(kDecided.ValidateDecided().ok()) << kDecided.ValidateDecided();
}

TEST(StepLimits, UndecidedKvBlocksAndLengthPassValidateButNotValidateDecided) {
  const StepLimits flags;  // the coordinator's defaults, before the plan
  EXPECT_EQ(flags.num_kv_blocks, 0);
  EXPECT_EQ(flags.max_model_len, 0);
  EXPECT_TRUE(flags.Validate().ok()) << flags.Validate();
  EXPECT_THAT(std::string(flags.ValidateDecided().message()), HasSubstr("num_kv_blocks 0 outside [1, "));
  StepLimits l = kDecided;
  l.max_model_len = 0;
  EXPECT_TRUE(l.Validate().ok());
  EXPECT_THAT(std::string(l.ValidateDecided().message()), HasSubstr("max_model_len 0 outside [1, 2147483648]"));
}

struct BadCase {
  const char* what;
  StepLimits limits;
  const char* message;
};

TEST(StepLimits, EachBadFieldIsRefusedWithItsNameAndNumbers) {
  auto with = [](auto change) {
    StepLimits l = kDecided;
    change(l);
    return l;
  };
  const BadCase cases[] = {
      {"no tokens", with([](StepLimits& l) { l.max_tokens_per_step = 0; }), "max_tokens_per_step 0 outside [1, 1048576]"},
      {"no sequences", with([](StepLimits& l) { l.max_seqs_per_step = -3; }), "max_seqs_per_step -3 outside [1, 1048576]"},
      {"huge blocks", with([](StepLimits& l) { l.block_size = int64_t{1} << 40; }), "block_size 1099511627776 outside"},
      {"decodes do not fit", with([](StepLimits& l) { l.max_tokens_per_step = 32; }),
       "max_tokens_per_step 32 is below max_seqs_per_step 64"},
      {"cache beyond int32 slots", with([](StepLimits& l) { l.num_kv_blocks = kMaxKvCacheTokens / 16 + 1; }),
       "num_kv_blocks 134217729 outside [0, 134217728]"},
      {"negative blocks", with([](StepLimits& l) { l.num_kv_blocks = -1; }), "num_kv_blocks -1 outside [0, "},
      {"negative sliding blocks", with([](StepLimits& l) { l.num_sliding_kv_blocks = -1; }),
       "num_sliding_kv_blocks -1 outside [0, 134217728]"},
      {"sliding cache beyond int32 slots",
       with([](StepLimits& l) { l.num_sliding_kv_blocks = kMaxKvCacheTokens / 16 + 1; }),
       "num_sliding_kv_blocks 134217729 outside [0, 134217728]"},
      {"length beyond int32 slots", with([](StepLimits& l) { l.max_model_len = int64_t{1} << 62; }),
       "max_model_len 4611686018427387904 outside [0, 2147483648]"},
      {"block tables too large", with([](StepLimits& l) { l.max_model_len = 1 << 20; }),
       "block tables of 64 sequences x 65536 blocks"},
  };
  for (const BadCase& c : cases) {
    const absl::Status s = c.limits.Validate();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.what << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.message)) << c.what;
    EXPECT_FALSE(c.limits.ValidateDecided().ok()) << c.what;
  }
}

TEST(StepLimits, TheWireFormRoundTrips) {
  v1::StepLimits wire;
  ToProto(kDecided, &wire);
  EXPECT_EQ(wire.max_model_len(), 4000);
  EXPECT_EQ(FromProto(wire), kDecided);
  StepLimits sliding = kDecided;
  sliding.num_sliding_kv_blocks = 77;
  ToProto(sliding, &wire);
  EXPECT_EQ(wire.num_sliding_kv_blocks(), 77);
  EXPECT_EQ(FromProto(wire), sliding);
  // Without a sliding layers' pool the field stays off the wire: the same bytes as before it existed.
  ToProto(kDecided, &wire);
  v1::StepLimits without = wire;
  without.clear_num_sliding_kv_blocks();
  EXPECT_EQ(wire.SerializeAsString(), without.SerializeAsString());
  // A message with nothing set is all zeros: refused before anything is sized by it.
  EXPECT_FALSE(FromProto(v1::StepLimits()).ValidateDecided().ok());
}

}  // namespace
}  // namespace shardserve
