#include "security/api_keys.h"

#include <fstream>
#include <sstream>

#include <openssl/crypto.h>
#include <openssl/sha.h>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace shardserve {
namespace {

constexpr absl::Duration kStatInterval = absl::Seconds(1);
// A key longer than this is refused unhashed (bounded work per request).
constexpr size_t kMaxKeyBytes = 4096;

}  // namespace

ApiKeys::Hash ApiKeys::Sha256(absl::string_view key) {
  Hash h;
  SHA256(reinterpret_cast<const unsigned char*>(key.data()), key.size(), h.data());
  return h;
}

absl::StatusOr<std::vector<ApiKeys::Hash>> ApiKeys::Read(const std::string& path, FileId* id) {
  *id = FileId::Of(path);
  if (*id == FileId{}) {
    return absl::InvalidArgumentError(absl::StrCat("--api-keys-file ", path, ": cannot read the file"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("--api-keys-file ", path, ": cannot read the file"));
  std::stringstream text;
  text << in.rdbuf();
  std::vector<Hash> hashes;
  for (absl::string_view line : absl::StrSplit(text.str(), '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line.front() == '#') continue;
    if (line.size() > kMaxKeyBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("--api-keys-file ", path, ": a key is longer than ", kMaxKeyBytes, " bytes"));
    }
    hashes.push_back(Sha256(line));
  }
  if (hashes.empty()) return absl::InvalidArgumentError(absl::StrCat("--api-keys-file ", path, ": no key in the file"));
  return hashes;
}

absl::StatusOr<std::unique_ptr<ApiKeys>> ApiKeys::Load(const std::string& path, KeptCallback kept) {
  std::unique_ptr<ApiKeys> keys(new ApiKeys(path, std::move(kept)));
  FileId id;
  absl::StatusOr<std::vector<Hash>> hashes = Read(path, &id);
  if (!hashes.ok()) return hashes.status();
  absl::MutexLock lock(&keys->mu_);
  keys->hashes_ = *std::move(hashes);
  keys->file_ = id;
  keys->last_stat_ = absl::Now();
  return keys;
}

absl::Status ApiKeys::Reload() {
  std::string kept_message;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    last_stat_ = absl::Now();
    const FileId now = FileId::Of(path_);
    if (now != FileId{} && now == file_) return absl::OkStatus();
    // A version already refused (a missing file stays all zero): its error again, read and reported once.
    if (now == refused_ && !refused_status_.ok()) return refused_status_;
    FileId id;
    absl::StatusOr<std::vector<Hash>> hashes = Read(path_, &id);
    if (hashes.ok()) {
      hashes_ = *std::move(hashes);
      file_ = id;
      refused_ = FileId{};
      refused_status_ = absl::OkStatus();
      return absl::OkStatus();
    }
    status = hashes.status();
    refused_ = id;
    refused_status_ = status;
    kept_message = absl::StrCat(status.message(), "; keeping the ", hashes_.size(), " key(s) read before");
  }
  if (kept_) kept_(kept_message);
  return status;
}

size_t ApiKeys::size() const {
  absl::MutexLock lock(&mu_);
  return hashes_.size();
}

absl::string_view ApiKeys::BearerKey(std::optional<absl::string_view> authorization) {
  if (!authorization.has_value()) return "";
  absl::string_view value = absl::StripAsciiWhitespace(*authorization);
  if (value.size() < 7 || !absl::EqualsIgnoreCase(value.substr(0, 7), "bearer ")) return "";
  return absl::StripAsciiWhitespace(value.substr(7));
}

std::string ApiKeys::Fingerprint(std::optional<absl::string_view> authorization) {
  const absl::string_view key = BearerKey(authorization);
  if (key.empty()) return "";
  const Hash h = Sha256(key);
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(h.data()), h.size()));
}

ApiKeys::Verdict ApiKeys::Check(std::optional<absl::string_view> authorization) {
  bool stale;
  {
    absl::MutexLock lock(&mu_);
    stale = absl::Now() - last_stat_ >= kStatInterval;
  }
  if (stale) Reload().IgnoreError();  // a bad rewrite keeps the previous keys; Reload() tells kept_
  const absl::string_view key = BearerKey(authorization);
  if (key.empty()) return Verdict::kMissing;
  if (key.size() > kMaxKeyBytes) return Verdict::kInvalid;
  const Hash presented = Sha256(key);
  absl::MutexLock lock(&mu_);
  int matches = 0;
  for (const Hash& h : hashes_) matches |= CRYPTO_memcmp(h.data(), presented.data(), h.size()) == 0;
  return matches ? Verdict::kOk : Verdict::kInvalid;
}

absl::Status ApiKeys::ToStatus(Verdict verdict) {
  switch (verdict) {
    case Verdict::kOk:
      return absl::OkStatus();
    case Verdict::kMissing:
      return absl::UnauthenticatedError(
          "this server needs an API key: send it as 'authorization: Bearer <key>' metadata (shardserve: --api-key "
          "or SHARDSERVE_API_KEY)");
    case Verdict::kInvalid:
      break;
  }
  return absl::UnauthenticatedError("the API key is not valid");
}

}  // namespace shardserve
