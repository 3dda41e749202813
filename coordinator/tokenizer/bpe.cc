#include "coordinator/tokenizer/bpe.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "coordinator/tokenizer/unicode.h"

namespace shardserve::tokenizer_internal {
namespace {

constexpr std::string_view kWhere = "tokenizer.json: model";
// Ids at or above this are rejected, so that id-indexed tables stay small.
constexpr int64_t kMaxTokenId = int64_t{1} << 24;
// Words this long or longer are not cached (Hugging Face's MAX_LENGTH).
constexpr size_t kMaxCachedWordBytes = 256;
// U+2581 LOWER ONE EIGHTH BLOCK, SentencePiece's space.
constexpr std::string_view kMetaspace = "\xE2\x96\x81";

// True if "▁" occurs in `token` after a character other than "▁".
bool HasInnerMetaspace(std::string_view token) {
  for (size_t p = token.find(kMetaspace, 1); p != std::string_view::npos; p = token.find(kMetaspace, p + 1)) {
    if (p < kMetaspace.size() || token.substr(p - kMetaspace.size(), kMetaspace.size()) != kMetaspace) return true;
  }
  return false;
}

// Reads an optional string option that we support only when null or empty.
absl::Status RequireEmptyOption(const Json& config, std::string_view key) {
  const Json* v = Field(config, key);
  if (v == nullptr || v->is_null() || (v->is_string() && v->get_ref<const std::string&>().empty())) {
    return absl::OkStatus();
  }
  return Unsupported(kWhere, absl::StrCat("BPE ", Sv(key), " ", v->dump()));
}

}  // namespace

// ---- WordCache -------------------------------------------------------------------------------

bool BpeModel::WordCache::Lookup(std::string_view word, std::vector<int32_t>* ids) const {
  Shard& shard = shards_[StringViewHash{}(word) % kShards];
  std::lock_guard<std::mutex> lock(shard.mu);
  auto it = shard.words.find(word);
  if (it == shard.words.end()) return false;
  ids->insert(ids->end(), it->second.begin(), it->second.end());
  return true;
}

void BpeModel::WordCache::Insert(std::string_view word, const std::vector<int32_t>& ids) const {
  Shard& shard = shards_[StringViewHash{}(word) % kShards];
  std::lock_guard<std::mutex> lock(shard.mu);
  if (shard.words.size() >= kShardCapacity) shard.words.clear();
  shard.words.try_emplace(word, ids.begin(), ids.end());
}

// ---- Loading ---------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<BpeModel>> BpeModel::FromJson(const Json& config, bool byte_level) {
  absl::StatusOr<std::string> type = ComponentType(config, kWhere);
  if (!type.ok()) return type.status();
  if (*type != "BPE") return Unsupported(kWhere, absl::StrCat("type '", *type, "'"));

  std::unique_ptr<BpeModel> m(new BpeModel());
  m->byte_level_ = byte_level;

  // Options.
  if (const Json* dropout = Field(config, "dropout"); dropout != nullptr && !dropout->is_null()) {
    if (!dropout->is_number()) return Malformed(kWhere, "'dropout' must be a number or null");
    if (dropout->get<double>() != 0.0) return Unsupported(kWhere, "BPE dropout (non-deterministic encoding)");
  }
  SHARDSERVE_RETURN_IF_ERROR(RequireEmptyOption(config, "continuing_subword_prefix"));
  SHARDSERVE_RETURN_IF_ERROR(RequireEmptyOption(config, "end_of_word_suffix"));
  absl::StatusOr<bool> fuse_unk = GetBool(config, "fuse_unk", false, kWhere);
  absl::StatusOr<bool> byte_fallback = GetBool(config, "byte_fallback", false, kWhere);
  absl::StatusOr<bool> ignore_merges = GetBool(config, "ignore_merges", false, kWhere);
  for (const auto* b : {&fuse_unk, &byte_fallback, &ignore_merges}) {
    if (!b->ok()) return b->status();
  }
  m->fuse_unk_ = *fuse_unk;
  m->byte_fallback_ = *byte_fallback;
  m->ignore_merges_ = *ignore_merges;

