#include "coordinator/tokenizer/tokenizer.h"

#include <algorithm>
#include <exception>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/json.h"
#include "base/status_macros.h"
#include "coordinator/tokenizer/added_vocabulary.h"
#include "coordinator/tokenizer/bpe.h"
#include "coordinator/tokenizer/decoder.h"
#include "coordinator/tokenizer/json_util.h"
#include "coordinator/tokenizer/normalizer.h"
#include "coordinator/tokenizer/pre_tokenizer.h"
#include "coordinator/tokenizer/tiktoken.h"
#include "coordinator/tokenizer/unicode.h"

namespace shardserve {

using tokenizer_internal::AddedToken;
using tokenizer_internal::AddedVocabulary;
using tokenizer_internal::BpeModel;
using tokenizer_internal::ConfigToken;
using tokenizer_internal::Decoder;
using tokenizer_internal::Field;
using tokenizer_internal::Json;
using tokenizer_internal::Malformed;
using tokenizer_internal::Normalizer;
using tokenizer_internal::PieceList;
using tokenizer_internal::PreTokenizer;
using tokenizer_internal::Unsupported;

namespace {

// Reads a file; a missing optional file is an empty string.
absl::StatusOr<std::string> ReadFile(const std::string& path, bool required) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    if (!required) return std::string();
    return absl::NotFoundError(absl::StrCat("cannot open ", path));
  }
  std::ostringstream contents;
  contents << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading ", path));
  return contents.str();
}

absl::StatusOr<std::vector<AddedToken>> ParseAddedTokens(const Json& root) {
  constexpr std::string_view kWhere = "tokenizer.json: added_tokens";
  std::vector<AddedToken> tokens;
  const Json* list = Field(root, "added_tokens");
  if (list == nullptr || list->is_null()) return tokens;
  if (!list->is_array()) return Malformed(kWhere, "must be an array");
  for (const Json& item : *list) {
    AddedToken t;
    const Json* id = Field(item, "id");
    if (id == nullptr || !id->is_number_unsigned() || id->get<uint64_t>() >= (uint64_t{1} << 24)) {
      return Malformed(kWhere, "each token needs an 'id' in [0, 2^24)");
    }
    t.id = static_cast<int32_t>(id->get<uint64_t>());
    SHARDSERVE_RETURN_IF_ERROR(tokenizer_internal::ReadAddedToken(item, kWhere, &t));
    absl::StatusOr<bool> special = tokenizer_internal::GetBool(item, "special", false, kWhere);
    if (!special.ok()) return special.status();
    t.special = *special;
    tokens.push_back(std::move(t));
  }
  return tokens;
}

// The special token ids the post-processor puts before and after the encoded text.
absl::Status ParsePostProcessor(const Json& config, std::vector<int32_t>* prefix, std::vector<int32_t>* suffix) {
  constexpr std::string_view kWhere = "tokenizer.json: post_processor";
  if (config.is_null()) return absl::OkStatus();
  absl::StatusOr<std::string> type = tokenizer_internal::ComponentType(config, kWhere);
  if (!type.ok()) return type.status();
  const std::string where = absl::StrCat(tokenizer_internal::Sv(kWhere), " ", *type);
  if (*type == "ByteLevel") return absl::OkStatus();  // only adjusts offsets
  if (*type == "Sequence") {
    absl::StatusOr<const Json*> items = tokenizer_internal::GetArray(config, "processors", where);
    if (!items.ok()) return items.status();
    for (const Json& item : **items) {
      SHARDSERVE_RETURN_IF_ERROR(ParsePostProcessor(item, prefix, suffix));
    }
    return absl::OkStatus();
  }
  if (*type != "TemplateProcessing") return Unsupported(kWhere, absl::StrCat("type '", *type, "'"));

  // "single": [{"SpecialToken": {"id": "<s>", ...}}, {"Sequence": {"id": "A", ...}}, ...]
  absl::StatusOr<const Json*> single = tokenizer_internal::GetArray(config, "single", where);
  if (!single.ok()) return single.status();
  const Json* specials = Field(config, "special_tokens");
  std::vector<int32_t> before, after;
  bool seen_sequence = false;
  for (const Json& piece : **single) {
    if (const Json* seq = Field(piece, "Sequence"); seq != nullptr) {
      const Json* id = Field(*seq, "id");
      if (id == nullptr || *id != "A" || seen_sequence) return Malformed(where, "'single' must hold sequence A once");
      seen_sequence = true;
      continue;
    }
    const Json* special = Field(piece, "SpecialToken");
    const Json* name = special == nullptr ? nullptr : Field(*special, "id");
    if (name == nullptr || !name->is_string())
      return Malformed(where, "a 'single' piece is not a SpecialToken or Sequence");
    const Json* entry = specials == nullptr ? nullptr : Field(*specials, name->get_ref<const std::string&>());
    const Json* ids = entry == nullptr ? nullptr : Field(*entry, "ids");
    if (ids == nullptr || !ids->is_array()) {
      return Malformed(where, absl::StrCat("special token '", name->get_ref<const std::string&>(), "' has no ids"));
    }
    for (const Json& id : *ids) {
      if (!id.is_number_unsigned() || id.get<uint64_t>() >= (uint64_t{1} << 24))
        return Malformed(where, "bad special token id");
      (seen_sequence ? after : before).push_back(static_cast<int32_t>(id.get<uint64_t>()));
    }
  }
  if (!seen_sequence) return Malformed(where, "'single' has no sequence A");
  // A later processor wraps what the earlier ones produced.
  prefix->insert(prefix->begin(), before.begin(), before.end());
  suffix->insert(suffix->end(), after.begin(), after.end());
  return absl::OkStatus();
}

