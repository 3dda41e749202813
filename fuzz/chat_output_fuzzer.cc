// A model's chat output, as coordinator/api/openai/http_server.cc splits it (protocol.h's
// OutputSplitter: reasoning.h, then tool_calls.h). The first byte picks the tool-call format
// (hermes, llama3_json, mistral, deepseek_v3, qwen3_coder, none; qwen3_coder with tools whose
// parameters have types), whether reasoning is parsed and whether the prompt opened it, and the
// sizes of the streamed pieces; the rest is the output.
//
// Invariants: the output streamed in those pieces gives, joined, exactly what it gives whole
// (reasoning, content and calls); every call has a name and arguments that parse as a JSON object.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "coordinator/api/openai/protocol.h"
#include "nlohmann/json.hpp"

namespace {

using shardserve::openai::OutputSplit;
using shardserve::openai::OutputSplitter;
using shardserve::openai::ToolCallFormat;

void Check(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "chat_output_fuzzer: %s\n", what);
  std::abort();
}

void Append(OutputSplit* all, OutputSplit piece) {
  all->reasoning += piece.reasoning;
  all->content += piece.content;
  for (auto& c : piece.calls) all->calls.push_back(std::move(c));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  constexpr ToolCallFormat kFormats[] = {ToolCallFormat::kHermes,     ToolCallFormat::kLlama3Json,
                                         ToolCallFormat::kMistral,    ToolCallFormat::kDeepSeekV3,
                                         ToolCallFormat::kQwen3Coder, ToolCallFormat::kNone};
  const ToolCallFormat format = kFormats[data[0] % 6];
  const unsigned mode = data[0] / 6;  // 0 to 42
  const bool reasoning = mode & 1, inside = (mode >> 1) & 1;
  const size_t piece = 1 + (mode >> 2);  // 1 to 11 bytes a piece
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  static const nlohmann::ordered_json* tools = new nlohmann::ordered_json(nlohmann::ordered_json::parse(R"([
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
      "i": {"type": "integer"}, "n": {"type": "number"}, "b": {"type": "boolean"}, "o": {"type": "object"},
      "a": {"type": "array"}, "s": {"type": "string"}, "t": {"type": ["integer", "null"]}}}}}])"));

  OutputSplitter whole_splitter(reasoning, inside, format, 4, *tools);
  const OutputSplit whole = whole_splitter.Add(text, /*final=*/true);
  OutputSplitter streamed_splitter(reasoning, inside, format, 4, *tools);
  OutputSplit streamed;
  for (size_t pos = 0; pos < text.size(); pos += piece) {
    Append(&streamed, streamed_splitter.Add(text.substr(pos, piece), pos + piece >= text.size()));
  }
  if (text.empty()) Append(&streamed, streamed_splitter.Add("", true));
  Check(streamed.reasoning == whole.reasoning, "streamed reasoning differs from the whole");
  Check(streamed.content == whole.content, "streamed content differs from the whole");
  Check(streamed.calls == whole.calls, "streamed calls differ from the whole");
  Check(whole.calls.size() <= 4, "more calls than max_calls");
  for (const auto& c : whole.calls) {
    Check(!c.name.empty(), "a call without a name");
    const nlohmann::json args = nlohmann::json::parse(c.arguments, nullptr, false);
    Check(!args.is_discarded() && args.is_object(), "arguments that are not a JSON object");
  }
  return 0;
}
