#include "coordinator/tokenizer/added_vocabulary.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "coordinator/tokenizer/unicode.h"

namespace shardserve::tokenizer_internal {

absl::Status ReadAddedToken(const Json& item, std::string_view where, AddedToken* token) {
  absl::StatusOr<std::string> content = GetString(item, "content", where);
  if (!content.ok()) return content.status();
  token->content = *std::move(content);
  const std::pair<const char*, bool*> flags[] = {{"single_word", &token->single_word},
                                                 {"lstrip", &token->lstrip},
                                                 {"rstrip", &token->rstrip},
                                                 {"normalized", &token->normalized}};
  for (const auto& [key, flag] : flags) {
    absl::StatusOr<bool> value = GetBool(item, key, false, where);
    if (!value.ok()) return value.status();
    *flag = *value;
  }
  return absl::OkStatus();
}
namespace {

// The character that ends text[0, end), which must be non-empty valid UTF-8.
char32_t LastChar(std::string_view text, size_t end) {
  size_t start = end - 1;
  while (start > 0 && (static_cast<uint8_t>(text[start]) & 0xC0) == 0x80) --start;
  size_t len;
  return DecodeUtf8(text, start, &len);
}

// Start of the run of whitespace that ends text[0, end).
size_t WhitespaceRunBefore(std::string_view text, size_t end) {
  while (end > 0) {
    size_t start = end - 1;
    while (start > 0 && (static_cast<uint8_t>(text[start]) & 0xC0) == 0x80) --start;
    size_t len;
    if (!IsWhitespace(DecodeUtf8(text, start, &len))) break;
    end = start;
  }
  return end;
}

// End of the run of whitespace that starts at text[begin].
size_t WhitespaceRunAfter(std::string_view text, size_t begin) {
  while (begin < text.size()) {
    size_t len;
    if (!IsWhitespace(DecodeUtf8(text, begin, &len))) break;
    begin += len;
  }
  return begin;
}

}  // namespace

void AddedVocabulary::Trie::Insert(std::string_view key, int32_t token) {
  int32_t node = 0;
  for (char c : key) {
    const auto byte = static_cast<uint8_t>(c);
    auto& children = nodes[node].children;
    auto it = std::lower_bound(children.begin(), children.end(), std::make_pair(byte, int32_t{-1}));
    if (it != children.end() && it->first == byte) {
      node = it->second;
      continue;
    }
    const auto child = static_cast<int32_t>(nodes.size());
    children.insert(it, {byte, child});
    nodes.emplace_back();  // invalidates `children`, which is not used again
    node = child;
  }
  if (nodes[node].token < 0) nodes[node].token = token;  // the first of duplicate contents wins
  first_byte[static_cast<uint8_t>(key.front())] = true;
}

size_t AddedVocabulary::Trie::LongestAt(std::string_view text, size_t at, int32_t* token) const {
  size_t longest = 0;
  int32_t node = 0;
  for (size_t i = at; i < text.size(); ++i) {
    const auto byte = static_cast<uint8_t>(text[i]);
    const auto& children = nodes[node].children;
    auto it = std::lower_bound(children.begin(), children.end(), std::make_pair(byte, int32_t{-1}));
    if (it == children.end() || it->first != byte) break;
    node = it->second;
    if (nodes[node].token >= 0) {
      longest = i + 1 - at;
      *token = nodes[node].token;
    }
  }
  return longest;
}

absl::StatusOr<AddedVocabulary> AddedVocabulary::Create(std::vector<AddedToken> tokens, const Normalizer* normalizer) {
  AddedVocabulary vocab;
  vocab.tokens_ = std::move(tokens);
  std::string scratch;
  for (size_t i = 0; i < vocab.tokens_.size(); ++i) {
    const AddedToken& token = vocab.tokens_[i];
    if (token.content.empty()) continue;  // Hugging Face ignores empty added tokens
    if (!token.normalized || normalizer == nullptr) {
      (token.normalized ? vocab.normalized_ : vocab.raw_).Insert(token.content, static_cast<int32_t>(i));
      continue;
    }
    std::string form = token.content;
    if (absl::Status s = normalizer->Normalize(&form, &scratch); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("normalizing added token '", token.content, "': ", s.message()));
    }
    if (!form.empty()) vocab.normalized_.Insert(form, static_cast<int32_t>(i));
  }
  return vocab;
}

absl::Status AddedVocabulary::Extract(PieceList* list, bool normalized_set) const {
  const Trie& trie = normalized_set ? normalized_ : raw_;
  if (trie.nodes.size() == 1) return absl::OkStatus();  // no tokens in this set
  return list->Split([&](const Piece& piece, PieceList::Emit emit) -> absl::Status {
    const std::string_view text = list->PieceText(piece);
    size_t done = 0;  // end of the last token taken
    size_t pos = 0;   // where the automaton resumes: after the last match, taken or not
    while (pos < text.size()) {
      if (!trie.first_byte[static_cast<uint8_t>(text[pos])]) {
        ++pos;
        continue;
      }
      int32_t index = -1;
      const size_t length = trie.LongestAt(text, pos, &index);
      if (length == 0) {
        ++pos;
        continue;
      }
      size_t start = pos, stop = pos + length;
      pos = stop;
      const AddedToken& token = tokens_[index];
      if (token.single_word) {
        const bool word_before = start > 0 && IsWordChar(LastChar(text, start));
        size_t len;
        const bool word_after = stop < text.size() && IsWordChar(DecodeUtf8(text, stop, &len));
        if (word_before || word_after) continue;
      }
      // Whitespace already taken by the previous token's rstrip stays with it.
      if (token.lstrip) start = std::max(WhitespaceRunBefore(text, start), done);
      if (token.rstrip) stop = WhitespaceRunAfter(text, stop);
      if (done < start) emit(piece.begin + done, piece.begin + start, -1);
      emit(piece.begin + start, piece.begin + stop, token.id);
      done = stop;
    }
    if (done < text.size()) emit(piece.begin + done, piece.begin + text.size(), -1);
    return absl::OkStatus();
  });
}

}  // namespace shardserve::tokenizer_internal