  // Vocabulary.
  const Json* vocab = Field(config, "vocab");
  if (vocab == nullptr || !vocab->is_object()) return Malformed(kWhere, "'vocab' must be an object");
  m->vocab_.reserve(vocab->size());
  for (auto it = vocab->begin(); it != vocab->end(); ++it) {
    if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 || it.value().get<int64_t>() >= kMaxTokenId) {
      return Malformed(kWhere,
                       absl::StrCat("vocab id of '", it.key(), "' must be an integer in [0, ", kMaxTokenId, ")"));
    }
    m->vocab_[it.key()] = static_cast<int32_t>(it.value().get<int64_t>());
  }
  auto find = [&](std::string_view token) -> int32_t {
    auto it = m->vocab_.find(token);
    return it == m->vocab_.end() ? -1 : it->second;
  };

  if (const Json* unk = Field(config, "unk_token"); unk != nullptr && !unk->is_null()) {
    if (!unk->is_string()) return Malformed(kWhere, "'unk_token' must be a string or null");
    m->unk_id_ = find(unk->get_ref<const std::string&>());
    if (m->unk_id_ < 0) {
      return Malformed(kWhere,
                       absl::StrCat("unk_token '", unk->get_ref<const std::string&>(), "' is not in the vocab"));
    }
  }
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    m->fallback_ids_[b] = find(name);
    std::string unit;
    if (byte_level) {
      AppendUtf8(ByteToChar()[b], &unit);
    } else if (b < 0x80) {
      unit.push_back(static_cast<char>(b));
    }
    m->unit_ids_[b] = unit.empty() ? -1 : find(unit);
  }
  if (byte_level && m->ignore_merges_) {
    // Whole-word lookups happen on raw bytes: map each token back from GPT-2's alphabet.
    for (const auto& [token, id] : m->vocab_) {
      std::string bytes;
      bool in_alphabet = true;
      for (size_t i = 0; i < token.size() && in_alphabet;) {
        size_t len;
        const int byte = CharToByte(DecodeUtf8(token, i, &len));
        in_alphabet = byte >= 0;
        bytes.push_back(static_cast<char>(byte));
        i += len;
      }
      if (in_alphabet) m->byte_vocab_.emplace(std::move(bytes), id);
    }
  }

  // Merges: ["a b", ...] (older files) or [["a", "b"], ...]; the rank is the position.
  absl::StatusOr<const Json*> merges = GetArray(config, "merges", kWhere);
  if (!merges.ok()) return merges.status();
  m->merges_.reserve((*merges)->size());
  m->cut_before_metaspace_ = !byte_level && m->vocab_.contains(kMetaspace);
  uint32_t rank = 0;
  for (const Json& merge : **merges) {
    std::string left, right;
    if (merge.is_string()) {
      const std::string& line = merge.get_ref<const std::string&>();
      const size_t space = line.find(' ');
      if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos) {
        return Malformed(kWhere,
                         absl::StrCat("merge ", rank, " '", line, "' must be two tokens separated by one space"));
      }
      left = line.substr(0, space);
      right = line.substr(space + 1);
    } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string()) {
      left = merge[0].get<std::string>();
      right = merge[1].get<std::string>();
    } else {
      return Malformed(kWhere, absl::StrCat("merge ", rank, " must be \"a b\" or [\"a\", \"b\"]"));
    }
    const int32_t left_id = find(left), right_id = find(right), merged_id = find(left + right);
    if (left_id < 0 || right_id < 0 || merged_id < 0) {
      return Malformed(
          kWhere, absl::StrCat("merge ", rank, " ('", left, "', '", right, "') uses a token that is not in the vocab"));
    }
    m->merges_.insert_or_assign(PairKey(left_id, right_id), Merge{rank, merged_id});  // a later duplicate wins
    if (m->cut_before_metaspace_ && HasInnerMetaspace(left + right)) m->cut_before_metaspace_ = false;
    ++rank;
  }
  return m;
}

