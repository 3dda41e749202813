#include "model/shard_identity.h"

#include <openssl/sha.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardserve {

namespace {

std::string Sha256Hex(const std::string& bytes) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), digest);
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(digest), sizeof(digest)));
}

// An entry "KEY VALUE" split at its last space (file names may hold spaces, values do not).
std::pair<std::string, std::string> SplitEntry(const std::string& entry) {
  const size_t space = entry.rfind(' ');
  if (space == std::string::npos) return {entry, ""};
  return {entry.substr(0, space), entry.substr(space + 1)};
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ModelManifest(const std::string& dir) {
  namespace fs = std::filesystem;
  std::ifstream config(fs::path(dir) / "config.json", std::ios::binary);
  if (!config) return absl::NotFoundError(absl::StrCat("cannot read ", dir, "/config.json"));
  std::stringstream bytes;
  bytes << config.rdbuf();
  std::vector<std::pair<std::string, uintmax_t>> files;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const std::string ext = e.path().extension().string();
    if ((ext != ".safetensors" && ext != ".json") || !e.is_regular_file(ec)) continue;
    files.emplace_back(name, e.file_size(ec));
  }
  if (ec) return absl::NotFoundError(absl::StrCat("cannot list ", dir, ": ", ec.message()));
  std::sort(files.begin(), files.end());
  std::vector<std::string> manifest = {absl::StrCat("config.json sha256 ", Sha256Hex(bytes.str()))};
  for (const auto& [name, size] : files) manifest.push_back(absl::StrCat(name, " ", size));
  return manifest;
}

absl::Status SameModelFiles(const std::vector<std::string>& here, const std::vector<std::string>& wanted) {
  std::map<std::string, std::string> mine, theirs;
  for (const std::string& e : here) mine.insert(SplitEntry(e));
  for (const std::string& e : wanted) theirs.insert(SplitEntry(e));
  for (const auto& [key, value] : theirs) {
    auto it = mine.find(key);
    if (key == "config.json sha256") {
      if (it == mine.end() || it->second != value) {
        return absl::FailedPreconditionError(absl::StrCat(
            "config.json differs (SHA-256 ", it == mine.end() ? "none" : it->second.substr(0, 16), "... here, ",
            value.substr(0, 16), "... at the coordinator)"));
      }
    } else if (it == mine.end()) {
      return absl::FailedPreconditionError(absl::StrCat(key, " is missing here (", value, " bytes at the coordinator)"));
    } else if (it->second != value) {
      return absl::FailedPreconditionError(
          absl::StrCat(key, " is ", it->second, " bytes here, ", value, " bytes at the coordinator"));
    }
  }
  for (const auto& [key, value] : mine) {
    if (!theirs.count(key)) {
      return absl::FailedPreconditionError(absl::StrCat(key, " is here (", value, " bytes) but not at the coordinator"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ModelFingerprint(const std::string& dir) {
  absl::StatusOr<std::vector<std::string>> manifest = ModelManifest(dir);
  if (!manifest.ok()) return manifest.status();
  return Sha256Hex(absl::StrJoin(*manifest, "\n"));
}

absl::Status SameShard(const v1::Assignment& held, const v1::Assignment& wanted) {
  auto differs = [](const char* what, const auto& a, const auto& b) {
    return absl::FailedPreconditionError(absl::StrCat(what, " ", a, " (held) vs ", b, " (wanted)"));
  };
  if (held.model_path() != wanted.model_path()) return differs("model path", held.model_path(), wanted.model_path());
  const std::pair<const char*, std::pair<int64_t, int64_t>> fields[] = {
      {"stages", {held.num_stages(), wanted.num_stages()}},
      {"stage", {held.stage(), wanted.stage()}},
      {"tp size", {held.tp_size(), wanted.tp_size()}},
      {"tp rank", {held.tp_rank(), wanted.tp_rank()}},
      {"first layer", {held.first_layer(), wanted.first_layer()}},
      {"end layer", {held.end_layer(), wanted.end_layer()}},
      {"weight quantization", {held.weight_quantization(), wanted.weight_quantization()}},
      {"expert parallel", {held.expert_parallel(), wanted.expert_parallel()}},
      {"load format", {held.load_format(), wanted.load_format()}},
      {"max tokens per step", {held.limits().max_tokens_per_step(), wanted.limits().max_tokens_per_step()}},
      {"max seqs per step", {held.limits().max_seqs_per_step(), wanted.limits().max_seqs_per_step()}},
      {"block size", {held.limits().block_size(), wanted.limits().block_size()}},
      {"KV blocks", {held.limits().num_kv_blocks(), wanted.limits().num_kv_blocks()}},
      {"sliding KV blocks", {held.limits().num_sliding_kv_blocks(), wanted.limits().num_sliding_kv_blocks()}},
      {"max model len", {held.limits().max_model_len(), wanted.limits().max_model_len()}},
  };
  for (const auto& [what, values] : fields) {
    if (values.first != values.second) return differs(what, values.first, values.second);
  }
  if (held.load_format() == v1::LOAD_FORMAT_DUMMY && held.dummy_seed() != wanted.dummy_seed()) {
    return differs("dummy seed", held.dummy_seed(), wanted.dummy_seed());
  }
  return absl::OkStatus();
}

}  // namespace shardserve
