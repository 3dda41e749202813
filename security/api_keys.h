// The API keys of a server's client-facing API (--api-keys-file): one key per line (blank lines
// and lines starting with '#' are skipped; surrounding spaces trimmed). Only SHA-256 hashes of the
// keys are kept in memory; a presented key is hashed and compared with every stored hash with
// CRYPTO_memcmp (constant time, no early exit), so neither the keys nor their prefixes leak
// through timing. The file is re-read when its modification time, size or inode changes (checked at
// most once a second, on a request): rotate keys by rewriting it. A file that cannot be read or
// holds no key on a re-read keeps the previous keys: Reload says why, and the `kept` callback given
// to Load is told so once per such version of the file (the server logs it).
//
// Used by the gRPC client API (coordinator/api/inference_service.cc: `authorization: Bearer
// <key>` metadata) and meant for any HTTP front door (`Authorization: Bearer <key>`, 401).
// Keys never appear in logs or messages.
//
// Thread-safety: every method is thread-safe.
#ifndef SHARDSERVE_SECURITY_API_KEYS_H_
#define SHARDSERVE_SECURITY_API_KEYS_H_

#include <array>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "security/file_id.h"

namespace shardserve {

class ApiKeys {
 public:
  // The outcome of a check; kMissing and kInvalid are counted apart (shardserve_auth_failures_total).
  enum class Verdict { kOk, kMissing, kInvalid };

  // Called with a message (the file and why; never a key) when a re-read keeps the previous keys,
  // once per version of the file (FileId) that was refused; outside the lock, on the thread that
  // re-read. Must be thread-safe.
  using KeptCallback = std::function<void(absl::string_view message)>;

  // Reads `path`; InvalidArgument when it cannot be read or holds no key. `kept` may be empty.
  static absl::StatusOr<std::unique_ptr<ApiKeys>> Load(const std::string& path, KeptCallback kept = nullptr);

  // `authorization`: the value of the request's authorization header, or nullopt when it has none.
  // "Bearer <key>" (scheme case-insensitive) with a known key is kOk. Re-reads the file first when
  // it changed.
  Verdict Check(std::optional<absl::string_view> authorization);

  // The key's SHA-256 in hex, naming who made what a server keeps for a client (stored responses)
  // without keeping the key; empty without a bearer key.
  static std::string Fingerprint(std::optional<absl::string_view> authorization);

  // The status a gRPC handler returns for a verdict: OK, or UNAUTHENTICATED with a message that
  // says what to send (never the key).
  static absl::Status ToStatus(Verdict verdict);

  // Re-reads the file now if it changed (Check does this by itself); the error of a failed
  // re-read, after which the previous keys stay.
  absl::Status Reload();

  size_t size() const;

 private:
  using Hash = std::array<unsigned char, 32>;
  ApiKeys(std::string path, KeptCallback kept) : path_(std::move(path)), kept_(std::move(kept)) {}
  // Reads and parses the file.
  static absl::StatusOr<std::vector<Hash>> Read(const std::string& path, FileId* id);
  static Hash Sha256(absl::string_view key);
  // The key of "Bearer <key>" (scheme case-insensitive, spaces trimmed); empty when there is none.
  static absl::string_view BearerKey(std::optional<absl::string_view> authorization);

  // Constant after construction.
  const std::string path_;
  const KeptCallback kept_;

  mutable absl::Mutex mu_;
  std::vector<Hash> hashes_ ABSL_GUARDED_BY(mu_);
  FileId file_ ABSL_GUARDED_BY(mu_);  // the version the keys were read from
  // The last version a re-read refused, and why: not read again (nor reported) until it changes.
  FileId refused_ ABSL_GUARDED_BY(mu_);
  absl::Status refused_status_ ABSL_GUARDED_BY(mu_);
  absl::Time last_stat_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

// The HTTP/gRPC metadata key and the scheme clients send: "authorization: Bearer <key>".
inline constexpr char kAuthorizationMetadata[] = "authorization";
// The environment variable client commands take the key from when --api-key is not given.
inline constexpr char kApiKeyEnv[] = "SHARDSERVE_API_KEY";

}  // namespace shardserve

#endif  // SHARDSERVE_SECURITY_API_KEYS_H_