absl::StatusOr<std::unique_ptr<BpeModel>> BpeModel::FromRanks(const std::vector<std::string>& tokens) {
  constexpr std::string_view kRanks = "tiktoken.model";
  if (static_cast<int64_t>(tokens.size()) >= kMaxTokenId) {
    return Malformed(kRanks, absl::StrCat("holds ", tokens.size(), " ranks; at most ", kMaxTokenId - 1, " are read"));
  }
  std::unique_ptr<BpeModel> m(new BpeModel());
  m->byte_level_ = true;
  m->ignore_merges_ = true;
  m->byte_vocab_.reserve(tokens.size());
  m->vocab_.reserve(tokens.size());
  for (size_t r = 0; r < tokens.size(); ++r) {
    if (tokens[r].empty()) return Malformed(kRanks, absl::StrCat("rank ", r, " is an empty token"));
    auto [it, inserted] = m->byte_vocab_.try_emplace(tokens[r], static_cast<int32_t>(r));
    if (!inserted) return Malformed(kRanks, absl::StrCat("ranks ", it->second, " and ", r, " are the same bytes"));
    std::string text;  // the token in GPT-2's byte-to-character alphabet, as tokenizer.json spells it
    for (char c : tokens[r]) AppendUtf8(ByteToChar()[static_cast<uint8_t>(c)], &text);
    m->vocab_.emplace(std::move(text), static_cast<int32_t>(r));
  }
  m->fallback_ids_.fill(-1);
  for (int b = 0; b < 256; ++b) {
    auto it = m->byte_vocab_.find(std::string(1, static_cast<char>(b)));
    if (it == m->byte_vocab_.end()) {
      char hex[8];
      std::snprintf(hex, sizeof(hex), "0x%02X", b);
      return Malformed(kRanks, absl::StrCat("byte ", hex, " is not a token, so text holding it cannot be encoded"));
    }
    m->unit_ids_[b] = it->second;
  }
  // Every split of a token into two tokens is a merge of the token's rank.
  for (size_t r = 0; r < tokens.size(); ++r) {
    const std::string_view token = tokens[r];
    for (size_t cut = 1; cut < token.size(); ++cut) {
      auto left = m->byte_vocab_.find(token.substr(0, cut));
      if (left == m->byte_vocab_.end()) continue;
      auto right = m->byte_vocab_.find(token.substr(cut));
      if (right == m->byte_vocab_.end()) continue;
      m->merges_.emplace(PairKey(left->second, right->second), Merge{static_cast<uint32_t>(r), static_cast<int32_t>(r)});
    }
  }
  return m;
}

// ---- Encoding --------------------------------------------------------------------------------

void BpeModel::InitialSymbols(std::string_view word, Scratch* scratch) const {
  auto& symbols = scratch->symbols;
  symbols.clear();
  auto add = [&](int32_t id) {
    const auto index = static_cast<int32_t>(symbols.size());
    symbols.push_back({id, index - 1, -1});
    if (index > 0) symbols[index - 1].next = index;
  };
  int32_t pending_unk = -1;  // an unk symbol not yet added, so that fuse_unk can extend it
  // One unit (a byte in byte-level mode, else a character) whose vocab id is `id` (-1 if none)
  // and whose text is `text`; the same rules as Hugging Face's BPE::merge_word.
  auto unit = [&](int32_t id, std::string_view text) {
    if (id >= 0) {
      if (pending_unk >= 0) add(pending_unk);
      pending_unk = -1;
      add(id);
      return;
    }
    if (byte_fallback_ &&
        std::all_of(text.begin(), text.end(), [&](char c) { return fallback_ids_[static_cast<uint8_t>(c)] >= 0; })) {
      for (char c : text) add(fallback_ids_[static_cast<uint8_t>(c)]);  // a pending unk stays pending
      return;
    }
    if (unk_id_ < 0) return;  // no unk token: the unit is dropped
    if (pending_unk >= 0 && !fuse_unk_) add(pending_unk);
    pending_unk = unk_id_;
  };

  if (byte_level_) {
    for (char c : word) {
      const auto b = static_cast<uint8_t>(c);
      if (unit_ids_[b] >= 0) {
        unit(unit_ids_[b], {});
      } else {
        std::string mapped;  // the byte's character in GPT-2's alphabet, for byte fallback
        AppendUtf8(ByteToChar()[b], &mapped);
        unit(-1, mapped);
      }
    }
  } else {
    for (size_t i = 0; i < word.size();) {
      const auto b = static_cast<uint8_t>(word[i]);
      const size_t len = Utf8Length(b);
      const std::string_view text = word.substr(i, len);
      if (b < 0x80) {
        unit(unit_ids_[b], text);
      } else {
        auto it = vocab_.find(text);
        unit(it == vocab_.end() ? -1 : it->second, text);
      }
      i += len;
    }
  }
  if (pending_unk >= 0) add(pending_unk);
}

