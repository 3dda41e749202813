#include "coordinator/api/openai/responses_store.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace shardserve::openai {

using Json = nlohmann::ordered_json;

namespace {

std::string Text(const Json& json) { return json.dump(-1, ' ', false, Json::error_handler_t::replace); }

// Text this store wrote (valid JSON).
Json Parsed(const std::string& text) { return Json::parse(text, nullptr, /*allow_exceptions=*/false); }

}  // namespace

ResponsesStore::Slot* ResponsesStore::Find(const std::string& id, const std::string& owner) {
  auto it = slots_.find(id);
  if (it == slots_.end() || it->second.owner != owner) return nullptr;
  used_.splice(used_.begin(), used_, it->second.use);
  return &it->second;
}

void ResponsesStore::Erase(const std::string& id) {
  auto it = slots_.find(id);
  if (it == slots_.end()) return;
  bytes_ -= it->second.bytes;
  used_.erase(it->second.use);
  slots_.erase(it);
}

bool ResponsesStore::Put(StoredResponse entry) {
  const std::string id = entry.response.value("id", "");
  Slot slot{std::move(entry.owner), std::move(entry.previous), Text(entry.input), Text(entry.response)};
  slot.bytes = static_cast<int64_t>(id.size() + slot.owner.size() + slot.previous.size() + slot.input.size() +
                                    slot.response.size());
  if (id.empty() || slot.bytes > max_bytes_) return false;
  absl::MutexLock lock(&mu_);
  if (auto it = slots_.find(id); it != slots_.end()) {
    if (it->second.owner != slot.owner) return false;
    Erase(id);
  }
  used_.push_front(id);
  slot.use = used_.begin();
  bytes_ += slot.bytes;
  slots_[id] = std::move(slot);
  while (bytes_ > max_bytes_) Erase(used_.back());
  return true;
}

bool ResponsesStore::Taken(const std::string& id, const std::string& owner) const {
  absl::MutexLock lock(&mu_);
  auto it = slots_.find(id);
  return it != slots_.end() && it->second.owner != owner;
}

bool ResponsesStore::InChain(const std::string& id, const std::string& from, const std::string& owner) const {
  absl::MutexLock lock(&mu_);
  size_t steps = 0;
  for (std::string at = from; !at.empty() && steps <= slots_.size(); ++steps) {
    if (at == id) return true;
    auto it = slots_.find(at);
    if (it == slots_.end() || it->second.owner != owner) return false;
    at = it->second.previous;
  }
  return false;
}

std::optional<Json> ResponsesStore::Get(const std::string& id, const std::string& owner) {
  absl::MutexLock lock(&mu_);
  const Slot* slot = Find(id, owner);
  if (slot == nullptr) return std::nullopt;
  return Parsed(slot->response);
}

std::optional<Json> ResponsesStore::InputItems(const std::string& id, const std::string& owner) {
  absl::MutexLock lock(&mu_);
  const Slot* slot = Find(id, owner);
  if (slot == nullptr) return std::nullopt;
  return Parsed(slot->input);
}

bool ResponsesStore::Delete(const std::string& id, const std::string& owner) {
  absl::MutexLock lock(&mu_);
  if (Find(id, owner) == nullptr) return false;
  Erase(id);
  return true;
}

absl::StatusOr<Json> ResponsesStore::Conversation(const std::string& id, const std::string& owner) {
  absl::MutexLock lock(&mu_);
  std::vector<const Slot*> chain;  // newest first
  for (std::string at = id; !at.empty();) {
    const Slot* slot = Find(at, owner);
    if (slot == nullptr) {
      return absl::NotFoundError(at == id ? absl::StrCat("no stored response has the id '", id, "'")
                                          : absl::StrCat("the response '", at, "', which '", id,
                                                         "' continues, is no longer stored"));
    }
    // A chain is stored oldest first, so it cannot loop; the bound guards the walk all the same.
    if (chain.size() > slots_.size()) return absl::InternalError("the stored responses' chain loops");
    chain.push_back(slot);
    at = slot->previous;
  }
  Json items = Json::array();
  for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
    for (Json& item : Parsed((*it)->input)) items.push_back(std::move(item));
    Json response = Parsed((*it)->response);
    if (response.contains("output") && response["output"].is_array()) {
      for (Json& item : response["output"]) items.push_back(std::move(item));
    }
  }
  return items;
}

int64_t ResponsesStore::bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

size_t ResponsesStore::size() const {
  absl::MutexLock lock(&mu_);
  return slots_.size();
}

}  // namespace shardserve::openai
