// shardserve generate: streams a completion from a running coordinator, printing text as it
// arrives.
#include <chrono>
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "shardserve/v1/inference.grpc.pb.h"
#include "tools/cli/client.h"
#include "tools/cli/command.h"
#include "base/flags.h"

namespace shardserve::cli {
namespace {

constexpr char kUsage[] =
    "usage: shardserve generate [--address HOST:PORT] (--prompt TEXT | --prompt-ids 1,2,3) [--max-tokens N]\n"
    "                           [--temperature T] [--top-k K] [--top-p P] [--seed S] [--stop STR] [--ignore-eos]\n"
    "                           [--min-p P] [--repetition-penalty R] [--presence-penalty X]\n"
    "                           [--frequency-penalty X] [--logprobs N] [--show-ids] [--deadline-seconds S]\n"
    "                           [--tls-ca FILE] [--tls-cert FILE --tls-key FILE] [--api-key KEY] [--insecure]\n"
    "  Streams a completion from the coordinator (default localhost:50051). Text goes to stdout as it\n"
    "  arrives; the finish reason, token usage and speed go to stderr. --logprobs N prints each token's\n"
    "  log-probability and its N most likely alternatives to stderr (N = 0: the token's only).\n";

const std::string kFullUsage = std::string(kUsage) + kClientFlagsUsage;

int Run(const std::vector<std::string>& args) {
  absl::StatusOr<Flags> flags =
      Flags::Parse(args, [] {
        std::set<std::string> names = {"prompt", "prompt-ids", "max-tokens", "temperature", "top-k", "top-p", "seed",
                                       "stop", "deadline-seconds", "min-p", "repetition-penalty", "presence-penalty",
                                       "frequency-penalty", "logprobs"};
        names.merge(ClientFlagNames());
        return names;
      }(), {"ignore-eos", "show-ids", "help", kInsecureFlag});
  if (!flags.ok()) {
    std::fprintf(stderr, "shardserve generate: %s\n%s", std::string(flags.status().message()).c_str(), kUsage);
    return 2;
  }
  if (flags->Has("help")) {
    std::printf("%s", kFullUsage.c_str());
    return 0;
  }
  v1::GenerateRequest req;
  if (flags->Has("prompt") == flags->Has("prompt-ids")) {
    std::fprintf(stderr, "shardserve generate: give exactly one of --prompt and --prompt-ids\n%s", kUsage);
    return 2;
  }
  if (flags->Has("prompt")) {
    req.set_text(flags->Get("prompt"));
  } else {
    for (absl::string_view piece : absl::StrSplit(flags->Get("prompt-ids"), ',', absl::SkipEmpty())) {
      int32_t id;
      if (!absl::SimpleAtoi(piece, &id)) {
        std::fprintf(stderr, "shardserve generate: --prompt-ids: '%s' is not a token id\n", std::string(piece).c_str());
        return 2;
      }
      req.mutable_token_ids()->add_ids(id);
    }
  }
  v1::SamplingParams* s = req.mutable_sampling();
  absl::StatusOr<int64_t> max_tokens = flags->GetInt("max-tokens", 64), top_k = flags->GetInt("top-k", 0);
  absl::StatusOr<double> temperature = flags->GetDouble("temperature", 0), top_p = flags->GetDouble("top-p", 1),
                         deadline = flags->GetDouble("deadline-seconds", 600), min_p = flags->GetDouble("min-p", 0),
                         repetition = flags->GetDouble("repetition-penalty", 1),
                         presence = flags->GetDouble("presence-penalty", 0),
                         frequency = flags->GetDouble("frequency-penalty", 0);
  absl::StatusOr<int64_t> logprobs = flags->GetInt("logprobs", 0);
  for (const absl::Status& st : {max_tokens.status(), top_k.status(), temperature.status(), top_p.status(),
                                 deadline.status(), min_p.status(), repetition.status(), presence.status(),
                                 frequency.status(), logprobs.status()}) {
    if (!st.ok()) {
      std::fprintf(stderr, "shardserve generate: %s\n", std::string(st.message()).c_str());
      return 2;
    }
  }
  s->set_max_tokens(static_cast<int32_t>(*max_tokens));
  s->set_temperature(static_cast<float>(*temperature));
  s->set_top_k(static_cast<int32_t>(*top_k));
  s->set_top_p(static_cast<float>(*top_p));
  s->set_min_p(static_cast<float>(*min_p));
  s->set_repetition_penalty(static_cast<float>(*repetition));
  s->set_presence_penalty(static_cast<float>(*presence));
  s->set_frequency_penalty(static_cast<float>(*frequency));
  if (flags->Has("logprobs")) {
    s->set_logprobs(true);
    s->set_top_logprobs(static_cast<int32_t>(*logprobs));
  }
  if (flags->Has("seed")) {
    absl::StatusOr<int64_t> seed = flags->GetInt("seed", 0);
    if (!seed.ok()) {
      std::fprintf(stderr, "shardserve generate: %s\n", std::string(seed.status().message()).c_str());
      return 2;
    }
    s->set_seed(static_cast<uint64_t>(*seed));
  }
  if (flags->Has("stop")) s->add_stop(flags->Get("stop"));
  s->set_ignore_eos(flags->Has("ignore-eos"));

  const absl::StatusOr<ClientOptions> client = ClientOptionsFromFlags(*flags);
  if (!client.ok()) {
    std::fprintf(stderr, "shardserve generate: %s\n", std::string(client.status().message()).c_str());
    return 2;
  }
  const std::string& address = client->address;
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = ConnectToCoordinator(*client);
  if (!channel.ok()) {
    std::fprintf(stderr, "shardserve generate: %s\n", std::string(channel.status().message()).c_str());
    return 1;
  }
  auto stub = v1::InferenceService::NewStub(*channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(*deadline * 1000)));
  const auto start = std::chrono::steady_clock::now();
  auto reader = stub->Generate(&ctx, req);
  v1::GenerateResponse resp;
  const bool show_ids = flags->Has("show-ids");
  double first_token_s = -1;
  while (reader->Read(&resp)) {
    if (first_token_s < 0 && resp.token_ids_size() > 0) {
      first_token_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    if (show_ids) {
      for (int32_t id : resp.token_ids()) std::printf("[%d]", id);
    }
    std::fwrite(resp.text().data(), 1, resp.text().size(), stdout);
    std::fflush(stdout);
    for (const v1::TokenLogprobs& l : resp.logprobs()) {
      std::fprintf(stderr, "[%d: %.4f", l.token_id(), l.logprob());
      for (const v1::TopLogprob& t : l.top_logprobs()) std::fprintf(stderr, " | %d: %.4f", t.token_id(), t.logprob());
      std::fprintf(stderr, "]\n");
    }
    if (resp.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::fprintf(stderr, "\n[finish: %s, prompt tokens %d, completion tokens %d, first token %.3f s, %.1f tokens/s]\n",
                   v1::FinishReason_Name(resp.finish_reason()).c_str(), resp.usage().prompt_tokens(),
                   resp.usage().completion_tokens(), first_token_s,
                   total > 0 ? resp.usage().completion_tokens() / total : 0.0);
    }
  }
  grpc::Status status = reader->Finish();
  if (!status.ok()) {
    const bool unavailable = status.error_code() == grpc::StatusCode::UNAVAILABLE;
    std::fprintf(stderr, "\nshardserve generate: %s: %s (coordinator %s)%s\n",
                 unavailable                                                 ? "UNAVAILABLE"
                 : status.error_code() == grpc::StatusCode::UNAUTHENTICATED ? "UNAUTHENTICATED"
                                                                             : "error",
                 status.error_message().c_str(), address.c_str(),
                 unavailable && !client->tls.any() ? "; if it serves TLS, give --tls-ca (docs/security.md)" : "");
    return 1;
  }
  return 0;
}

const CommandRegistration kRegistration({"generate", "stream a completion from a running coordinator", Run});

}  // namespace
}  // namespace shardserve::cli
