// The stored Responses of the Responses API (`store`, the default): what `previous_response_id`
// continues, and what GET /v1/responses/{id}, GET /v1/responses/{id}/input_items and
// DELETE /v1/responses/{id} read. Kept in the coordinator's memory, within a budget of bytes
// (--http-responses-store-bytes): the least recently used go first, a response continued counting
// as used with every response before it in its conversation. A restart forgets them all.
//
// Each response is kept as JSON text (its size what the budget counts, and about what it takes),
// parsed again when read, with its own input items and its owner: with API keys, the fingerprint
// of the key that made it (ApiKeys::Fingerprint), and another key finds nothing there, as if the
// id were unknown; without keys every client is the same owner. A conversation is the chain of
// previous_response_id links: each response's input items, then its output items, oldest first.
//
// Thread-safety: every method is thread-safe.
#ifndef SHARDSERVE_COORDINATOR_API_OPENAI_RESPONSES_STORE_H_
#define SHARDSERVE_COORDINATOR_API_OPENAI_RESPONSES_STORE_H_

#include <cstdint>
#include <list>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "nlohmann/json.hpp"

namespace shardserve::openai {

struct StoredResponse {
  std::string owner;              // the API key's fingerprint; empty without keys
  std::string previous;           // the previous_response_id it continued; empty when none
  nlohmann::ordered_json input;   // its input items, as NormalizedInputItems makes them
  nlohmann::ordered_json response;  // the Response object, as answered
};

class ResponsesStore {
 public:
  // At most `max_bytes` (each response counted as its JSON text's length); 0 stores nothing.
  explicit ResponsesStore(int64_t max_bytes) : max_bytes_(max_bytes) {}

  // Stores `entry` under the id of its response, replacing one of the same id and owner, then drops
  // the least recently used beyond the budget. False when nothing was stored: the entry alone is
  // over the budget, or the id is another owner's.
  bool Put(StoredResponse entry);
  // Whether `id` is stored for another owner than `owner` (Put would refuse it).
  bool Taken(const std::string& id, const std::string& owner) const;
  // Whether `id` is `from` or a response before it in its conversation (for `owner`): storing a
  // response under such an id would make the conversation loop.
  bool InChain(const std::string& id, const std::string& from, const std::string& owner) const;
  // The stored Response, or nullopt (unknown id, or another owner's).
  std::optional<nlohmann::ordered_json> Get(const std::string& id, const std::string& owner);
  // The input items of a stored response, or nullopt.
  std::optional<nlohmann::ordered_json> InputItems(const std::string& id, const std::string& owner);
  // Removes a stored response; false when there was none (for this owner).
  bool Delete(const std::string& id, const std::string& owner);
  // The conversation that `id` ends: input then output items of each response in its chain, oldest
  // first; each is marked used. NotFound naming the response that is not stored (`id`, or one
  // before it, dropped or deleted).
  absl::StatusOr<nlohmann::ordered_json> Conversation(const std::string& id, const std::string& owner);

  int64_t bytes() const;
  size_t size() const;
  int64_t max_bytes() const { return max_bytes_; }

 private:
  struct Slot {
    std::string owner, previous;
    std::string input, response;  // JSON text
    int64_t bytes = 0;
    std::list<std::string>::iterator use;  // its place in used_
  };
  // The slot of `id` for `owner` (marked used), or null.
  Slot* Find(const std::string& id, const std::string& owner) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Erase(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int64_t max_bytes_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Slot> slots_ ABSL_GUARDED_BY(mu_);
  std::list<std::string> used_ ABSL_GUARDED_BY(mu_);  // ids, most recently used first
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace shardserve::openai

#endif  // SHARDSERVE_COORDINATOR_API_OPENAI_RESPONSES_STORE_H_