void BpeModel::MergeAll(Scratch* scratch) const {
  auto& symbols = scratch->symbols;
  auto& heap = scratch->heap;
  heap.clear();
  // Makes the std:: heap functions keep a min-heap on (rank, pos).
  auto later = [](const Scratch::Candidate& a, const Scratch::Candidate& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  };
  // Appends the merge of the pair (left, right) at `pos` to the heap's storage, if there is one.
  auto add_candidate = [&](int32_t pos, int32_t left, int32_t right) {
    auto it = merges_.find(PairKey(left, right));
    if (it == merges_.end()) return false;
    heap.push_back({it->second.rank, pos, left, right, it->second.merged});
    return true;
  };
  for (size_t i = 0; i + 1 < symbols.size(); ++i) {
    add_candidate(static_cast<int32_t>(i), symbols[i].id, symbols[i + 1].id);
  }
  std::make_heap(heap.begin(), heap.end(), later);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    const Scratch::Candidate top = heap.back();
    heap.pop_back();
    // Skip candidates made stale by earlier merges: the pair must still be there.
    Scratch::Symbol& left = symbols[top.pos];
    if (left.id != top.left || left.next < 0 || symbols[left.next].id != top.right) continue;
    Scratch::Symbol& right = symbols[left.next];
    left.id = top.merged;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = top.pos;
    right.id = -1;
    if (left.prev >= 0 && add_candidate(left.prev, symbols[left.prev].id, left.id)) {
      std::push_heap(heap.begin(), heap.end(), later);
    }
    if (left.next >= 0 && add_candidate(top.pos, left.id, symbols[left.next].id)) {
      std::push_heap(heap.begin(), heap.end(), later);
    }
  }
  scratch->ids.clear();
  // Symbol 0 is never merged away: merges only remove the right-hand symbol.
  for (int32_t i = symbols.empty() ? -1 : 0; i >= 0; i = symbols[i].next) scratch->ids.push_back(symbols[i].id);
}

void BpeModel::Encode(std::string_view word, Scratch* scratch, std::vector<int32_t>* ids) const {
  if (ignore_merges_) {
    const auto& whole_words = byte_level_ ? byte_vocab_ : vocab_;
    if (auto it = whole_words.find(word); it != whole_words.end()) {
      ids->push_back(it->second);
      return;
    }
  }
  if (!cut_before_metaspace_) {
    EncodeWithMerges(word, scratch, ids);
    return;
  }
  // Cut before each "▁" that follows another character; no merge crosses those places.
  size_t start = 0;
  for (size_t p = word.find(kMetaspace, 1); p != std::string_view::npos; p = word.find(kMetaspace, p + 1)) {
    if (p >= kMetaspace.size() && word.substr(p - kMetaspace.size(), kMetaspace.size()) == kMetaspace) continue;
    EncodeWithMerges(word.substr(start, p - start), scratch, ids);
    start = p;
  }
  EncodeWithMerges(word.substr(start), scratch, ids);
}

void BpeModel::EncodeWithMerges(std::string_view word, Scratch* scratch, std::vector<int32_t>* ids) const {
  const bool cacheable = word.size() < kMaxCachedWordBytes;
  if (cacheable && cache_.Lookup(word, ids)) return;
  InitialSymbols(word, scratch);
  MergeAll(scratch);
  ids->insert(ids->end(), scratch->ids.begin(), scratch->ids.end());
  if (cacheable) cache_.Insert(word, scratch->ids);
}

}  // namespace shardserve::tokenizer_internal
