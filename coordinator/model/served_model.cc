#include "coordinator/model/served_model.h"

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "base/json.h"
#include "base/status_macros.h"
#include "nlohmann/json.hpp"

namespace shardserve {
namespace {

namespace fs = std::filesystem;

// generation_config.json's eos_token_id, when the file exists (ParseGenerationEos).
absl::Status ReadGenerationEos(const fs::path& file, std::vector<int32_t>* ids) {
  std::ifstream in(file);
  if (!in) return absl::OkStatus();  // optional
  std::stringstream text;
  text << in.rdbuf();
  return ParseGenerationEos(text.str(), file.string(), ids);
}

}  // namespace

absl::Status ParseGenerationEos(std::string_view text, const std::string& source, std::vector<int32_t>* ids) {
  SHARDSERVE_ASSIGN_OR_RETURN(const nlohmann::json j, ParseJson<nlohmann::json>(text, source));
  if (!j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(source, " is not a JSON object"));
  }
  if (!j.contains("eos_token_id") || j["eos_token_id"].is_null()) return absl::OkStatus();
  const nlohmann::json& eos = j["eos_token_id"];
  const nlohmann::json list = eos.is_array() ? eos : nlohmann::json::array({eos});
  for (const nlohmann::json& id : list) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": eos_token_id must be a token id or a list of them, got ", eos.dump()));
    }
    ids->push_back(id.get<int32_t>());
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ServedModel>> ServedModel::Open(const std::string& dir, LoadFormat load_format) {
  std::error_code ec;
  const fs::path path = fs::absolute(dir, ec);
  if (ec || !fs::is_directory(path)) {
    return absl::InvalidArgumentError(absl::StrCat("model directory '", dir, "' does not exist"));
  }
  auto m = std::make_unique<ServedModel>();
  m->dir = path.lexically_normal().string();
  m->name = path.lexically_normal().filename().string();
  if (m->name.empty()) m->name = path.lexically_normal().parent_path().filename().string();

  absl::StatusOr<ModelConfig> config = LoadModelConfig(path);
  if (!config.ok()) return config.status();
  if (config->eagle3.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat("'", dir, "' holds an EAGLE-3 head (", config->architecture_name,
                                                   "), not a model to serve: give it as --draft-model with "
                                                   "--speculative eagle3 beside the model it was trained for"));
  }
  m->config = std::move(*config);
  if (load_format == LoadFormat::kAuto) {
    absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(path);
    if (!checkpoint.ok()) return checkpoint.status();
    m->checkpoint = std::move(*checkpoint);
  }

  if (fs::exists(path / "tokenizer.json") || fs::exists(path / "tiktoken.model")) {
    absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::FromDirectory(path.string());
    if (!tokenizer.ok()) return tokenizer.status();
    m->tokenizer = std::move(*tokenizer);
    m->eos_ids = m->tokenizer->eos_ids();
  }
  absl::StatusOr<chat::ChatTemplate> chat_template = chat::ChatTemplate::FromDirectory(path.string());
  if (chat_template.ok()) {
    m->chat_template = std::make_unique<chat::ChatTemplate>(*std::move(chat_template));
  } else {
    m->chat_template_status = chat_template.status();
  }
  for (int64_t id : m->config.eos_token_ids) {
    if (id >= 0 && id <= INT32_MAX) m->eos_ids.push_back(static_cast<int32_t>(id));
  }
  SHARDSERVE_RETURN_IF_ERROR(ReadGenerationEos(path / "generation_config.json", &m->eos_ids));
  std::sort(m->eos_ids.begin(), m->eos_ids.end());
  m->eos_ids.erase(std::unique(m->eos_ids.begin(), m->eos_ids.end()), m->eos_ids.end());
  m->structured = std::make_unique<StructuredOutputCompiler>(
      m->tokenizer.get(), static_cast<int32_t>(m->config.vocab_size), m->eos_ids, kDefaultGrammarCompileTimeout);
  return m;
}

std::string ServedModel::dtype_name() const {
  switch (config.dtype) {
    case DType::kF32: return "float32";
    case DType::kF16: return "float16";
    case DType::kBF16: return "bfloat16";
    case DType::kI32: return "int32";
    case DType::kI8: return "int8";
  }
  return "unknown";
}

std::string ServedModel::NoTokenizer() const {
  return absl::StrCat("the model ", name, " has no tokenizer (", kTokenizerFiles, ")");
}

}  // namespace shardserve
