#include "model/shard_identity.h"

#include <openssl/sha.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace shardserve {

absl::StatusOr<std::string> ModelFingerprint(const std::string& dir) {
  namespace fs = std::filesystem;
  std::ifstream config(fs::path(dir) / "config.json", std::ios::binary);
  if (!config) return absl::NotFoundError(absl::StrCat("cannot read ", dir, "/config.json"));
  std::stringstream bytes;
  bytes << config.rdbuf();
  std::string text = absl::StrCat("config.json\n", bytes.str(), "\n");
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
  for (const auto& [name, size] : files) absl::StrAppend(&text, name, " ", size, "\n");
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(text.data()), text.size(), digest);
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(digest), sizeof(digest)));
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
      {"load format", {held.load_format(), wanted.load_format()}},
      {"max tokens per step", {held.limits().max_tokens_per_step(), wanted.limits().max_tokens_per_step()}},
      {"max seqs per step", {held.limits().max_seqs_per_step(), wanted.limits().max_seqs_per_step()}},
      {"block size", {held.limits().block_size(), wanted.limits().block_size()}},
      {"KV blocks", {held.limits().num_kv_blocks(), wanted.limits().num_kv_blocks()}},
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
