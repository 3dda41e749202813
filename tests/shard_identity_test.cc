// model/shard_identity.h: what a checkpoint directory is made of (ModelManifest), the first
// difference between two copies (SameModelFiles: a worker's copy against the coordinator's), and
// the fingerprint made of it (ModelFingerprint).
#include "model/shard_identity.h"

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace shardserve {
namespace {

namespace fs = std::filesystem;

class ShardIdentityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/shard_identity_test.XXXXXX";
    dir_ = mkdtemp(pattern);
    Write("config.json", R"({"model_type": "llama"})");
    Write("model.safetensors", std::string(100, 'w'));
    Write("tokenizer.json", "{}");
    Write("README.md", "not part of the model's identity");
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  void Write(const std::string& name, const std::string& bytes) {
    std::ofstream(dir_ / name, std::ios::binary | std::ios::trunc) << bytes;
  }
  std::vector<std::string> Manifest() {
    absl::StatusOr<std::vector<std::string>> m = ModelManifest(dir_.string());
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? *m : std::vector<std::string>{};
  }
  fs::path dir_;
};

TEST_F(ShardIdentityTest, ManifestHasTheConfigHashThenEveryJsonAndSafetensorsFileWithItsSize) {
  const std::vector<std::string> m = Manifest();
  ASSERT_EQ(m.size(), 4u);
  EXPECT_EQ(m[0].rfind("config.json sha256 ", 0), 0u) << m[0];
  EXPECT_EQ(m[0].size(), std::string("config.json sha256 ").size() + 64);
  EXPECT_EQ(m[1], "config.json 23");
  EXPECT_EQ(m[2], "model.safetensors 100");
  EXPECT_EQ(m[3], "tokenizer.json 2");
  EXPECT_FALSE(ModelManifest((dir_ / "missing").string()).ok());
}

TEST_F(ShardIdentityTest, SameModelFilesNamesTheFirstDifference) {
  const std::vector<std::string> coordinator = Manifest();
  EXPECT_TRUE(SameModelFiles(Manifest(), coordinator).ok());

  Write("model.safetensors", std::string(90, 'w'));
  absl::Status s = SameModelFiles(Manifest(), coordinator);
  EXPECT_TRUE(absl::IsFailedPrecondition(s));
  EXPECT_EQ(s.message(), "model.safetensors is 90 bytes here, 100 bytes at the coordinator");
  Write("model.safetensors", std::string(100, 'w'));

  Write("config.json", R"({"model_type": "qwen2"})");  // same size, other bytes
  s = SameModelFiles(Manifest(), coordinator);
  EXPECT_NE(s.message().find("config.json differs (SHA-256 "), std::string::npos) << s;
  EXPECT_NE(s.message().find("at the coordinator)"), std::string::npos) << s;
  Write("config.json", R"({"model_type": "llama"})");

  fs::remove(dir_ / "tokenizer.json");
  s = SameModelFiles(Manifest(), coordinator);
  EXPECT_EQ(s.message(), "tokenizer.json is missing here (2 bytes at the coordinator)");
  Write("tokenizer.json", "{}");

  Write("model-00002.safetensors", "x");
  s = SameModelFiles(Manifest(), coordinator);
  EXPECT_EQ(s.message(), "model-00002.safetensors is here (1 bytes) but not at the coordinator");
  fs::remove(dir_ / "model-00002.safetensors");

  EXPECT_TRUE(SameModelFiles(Manifest(), coordinator).ok());
}

TEST_F(ShardIdentityTest, FingerprintFollowsTheManifest) {
  const absl::StatusOr<std::string> before = ModelFingerprint(dir_.string());
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_EQ(before->size(), 64u);
  Write("README.md", "edited: not part of it");
  EXPECT_EQ(*ModelFingerprint(dir_.string()), *before);
  Write("model.safetensors", std::string(101, 'w'));
  EXPECT_NE(*ModelFingerprint(dir_.string()), *before);
}

}  // namespace
}  // namespace shardserve
