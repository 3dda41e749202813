// The BPE "model" of tokenizer.json: turns one pre-tokenized word into token ids by applying the
// ranked merges, lowest rank first and leftmost first among equals (Hugging Face's Word::merge_all).
//
// Two modes, chosen by the pre-tokenizer:
//  - byte-level (GPT-2, Llama 3, Qwen2): words are raw bytes. The vocabulary, written in GPT-2's
//    byte-to-character alphabet, is mapped back to bytes at load time, so encoding needs no
//    per-byte character mapping.
//  - character (SentencePiece-style, Llama 2, Mistral): words are UTF-8 text; characters missing
//    from the vocabulary become <0xXX> byte tokens (byte_fallback) or the unk token (fused when
//    fuse_unk).
// Options ignore_merges (a word that is itself in the vocabulary is one token, Llama 3) and
// unk_token are honoured; dropout > 0, continuing_subword_prefix and end_of_word_suffix are
// rejected as Unimplemented.
//
// A cache maps recently seen words (shorter than 256 bytes, as Hugging Face) to their ids.
//
// SentencePiece-style pipelines hand BPE each stretch between added tokens as one long word
// ("▁In▁the▁beginning..."). When no merge can produce a token in which "▁" follows another
// character (checked at load time; true of SentencePiece vocabularies, where "▁" only starts a
// token or continues a run of "▁"), no merge crosses such a place, so the word is cut there and
// the pieces are merged, and cached, separately: the same ids, found faster.
//
// Thread-safety: Encode() may be called from many threads at once. The model is immutable after
// FromJson() except for the cache, which is sharded and guarded by one mutex per shard.
#ifndef SHARDSERVE_COORDINATOR_TOKENIZER_BPE_H_
#define SHARDSERVE_COORDINATOR_TOKENIZER_BPE_H_

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/statusor.h"
#include "coordinator/tokenizer/json_util.h"
#include "coordinator/tokenizer/string_util.h"

namespace shardserve::tokenizer_internal {

class BpeModel {
 public:
  // Working memory of one encode call, reused across its words.
  class Scratch {
   private:
    friend class BpeModel;
    struct Symbol {
      int32_t id;    // token id; -1 once merged into the symbol on its left
      int32_t prev;  // index of the previous live symbol, or -1
      int32_t next;  // index of the next live symbol, or -1
    };
    struct Candidate {
      uint32_t rank;  // merge rank: lower merges first
      int32_t pos;    // index of the left symbol: leftmost first among equal ranks
      int32_t left, right, merged;
    };
    std::vector<Symbol> symbols;
    std::vector<Candidate> heap;
    std::vector<int32_t> ids;
  };

  // Builds the model from tokenizer.json's "model" object. `byte_level` selects the mode.
  static absl::StatusOr<std::unique_ptr<BpeModel>> FromJson(const Json& config, bool byte_level);
  // Builds a byte-level model from tiktoken's mergeable ranks: `tokens[r]` holds the bytes of the
  // token of rank (and id) r. As tiktoken encodes: a word that is a token is that token; otherwise
  // two neighbours merge when their bytes together are a token, lowest rank first, leftmost first
  // among equals. All 256 single bytes must be tokens, and no two ranks the same bytes.
  static absl::StatusOr<std::unique_ptr<BpeModel>> FromRanks(const std::vector<std::string>& tokens);

  BpeModel(const BpeModel&) = delete;
  BpeModel& operator=(const BpeModel&) = delete;

  // Appends the ids of `word` (non-empty; raw bytes in byte-level mode, else UTF-8 text).
  void Encode(std::string_view word, Scratch* scratch, std::vector<int32_t>* ids) const;

  // The vocabulary, token text -> id, as written in tokenizer.json.
  const StringMap<int32_t>& vocab() const { return vocab_; }

 private:
  BpeModel() = default;

  struct Merge {
    uint32_t rank;
    int32_t merged;
  };
  static uint64_t PairKey(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
  }

  // Encodes `word` through the cache and the merges (no ignore_merges lookup).
  void EncodeWithMerges(std::string_view word, Scratch* scratch, std::vector<int32_t>* ids) const;
  // Splits `word` into its initial symbols (bytes or characters, with fallbacks) in scratch.
  void InitialSymbols(std::string_view word, Scratch* scratch) const;
  // Applies the merges to scratch->symbols and writes the resulting ids to scratch->ids.
  void MergeAll(Scratch* scratch) const;

  // Recently seen words -> ids.
  class WordCache {
   public:
    bool Lookup(std::string_view word, std::vector<int32_t>* ids) const;
    void Insert(std::string_view word, const std::vector<int32_t>& ids) const;

   private:
    static constexpr size_t kShards = 64;
    static constexpr size_t kShardCapacity = 2048;  // a full shard is cleared and starts over
    struct Shard {
      // std::mutex rather than absl::Mutex: Debian's Abseil is built with absl::Mutex deadlock
      // detection, which costs about 90 ns per lock against 10 ns, once per word encoded.
      std::mutex mu;
      StringMap<absl::InlinedVector<int32_t, 4>> words ABSL_GUARDED_BY(mu);
    };
    mutable std::array<Shard, kShards> shards_;
  };

  // Constant after FromJson().
  bool byte_level_ = false;
  bool ignore_merges_ = false;
  bool byte_fallback_ = false;
  bool fuse_unk_ = false;
  bool cut_before_metaspace_ = false;  // see the file comment
  int32_t unk_id_ = -1;                // -1: no unk token, unknown characters are dropped (as Hugging Face)
  StringMap<int32_t> vocab_;
  StringMap<int32_t> byte_vocab_;                // byte-level mode: raw bytes -> id
  absl::flat_hash_map<uint64_t, Merge> merges_;  // PairKey(left, right) -> merge
  std::array<int32_t, 256> unit_ids_{};          // byte-level: id of each byte; else: of each ASCII char
  std::array<int32_t, 256> fallback_ids_{};      // id of <0xXX> for each byte, or -1

  WordCache cache_;
};

}  // namespace shardserve::tokenizer_internal

#endif  // SHARDSERVE_COORDINATOR_TOKENIZER_BPE_H_
