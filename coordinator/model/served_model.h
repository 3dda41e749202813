// The model the coordinator serves, read once at startup from its Hugging Face checkpoint
// directory: config.json, the safetensors headers (the planner counts their bytes; no weight is
// read; none with --load-format dummy), the tokenizer when there is one (tokenizer.json, or
// tiktoken.model as Kimi K2 ships it), the chat template
// (chat_template.jinja or tokenizer_config.json's) when there is one, and the ids that end a
// generation.
//
// Immutable after Open(); every member may be read from any thread.
#ifndef SHARDSERVE_COORDINATOR_MODEL_SERVED_MODEL_H_
#define SHARDSERVE_COORDINATOR_MODEL_SERVED_MODEL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "coordinator/chat/chat_template.h"
#include "coordinator/model/structured_output.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/weight_source.h"

namespace shardserve {

struct ServedModel {
  // Opens the checkpoint at `dir`. Errors name the file: a missing or invalid config.json, a bad
  // safetensors header, a tokenizer this build cannot run, a malformed generation_config.json.
  // A directory without tokenizer.json or tiktoken.model is fine: token-id prompts only.
  // With LoadFormat::kDummy no safetensors are opened (checkpoint stays null: the planner counts
  // the weights from config.json) and the directory may hold config.json alone.
  static absl::StatusOr<std::unique_ptr<ServedModel>> Open(const std::string& dir,
                                                           LoadFormat load_format = LoadFormat::kAuto);

  std::string dir;   // absolute: the workers open the same path
  std::string name;  // the directory's base name
  ModelConfig config;
  std::unique_ptr<Checkpoint> checkpoint;  // null with LoadFormat::kDummy
  std::unique_ptr<Tokenizer> tokenizer;  // null without tokenizer.json or tiktoken.model
  // Null without a chat template, or when the model's cannot be loaded (a template this build's
  // Jinja cannot parse does not stop the model from serving completions): chat_template_status
  // then says which (NOT_FOUND: the model has none).
  std::unique_ptr<chat::ChatTemplate> chat_template;
  absl::Status chat_template_status;
  // config.json's eos_token_id, generation_config.json's and the tokenizer's, sorted, unique.
  std::vector<int32_t> eos_ids;
  // Compiles requests' structured-output constraints against the tokenizer's vocabulary (never
  // null after Open; it refuses every constraint when the token bytes are unknown). Thread-safe.
  std::unique_ptr<StructuredOutputCompiler> structured;

  // config.json's torch_dtype as Hugging Face spells it ("bfloat16").
  std::string dtype_name() const;
  // "the model NAME has no tokenizer (tokenizer.json or tiktoken.model)": the start of every
  // refusal of a request that needs text when the checkpoint has no tokenizer.
  std::string NoTokenizer() const;
};

// generation_config.json's eos_token_id from the file's text, appended to *ids: absent or null (none),
// a token id, or a list of them (each in [0, 2^31)). InvalidArgument naming `source` otherwise,
// or when the text is not a JSON object. What ServedModel::Open runs on the file.
absl::Status ParseGenerationEos(std::string_view text, const std::string& source, std::vector<int32_t>* ids);

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_MODEL_SERVED_MODEL_H_
