// A model's chat output, as coordinator/api/openai/http_server.cc splits it (protocol.h's
// OutputSplitter: reasoning.h, then tool_calls.h; harmony.h for gpt-oss). The first byte picks the
// tool-call format by its value mod 9 (hermes, llama3_json, mistral, deepseek_v3, kimi_k2,
// qwen3_coder, none, openai (harmony), glm45; qwen3_coder and glm45 with tools whose parameters have
// types), whether reasoning is parsed and whether the prompt opened it, and the sizes of the
// streamed pieces; the rest is the output.
//
// Invariants: the output streamed in those pieces gives, joined, exactly what it gives whole
// (reasoning, content and calls); every call has a name and arguments that parse as a JSON object.
// With calls streamed as pieces (a streamed answer): each piece begins the next call or adds to
// one begun, and the pieces join to the same calls however the output was cut; where the whole
// answer has the same content and as many calls, they are the same calls. Harmony: its calls in
// pieces are exactly the whole's, and its arguments are the body as written where it is not a
// JSON object (harmony.h), so only its well-formed bodies are held to JSON.
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
  for (auto& p : piece.pieces) {
    if (!p.name.empty()) {
      Check(p.index == static_cast<int>(all->calls.size()), "a call begun out of order");
      all->calls.push_back({std::move(p.name), std::move(p.arguments), std::move(p.id)});
    } else {
      Check(p.index >= 0 && p.index < static_cast<int>(all->calls.size()), "arguments of a call not begun");
      all->calls[p.index].arguments += p.arguments;
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  constexpr ToolCallFormat kFormats[] = {ToolCallFormat::kHermes,     ToolCallFormat::kLlama3Json,
                                         ToolCallFormat::kMistral,    ToolCallFormat::kDeepSeekV3,
                                         ToolCallFormat::kKimiK2,     ToolCallFormat::kQwen3Coder,
                                         ToolCallFormat::kNone,       ToolCallFormat::kHarmony,
                                         ToolCallFormat::kGlm45};
  const ToolCallFormat format = kFormats[data[0] % 9];
  const unsigned mode = data[0] / 9;  // 0 to 28
  const bool reasoning = mode & 1, inside = (mode >> 1) & 1;
  const size_t piece = 1 + (mode >> 2);  // 1 to 8 bytes a piece
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  static const nlohmann::ordered_json* tools = new nlohmann::ordered_json(nlohmann::ordered_json::parse(R"([
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
      "i": {"type": "integer"}, "n": {"type": "number"}, "b": {"type": "boolean"}, "o": {"type": "object"},
      "a": {"type": "array"}, "s": {"type": "string"}, "t": {"type": ["integer", "null"]}}}}}])"));

  // The output whole, and in pieces of `piece` bytes; `incremental`: calls come as pieces.
  const auto split = [&](bool incremental, bool in_pieces) {
    OutputSplitter splitter(reasoning, inside, format, 4, *tools, incremental);
    OutputSplit all;
    if (!in_pieces || text.empty()) Append(&all, splitter.Add(text, /*final=*/true));
    for (size_t pos = 0; in_pieces && pos < text.size(); pos += piece) {
      Append(&all, splitter.Add(text.substr(pos, piece), pos + piece >= text.size()));
    }
    return all;
  };
  const OutputSplit whole = split(false, false);
  const OutputSplit streamed = split(false, true);
  Check(streamed.reasoning == whole.reasoning, "streamed reasoning differs from the whole");
  Check(streamed.content == whole.content, "streamed content differs from the whole");
  Check(streamed.calls == whole.calls, "streamed calls differ from the whole");
  Check(whole.calls.size() <= 4, "more calls than max_calls");
  // Calls streamed as pieces: the same whatever the cut.
  const OutputSplit pieces_whole = split(true, false);
  const OutputSplit pieces = split(true, true);
  Check(pieces.reasoning == pieces_whole.reasoning, "streamed reasoning (calls in pieces) differs from the whole");
  Check(pieces.content == pieces_whole.content, "streamed content (calls in pieces) differs from the whole");
  Check(pieces.calls == pieces_whole.calls, "calls in pieces differ with the cut");
  Check(pieces.reasoning == whole.reasoning, "reasoning differs with calls in pieces");
  for (const auto& c : pieces.calls) Check(!c.name.empty(), "a call in pieces without a name");
  if (format == ToolCallFormat::kHarmony) {
    Check(pieces.content == whole.content, "harmony: content differs with calls in pieces");
    Check(pieces.calls == whole.calls, "harmony: calls in pieces differ from the whole's");
    for (const auto& c : whole.calls) Check(!c.name.empty(), "harmony: a call without a name");
    return 0;
  }
  if (pieces.content == whole.content && pieces.calls.size() == whole.calls.size()) {
    // The same calls; a key written twice is sent twice, which reads as the whole's one.
    for (size_t i = 0; i < whole.calls.size(); ++i) {
      Check(pieces.calls[i].name == whole.calls[i].name, "a call in pieces with another name than the whole's");
      Check(pieces.calls[i].id == whole.calls[i].id, "a call in pieces with another id than the whole's");
      const auto args = nlohmann::ordered_json::parse(pieces.calls[i].arguments, nullptr, false);
      Check(!args.is_discarded() && args.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) ==
                                        whole.calls[i].arguments,
            "calls in pieces join to other arguments than the whole's");
    }
  }
  for (const auto& c : whole.calls) {
    Check(!c.name.empty(), "a call without a name");
    const nlohmann::json args = nlohmann::json::parse(c.arguments, nullptr, false);
    Check(!args.is_discarded() && args.is_object(), "arguments that are not a JSON object");
  }
  return 0;
}