// tokenizer_config.json's contents parsed; empty (the file absent) gives null.
absl::StatusOr<Json> ParseTokenizerConfig(std::string_view contents) {
  if (contents.empty()) return Json();
  return ParseJson<Json>(contents, "tokenizer_config.json");
}

// generation_config.json's bos_token_id / eos_token_id: an id, a list of ids, or null.
absl::StatusOr<std::vector<int32_t>> ConfigIds(const Json& config, std::string_view key) {
  std::vector<int32_t> ids;
  const Json* v = Field(config, key);
  if (v == nullptr || v->is_null()) return ids;
  const Json list = v->is_array() ? *v : Json::array({*v});
  for (const Json& id : list) {
    if (!id.is_number_unsigned() || id.get<uint64_t>() >= (uint64_t{1} << 24)) {
      return Malformed("generation_config.json",
                       absl::StrCat("'", tokenizer_internal::Sv(key), "' must be a token id or a list of them"));
    }
    ids.push_back(static_cast<int32_t>(id.get<uint64_t>()));
  }
  return ids;
}

}  // namespace

Tokenizer::Tokenizer() = default;
Tokenizer::~Tokenizer() = default;

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromDirectory(const std::string& dir) {
  absl::StatusOr<std::string> tokenizer_json = ReadFile(dir + "/tokenizer.json", /*required=*/false);
  if (!tokenizer_json.ok()) return tokenizer_json.status();
  absl::StatusOr<std::string> config = ReadFile(dir + "/tokenizer_config.json", /*required=*/false);
  if (!config.ok()) return config.status();
  absl::StatusOr<std::string> generation = ReadFile(dir + "/generation_config.json", /*required=*/false);
  if (!generation.ok()) return generation.status();
  if (!tokenizer_json->empty()) return FromJson(*tokenizer_json, *config, *generation);

  absl::StatusOr<std::string> ranks = ReadFile(dir + "/tiktoken.model", /*required=*/false);
  if (!ranks.ok()) return ranks.status();
  if (ranks->empty()) return absl::NotFoundError(absl::StrCat("neither tokenizer.json nor tiktoken.model in ", dir));
  absl::StatusOr<Json> parsed = ParseTokenizerConfig(*config);
  if (!parsed.ok()) return parsed.status();
  std::string class_source;
  if (const std::string file = tokenizer_internal::TiktokenClassFile(*parsed); !file.empty()) {
    absl::StatusOr<std::string> source = ReadFile(dir + "/" + file, /*required=*/false);
    if (!source.ok()) return source.status();
    class_source = *std::move(source);
  }
  return FromTiktokenConfig(*ranks, *parsed, *generation, class_source);
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromTiktoken(std::string_view tiktoken_model,
                                                                   std::string_view tokenizer_config_json,
                                                                   std::string_view generation_config_json,
                                                                   std::string_view class_source) {
  absl::StatusOr<Json> config = ParseTokenizerConfig(tokenizer_config_json);
  if (!config.ok()) return config.status();
  return FromTiktokenConfig(tiktoken_model, *config, generation_config_json, class_source);
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromTiktokenConfig(std::string_view tiktoken_model,
                                                                         const Json& tokenizer_config,
                                                                         std::string_view generation_config_json,
                                                                         std::string_view class_source) try {
  absl::StatusOr<std::vector<std::string>> ranks = tokenizer_internal::ParseTiktokenRanks(tiktoken_model);
  if (!ranks.ok()) return ranks.status();
  absl::StatusOr<tokenizer_internal::TiktokenClass> cls =
      tokenizer_internal::ReadTiktokenClass(tokenizer_config, static_cast<int32_t>(ranks->size()), class_source);
  if (!cls.ok()) return cls.status();

  std::unique_ptr<Tokenizer> t(new Tokenizer());
  t->pre_tokenizer_ = std::move(cls->pre_tokenizer);
  absl::StatusOr<std::unique_ptr<BpeModel>> model = BpeModel::FromRanks(*ranks);
  if (!model.ok()) return model.status();
  t->model_ = *std::move(model);
  absl::StatusOr<std::unique_ptr<Decoder>> decoder = Decoder::FromJson(Json{{"type", "ByteLevel"}});
  if (!decoder.ok()) return decoder.status();
  t->decoder_ = *std::move(decoder);
  SHARDSERVE_RETURN_IF_ERROR(
      t->AddTokensAndIndex(std::move(cls->special_tokens), tokenizer_config, generation_config_json));
  return t;
} catch (const std::exception& e) {
  return absl::InternalError(absl::StrCat("loading tokenizer: ", e.what()));
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(std::string_view tokenizer_json,
                                                               std::string_view tokenizer_config_json,
                                                               std::string_view generation_config_json) try {
  absl::StatusOr<Json> root = ParseJson<Json>(tokenizer_json, "tokenizer.json");
  if (!root.ok()) return root.status();
  if (!root->is_object()) return Malformed("tokenizer.json", "must be a JSON object");
  std::unique_ptr<Tokenizer> t(new Tokenizer());

  if (const Json* n = Field(*root, "normalizer"); n != nullptr && !n->is_null()) {
    absl::StatusOr<std::unique_ptr<Normalizer>> normalizer = Normalizer::FromJson(*n);
    if (!normalizer.ok()) return normalizer.status();
    t->normalizer_ = *std::move(normalizer);
  }
  if (const Json* p = Field(*root, "pre_tokenizer"); p != nullptr && !p->is_null()) {
    absl::StatusOr<std::unique_ptr<PreTokenizer>> pre_tokenizer = PreTokenizer::FromJson(*p);
    if (!pre_tokenizer.ok()) return pre_tokenizer.status();
    t->pre_tokenizer_ = *std::move(pre_tokenizer);
  }
  const Json* model_config = Field(*root, "model");
  if (model_config == nullptr) return Malformed("tokenizer.json", "'model' is missing");
  const bool byte_level = t->pre_tokenizer_ != nullptr && t->pre_tokenizer_->byte_level();
  absl::StatusOr<std::unique_ptr<BpeModel>> model = BpeModel::FromJson(*model_config, byte_level);
  if (!model.ok()) return model.status();
  t->model_ = *std::move(model);
  const Json* decoder_config = Field(*root, "decoder");
  absl::StatusOr<std::unique_ptr<Decoder>> decoder = Decoder::FromJson(decoder_config ? *decoder_config : Json());
  if (!decoder.ok()) return decoder.status();
  t->decoder_ = *std::move(decoder);
  if (const Json* p = Field(*root, "post_processor"); p != nullptr) {
    SHARDSERVE_RETURN_IF_ERROR(ParsePostProcessor(*p, &t->prefix_ids_, &t->suffix_ids_));
  }

  absl::StatusOr<std::vector<AddedToken>> added_tokens = ParseAddedTokens(*root);
  if (!added_tokens.ok()) return added_tokens.status();
  absl::StatusOr<Json> tokenizer_config = ParseTokenizerConfig(tokenizer_config_json);
  if (!tokenizer_config.ok()) return tokenizer_config.status();
  SHARDSERVE_RETURN_IF_ERROR(
      t->AddTokensAndIndex(*std::move(added_tokens), *tokenizer_config, generation_config_json));
  return t;
} catch (const std::exception& e) {
  // The parsers above check types before use; this keeps anything unforeseen inside the library.
  return absl::InternalError(absl::StrCat("loading tokenizer: ", e.what()));
}

absl::Status Tokenizer::AddTokensAndIndex(std::vector<tokenizer_internal::AddedToken> added_tokens,
                                          const Json& tokenizer_config, std::string_view generation_config_json) {
  absl::StatusOr<AddedVocabulary> added = AddedVocabulary::Create(std::move(added_tokens), normalizer_.get());
  if (!added.ok()) return added.status();
  added_ = std::make_unique<AddedVocabulary>(*std::move(added));
  SHARDSERVE_RETURN_IF_ERROR(IndexTokens());
  return ReadBosEos(tokenizer_config, generation_config_json);
}

absl::Status Tokenizer::IndexTokens() {
  // Id -> token: the model's vocabulary, overridden by added tokens (Hugging Face's order).
  int32_t size = 0;
  for (const auto& [token, id] : model_->vocab()) size = std::max(size, id + 1);
  for (const AddedToken& a : added_->tokens()) size = std::max(size, a.id + 1);
  id_to_token_.resize(size);
  has_token_.assign(size, false);
  is_special_.assign(size, false);
  for (const auto& [token, id] : model_->vocab()) {
    id_to_token_[id] = token;
    has_token_[id] = true;
  }
  absl::flat_hash_set<std::string> special_contents;
  for (const AddedToken& a : added_->tokens()) {
    id_to_token_[a.id] = a.content;
    has_token_[a.id] = true;
    added_ids_.try_emplace(a.content, a.id);
    if (a.special) special_contents.insert(a.content);
  }
  for (int32_t id = 0; id < size; ++id) {
    is_special_[id] = has_token_[id] && special_contents.contains(id_to_token_[id]);
  }
  for (const std::vector<int32_t>* ids : {&prefix_ids_, &suffix_ids_}) {
    for (int32_t id : *ids) {
      if (id >= size)
        return Malformed("tokenizer.json: post_processor", absl::StrCat("id ", id, " is out of the vocabulary"));
    }
  }
  return absl::OkStatus();
}

absl::Status Tokenizer::ReadBosEos(const Json& tokenizer_config, std::string_view generation_config_json) {
  // A field absent, or the file absent (null): nothing to set.
  for (const char* key : {"bos_token", "eos_token"}) {
    absl::StatusOr<std::optional<std::string>> token = ConfigToken(Field(tokenizer_config, key), key);
    if (!token.ok()) return token.status();
    if (!token->has_value()) continue;
    std::optional<int32_t> id = TokenToId(**token);
    if (!id.has_value()) {
      return Malformed("tokenizer_config.json", absl::StrCat(key, " '", **token, "' is not in the vocabulary"));
    }
    if (std::string_view(key) == "bos_token") {
      bos_id_ = *id;
    } else {
      eos_ids_.push_back(*id);
    }
  }
  if (!generation_config_json.empty()) {
    absl::StatusOr<Json> config = ParseJson<Json>(generation_config_json, "generation_config.json");
    if (!config.ok()) return config.status();
    absl::StatusOr<std::vector<int32_t>> bos = ConfigIds(*config, "bos_token_id");
    absl::StatusOr<std::vector<int32_t>> eos = ConfigIds(*config, "eos_token_id");
    if (!bos.ok()) return bos.status();
    if (!eos.ok()) return eos.status();
    if (!bos_id_.has_value() && !bos->empty()) bos_id_ = bos->front();
    for (int32_t id : *eos) {
      if (std::find(eos_ids_.begin(), eos_ids_.end(), id) == eos_ids_.end()) eos_ids_.push_back(id);
    }
  }
  return absl::OkStatus();
}

absl::Status CheckUtf8(std::string_view text) {
  if (const size_t bad = tokenizer_internal::FindInvalidUtf8(text); bad != std::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrFormat("not valid UTF-8: byte 0x%02X at offset %d", static_cast<uint8_t>(text[bad]), bad));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> Tokenizer::Encode(std::string_view text, bool add_special_tokens) const {
  if (absl::Status utf8 = CheckUtf8(text); !utf8.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("text is ", utf8.message()));
  }
  PieceList list;
  list.Reset(text);
  SHARDSERVE_RETURN_IF_ERROR(added_->Extract(&list, /*normalized_set=*/false));
  if (normalizer_ != nullptr) {
    std::string piece, scratch;
    absl::Status s = list.Rewrite([&](const tokenizer_internal::Piece&, std::string_view in, std::string* out) {
      piece.assign(in);
      SHARDSERVE_RETURN_IF_ERROR(normalizer_->Normalize(&piece, &scratch));
      out->append(piece);
      return absl::OkStatus();
    });
    if (!s.ok()) return s;
  }
  SHARDSERVE_RETURN_IF_ERROR(added_->Extract(&list, /*normalized_set=*/true));
  if (pre_tokenizer_ != nullptr) {
    SHARDSERVE_RETURN_IF_ERROR(pre_tokenizer_->PreTokenize(&list));
  }

  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + prefix_ids_.size() + suffix_ids_.size() + 1);
  if (add_special_tokens) ids.insert(ids.end(), prefix_ids_.begin(), prefix_ids_.end());
  BpeModel::Scratch scratch;
  for (const tokenizer_internal::Piece& piece : list.pieces()) {
    if (piece.token_id >= 0) {
      ids.push_back(piece.token_id);
    } else {
      model_->Encode(list.PieceText(piece), &scratch, &ids);
    }
  }
  if (add_special_tokens) ids.insert(ids.end(), suffix_ids_.begin(), suffix_ids_.end());
  return ids;
}

std::string Tokenizer::Decode(absl::Span<const int32_t> ids, bool skip_special_tokens) const {
  IncrementalDetokenizer stream(*this, skip_special_tokens);
  std::string text;
  for (int32_t id : ids) text += stream.Add(id);
  text += stream.Finish();
  return text;
}

std::optional<int32_t> Tokenizer::TokenToId(std::string_view token) const {
  if (auto it = added_ids_.find(token); it != added_ids_.end()) return it->second;
  if (auto it = model_->vocab().find(token); it != model_->vocab().end()) return it->second;
  return std::nullopt;
}


std::optional<std::string_view> Tokenizer::IdToToken(int32_t id) const {
  if (id < 0 || id >= vocab_size() || !has_token_[id]) return std::nullopt;
  return id_to_token_[id];
}

std::optional<std::string> Tokenizer::TokenBytes(int32_t id) const {
  const std::optional<std::string_view> token = IdToToken(id);
  if (!token.has_value()) return std::nullopt;
  return decoder_->TokenBytes(*token);
}

// ---- IncrementalDetokenizer ------------------------------------------------------------------

struct IncrementalDetokenizer::State {
  explicit State(const Decoder& decoder) : stream(decoder) {}
  Decoder::Stream stream;
};

IncrementalDetokenizer::IncrementalDetokenizer(const Tokenizer& tokenizer, bool skip_special_tokens,
                                               absl::Span<const int32_t> kept)
    : tokenizer_(tokenizer),
      skip_special_tokens_(skip_special_tokens),
      kept_(kept.begin(), kept.end()),
      state_(std::make_unique<State>(*tokenizer.decoder_)) {}

IncrementalDetokenizer::~IncrementalDetokenizer() = default;

std::string IncrementalDetokenizer::Add(int32_t id) {
  std::string text;
  const std::optional<std::string_view> token = tokenizer_.IdToToken(id);
  if (!token.has_value()) return text;
  if (skip_special_tokens_ && tokenizer_.IsSpecial(id) && !std::binary_search(kept_.begin(), kept_.end(), id)) {
    return text;
  }
  tokenizer_.decoder_->Push(&state_->stream, *token, &text);
  return text;
}

std::string IncrementalDetokenizer::Finish() {
  std::string text;
  tokenizer_.decoder_->Finish(&state_->stream, &text);
  return text;
}

}  // namespace shardserve
