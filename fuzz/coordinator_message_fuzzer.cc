// The worker's side of its control stream, against a hostile coordinator: a sequence of
// CoordinatorMessages (each varint-length-delimited, as protobuf's SerializeDelimitedTo writes
// them; at most kMaxMessages), dispatched by the worker's own NextControlAction
// (worker/control_dispatch.h, what WorkerService::Serve calls) and acted on through the worker's
// own checks and state, against the demo model's config.json (models/demo, loaded once; the
// Assignment's model_path is not opened, no weights are loaded, no kernel runs), or, for an
// Assignment whose model_path is kSlidingModelPath, the same config with Gemma 3's pattern of
// layers (8-token windows in layers 0-2, full attention in layer 3), whose sliding layers may have a
// KV pool of their own (num_sliding_kv_blocks, NewSeq.sliding_block_ids):
//
//   kLoad        CheckLoadable (what StepExecutor::Create checks), then a StepState (the epoch,
//                running batch and step buffers StepExecutor holds)
//   kAdopt       StepState::Adopt against the assignment held (what StepExecutor::Adopt runs
//                before joining the groups)
//   kStep        StepState::Prepare (StepExecutor::Execute's checks before any collective), then
//                CheckStepBatch (what ModelShard::Forward checks first) and CheckTokenMasks (the
//                last stage's sampler)
//   kRegroup     StepState::Regroup (StepExecutor::Regroup's, before joining the groups)
//   the rest     a failure, a refused step, or the end of the stream
//
// What this target keeps itself is what WorkerService keeps between messages: whether this stream
// brought an assignment, the assignment held, and whether a failure is pending (set by a refusal,
// cleared by a load, an adoption or a regroup, as WorkerService::Fail and its handlers do).
//
// Invariants: every refusal is InvalidArgument (FailedPrecondition for an adoption of another
// shard or a step of another epoch); an accepted step is executable without an out-of-range index, checked here again on
// its own terms: equal-length token lists within the limits, token ids in the vocabulary, block
// table entries in [0, num_kv_blocks), each token's cache slot the one its sequence's table gives
// for its position (likewise the sliding layers' tables and slots in their pool, where it exists), positions within the table and max_position_embeddings, logit rows among the
// step's tokens and one sampling row each with penalty ids in the vocabulary.
//
// Seeds: SHARDSERVE_FUZZ_WRITE_SEEDS=DIR coordinator_message_fuzzer writes the seed corpus (valid
// streams for four layouts: prefill, decode, prefix-cached blocks, penalties and logprobs, a prompt
// scored, a regroup, an adoption, a shutdown; and a sliding layers' pool with its tables) into DIR
// and exits. With SHARDSERVE_FUZZ_VERBOSE set, every
// refusal and accepted step is printed (each seed's steps are all accepted).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fuzz/check.h"
#include "fuzz/message_stream.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "model/config.h"
#include "model/step_limits.h"
#include "shardserve/v1/worker.pb.h"
#include "worker/control_dispatch.h"
#include "worker/step_checks.h"
#include "worker/step_state.h"

namespace {

using shardserve_fuzz::Check;

using shardserve::v1::CoordinatorMessage;

constexpr int kMaxMessages = 64;

const shardserve::ModelConfig& Config() {
  static const shardserve::ModelConfig* config = [] {
    absl::StatusOr<shardserve::ModelConfig> c =
        shardserve::LoadModelConfig(std::string(SHARDSERVE_SOURCE_DIR) + "/models/demo");
    if (!c.ok()) {
      std::fprintf(stderr, "coordinator_message_fuzzer: %s\n", std::string(c.status().message()).c_str());
      std::abort();
    }
    return new shardserve::ModelConfig(*c);
  }();
  return *config;
}

// The model_path that selects the demo config with sliding layers beside a full-attention one.
constexpr char kSlidingModelPath[] = "models/demo-sliding";

const shardserve::ModelConfig& SlidingConfig() {
  static const shardserve::ModelConfig* config = [] {
    auto* c = new shardserve::ModelConfig(Config());
    c->layer_window.assign(static_cast<size_t>(c->num_hidden_layers), 8);
    c->layer_window.back() = 0;
    return c;
  }();
  return *config;
}

const shardserve::ModelConfig& ConfigFor(const shardserve::v1::Assignment& a) {
  return a.model_path() == kSlidingModelPath ? SlidingConfig() : Config();
}

void CheckRefusal(const absl::Status& s, bool may_be_precondition = false) {
  shardserve_fuzz::Say("refused", s);
  Check(absl::IsInvalidArgument(s) || (may_be_precondition && absl::IsFailedPrecondition(s)),
        "a refusal that is not InvalidArgument");
}

// The shard a worker holds after a successful load.
struct Shard {
  shardserve::v1::Assignment assignment;
  shardserve::StepLimits limits;
  bool first = false;
  std::unique_ptr<shardserve::StepState> steps;
};

// An accepted step, checked on its own terms: what the kernels index with these vectors.
void CheckAccepted(const Shard& shard, const shardserve::v1::StepPlan& plan) {
  const shardserve::ModelConfig& config = ConfigFor(shard.assignment);
  const shardserve::StepLimits& l = shard.limits;
  const shardserve::StepBatch& b = shard.steps->batch();
  const int64_t n = static_cast<int64_t>(b.positions.size()), width = l.max_blocks_per_seq(), bs = l.block_size;
  Check(n >= 1 && n <= l.max_tokens_per_step, "tokens outside [1, max_tokens_per_step]");
  Check(static_cast<int64_t>(b.token_seq.size()) == n && static_cast<int64_t>(b.slots.size()) == n,
        "token lists of unequal length");
  Check(!shard.first || static_cast<int64_t>(b.token_ids.size()) == n, "token ids of another length");
  Check(b.num_seqs >= 1 && b.num_seqs <= l.max_seqs_per_step && b.num_seqs == plan.row_seq_ids_size(),
        "sequences outside [1, max_seqs_per_step]");
  Check(static_cast<int64_t>(b.block_tables.size()) == b.num_seqs * width, "block tables of the wrong size");
  for (int32_t block : b.block_tables) Check(block >= 0 && block < l.num_kv_blocks, "a block outside the cache");
  for (int64_t t = 0; t < n; ++t) {
    if (shard.first) Check(b.token_ids[t] >= 0 && b.token_ids[t] < config.vocab_size, "a token id outside the vocabulary");
    const int64_t seq = b.token_seq[t], pos = b.positions[t];
    Check(seq >= 0 && seq < b.num_seqs, "a token of no sequence");
    Check(t == 0 || b.token_seq[t - 1] <= seq, "a sequence's tokens not together");
    Check(pos >= 0 && pos < width * bs && pos < config.max_position_embeddings, "a position outside the context");
    const int64_t slot = static_cast<int64_t>(b.block_tables[seq * width + pos / bs]) * bs + pos % bs;
    Check(b.slots[t] == slot, "a cache slot that is not the table's for its position");
    Check(slot >= 0 && slot < l.num_kv_blocks * bs, "a cache slot outside the cache");
    if (l.num_sliding_kv_blocks > 0) {
      const int64_t sliding = static_cast<int64_t>(b.sliding_block_tables[seq * width + pos / bs]) * bs + pos % bs;
      Check(b.sliding_slots[t] == sliding, "a sliding cache slot that is not the sliding table's for its position");
      Check(sliding >= 0 && sliding < l.num_sliding_kv_blocks * bs, "a sliding cache slot outside the sliding pool");
    }
  }
  if (l.num_sliding_kv_blocks > 0) {
    Check(b.sliding_slots.size() == b.slots.size() && b.sliding_block_tables.size() == b.block_tables.size(),
          "sliding slots or tables of another size");
    for (int32_t block : b.sliding_block_tables) {
      Check(block >= 0 && block < l.num_sliding_kv_blocks, "a block outside the sliding pool");
    }
  } else {
    Check(b.sliding_slots.empty() && b.sliding_block_tables.empty(), "sliding slots without a sliding pool");
  }
  Check(static_cast<int>(b.logit_rows.size()) == shard.steps->sampling().size() &&
            static_cast<int64_t>(b.logit_rows.size()) <= l.max_seqs_per_step,
        "logit rows and sampling rows differ");
  for (int32_t r : b.logit_rows) Check(r >= 0 && r < n, "a logit row outside the step");
  for (const shardserve::v1::RowSampling& r : shard.steps->sampling()) {
    Check(r.top_logprobs() >= 0 && r.top_logprobs() <= 20, "top_logprobs outside [0, 20]");
    Check(!r.has_scored_id() || (r.scored_id() >= 0 && r.scored_id() < config.vocab_size && r.logprobs()),
          "a scored row outside the vocabulary or without logprobs");
    for (int32_t id : r.penalty_prompt_ids()) Check(id >= 0 && id < config.vocab_size, "a penalty id outside the vocabulary");
    for (int32_t id : r.penalty_output_ids()) Check(id >= 0 && id < config.vocab_size, "a penalty id outside the vocabulary");
  }
  // The token masks the last stage's sampler would read (constrained decoding).
  std::vector<const uint32_t*> masks;
  const absl::Status masked = shardserve::CheckTokenMasks(plan, static_cast<int64_t>(b.logit_rows.size()), config.vocab_size, &masks);
  if (!masked.ok()) {
    CheckRefusal(masked);
    return;
  }
  Check(masks.size() == b.logit_rows.size(), "a mask list of another length than the logit rows");
  const int64_t words = (config.vocab_size + 31) / 32;
  for (const uint32_t* m : masks) {
    if (m == nullptr) continue;
    Check(m >= plan.mask_words().data() && m + words <= plan.mask_words().data() + plan.mask_words_size(),
          "a mask outside the plan's words");
    bool any = false;
    for (int64_t w = 0; w < words; ++w) any = any || m[w] != 0;
    Check(any, "an accepted mask that allows no token");
  }
}

// ---- The seed corpus (SHARDSERVE_FUZZ_WRITE_SEEDS) ----

shardserve::v1::Assignment SeedAssignment(int stage, int num_stages, int tp_rank, int tp_size, uint64_t epoch) {
  shardserve::v1::Assignment a;
  a.set_worker_id("w" + std::to_string(stage * tp_size + tp_rank));
  a.set_model_path("models/demo");
  a.set_stage(stage);
  a.set_num_stages(num_stages);
  a.set_tp_rank(tp_rank);
  a.set_tp_size(tp_size);
  const int layers = static_cast<int>(Config().num_hidden_layers);
  a.set_first_layer(layers * stage / num_stages);
  a.set_end_layer(layers * (stage + 1) / num_stages);
  if (tp_size > 1) a.set_tp_group("tp-s" + std::to_string(stage) + "-e" + std::to_string(epoch));
  if (stage > 0) a.set_recv_group("pp-" + std::to_string(stage - 1) + "-e" + std::to_string(epoch));
  if (stage + 1 < num_stages) a.set_send_group("pp-" + std::to_string(stage) + "-e" + std::to_string(epoch));
  a.set_collective_timeout_seconds(60);
  shardserve::StepLimits limits{.max_tokens_per_step = 64, .max_seqs_per_step = 4, .block_size = 16,
                                .num_kv_blocks = 32, .max_model_len = 256};
  shardserve::ToProto(limits, a.mutable_limits());
  a.set_epoch(epoch);
  a.set_rendezvous_token("token");
  return a;
}

// A step feeding `count` tokens to each of `rows` (seq id, start position, samples).
struct Row {
  uint64_t seq;
  int start, count;
  bool samples;
};
CoordinatorMessage SeedStep(uint64_t step_id, uint64_t epoch, const std::vector<Row>& rows) {
  CoordinatorMessage m;
  shardserve::v1::StepPlan* p = m.mutable_step();
  p->set_step_id(step_id);
  p->set_epoch(epoch);
  for (const Row& r : rows) {
    p->add_row_seq_ids(r.seq);
    p->add_row_start_positions(r.start);
    p->add_row_num_tokens(r.count);
    p->add_row_samples(r.samples);
    for (int i = 0; i < r.count; ++i) p->add_token_ids(static_cast<int32_t>((r.start + i) * 37 % Config().vocab_size));
  }
  return m;
}

shardserve::v1::NewSeq* AddSeq(CoordinatorMessage* m, uint64_t id, std::vector<int32_t> blocks, int prompt_len) {
  shardserve::v1::NewSeq* s = m->mutable_step()->add_new_seqs();
  s->set_seq_id(id);
  for (int32_t b : blocks) s->add_block_ids(b);
  s->set_prompt_len(prompt_len);
  return s;
}

void WriteSeed(const std::string& dir, const std::string& name, const std::vector<CoordinatorMessage>& stream) {
  std::string bytes;
  for (const CoordinatorMessage& m : stream) bytes += shardserve_fuzz::Delimited(m);
  shardserve_fuzz::WriteFile(dir, name, bytes);
}

void WriteSeeds(const std::string& dir) {
  auto assignment = [](const shardserve::v1::Assignment& a) {
    CoordinatorMessage m;
    *m.mutable_assignment() = a;
    return m;
  };
  CoordinatorMessage shutdown;
  shutdown.mutable_shutdown()->set_reason("the coordinator stops");

  // One stage, TP 1: a prefill that samples, a decode, then a second sequence with penalties and
  // logprobs after the first is freed.
  {
    std::vector<CoordinatorMessage> s{assignment(SeedAssignment(0, 1, 0, 1, 1))};
    CoordinatorMessage prefill = SeedStep(1, 1, {{1, 0, 20, true}});
    AddSeq(&prefill, 1, {0, 1}, 20);
    s.push_back(prefill);
    s.push_back(SeedStep(2, 1, {{1, 20, 1, true}}));
    CoordinatorMessage second = SeedStep(3, 1, {{2, 0, 5, true}});
    second.mutable_step()->add_freed_seq_ids(1);
    shardserve::v1::RowSampling* r = AddSeq(&second, 2, {2}, 5)->mutable_sampling();
    r->set_temperature(0.7f);
    r->set_top_k(40);
    r->set_top_p(0.9f);
    r->set_seed(7);
    r->set_repetition_penalty(1.2f);
    r->set_presence_penalty(0.5f);
    r->set_logprobs(true);
    r->set_top_logprobs(3);
    s.push_back(second);
    s.push_back(SeedStep(4, 1, {{2, 5, 1, true}}));
    s.push_back(shutdown);
    WriteSeed(dir, "single_stage", s);
  }
  // One stage, TP 1: a prompt of 6 tokens scored (prompt log-probabilities), its first chunk at
  // every position, its second at all but the last, which samples.
  {
    std::vector<CoordinatorMessage> s{assignment(SeedAssignment(0, 1, 0, 1, 1))};
    CoordinatorMessage first = SeedStep(1, 1, {{3, 0, 3, false}});
    AddSeq(&first, 3, {0}, 6)->mutable_sampling()->set_prompt_logprobs(2);
    first.mutable_step()->add_row_num_scored(3);
    for (int pos = 1; pos <= 3; ++pos) first.mutable_step()->add_scored_ids(pos * 37 % Config().vocab_size);
    s.push_back(first);
    CoordinatorMessage second = SeedStep(2, 1, {{3, 3, 3, true}});
    second.mutable_step()->add_row_num_scored(2);
    for (int pos = 4; pos <= 5; ++pos) second.mutable_step()->add_scored_ids(pos * 37 % Config().vocab_size);
    s.push_back(second);
    s.push_back(shutdown);
    WriteSeed(dir, "prompt_logprobs", s);
  }
  // The last of two stages, TP rank 0 of 2: a sequence whose first block is shared (prefix cache),
  // blocks appended as it grows, two sequences in one step, then a regroup under epoch 2.
  {
    std::vector<CoordinatorMessage> s{assignment(SeedAssignment(1, 2, 0, 2, 3))};
    CoordinatorMessage first = SeedStep(1, 3, {{5, 16, 4, true}, {6, 0, 3, false}});
    AddSeq(&first, 5, {3, 4}, 20)->set_num_cached_tokens(16);
    AddSeq(&first, 6, {7}, 10);
    s.push_back(first);
    CoordinatorMessage grow = SeedStep(2, 3, {{5, 20, 1, true}, {6, 3, 7, true}});
    shardserve::v1::SeqBlocks* more = grow.mutable_step()->add_appended_blocks();
    more->set_seq_id(6);
    more->add_block_ids(8);
    s.push_back(grow);
    CoordinatorMessage regroup;
    regroup.mutable_regroup()->set_epoch(4);
    regroup.mutable_regroup()->set_tp_group("tp-s1-e4");
    regroup.mutable_regroup()->set_recv_group("pp-0-e4");
    regroup.mutable_regroup()->set_rendezvous_token("token2");
    s.push_back(regroup);
    CoordinatorMessage again = SeedStep(3, 4, {{5, 0, 21, true}});
    AddSeq(&again, 5, {9, 10}, 20);
    s.push_back(again);
    WriteSeed(dir, "last_stage_tp2_regroup", s);
  }
  // The first of two stages: a long prefill in two chunks (the first does not sample).
  {
    std::vector<CoordinatorMessage> s{assignment(SeedAssignment(0, 2, 0, 1, 1))};
    CoordinatorMessage chunk = SeedStep(1, 1, {{9, 0, 64, false}});
    AddSeq(&chunk, 9, {0, 1, 2, 3, 4}, 70);
    s.push_back(chunk);
    s.push_back(SeedStep(2, 1, {{9, 64, 6, true}}));
    WriteSeed(dir, "first_stage_chunked", s);
  }
  // A new coordinator adopts the shard under epoch 2 (another worker id and groups), then a step.
  {
    shardserve::v1::Assignment held = SeedAssignment(0, 1, 0, 1, 1);
    shardserve::v1::Assignment adopt = SeedAssignment(0, 1, 0, 1, 2);
    adopt.set_worker_id("w9");
    adopt.set_adopt(true);
    std::vector<CoordinatorMessage> s{assignment(held), assignment(adopt)};
    CoordinatorMessage step = SeedStep(1, 2, {{1, 0, 3, true}});
    AddSeq(&step, 1, {5}, 3);
    s.push_back(step);
    WriteSeed(dir, "adopt", s);
  }
  // Sliding layers beside a full-attention one, with a pool of 6 blocks of their own: two sequences
  // with both tables, one grown by a block in each, one freed; its sliding blocks taken by a third.
  {
    shardserve::v1::Assignment a = SeedAssignment(0, 1, 0, 1, 1);
    a.set_model_path(kSlidingModelPath);
    a.mutable_limits()->set_num_sliding_kv_blocks(6);
    std::vector<CoordinatorMessage> s{assignment(a)};
    CoordinatorMessage prefill = SeedStep(1, 1, {{1, 0, 20, true}, {2, 0, 6, true}});
    AddSeq(&prefill, 1, {0, 1}, 20)->mutable_sliding_block_ids()->Add(4);
    prefill.mutable_step()->mutable_new_seqs(0)->add_sliding_block_ids(5);
    AddSeq(&prefill, 2, {2}, 6)->add_sliding_block_ids(0);
    s.push_back(prefill);
    CoordinatorMessage grow = SeedStep(2, 1, {{1, 20, 12, true}, {2, 6, 1, true}});
    shardserve::v1::SeqBlocks* more = grow.mutable_step()->add_appended_blocks();
    more->set_seq_id(1);
    more->add_block_ids(3);
    more->add_sliding_block_ids(1);
    s.push_back(grow);
    CoordinatorMessage third = SeedStep(3, 1, {{3, 0, 4, true}});
    third.mutable_step()->add_freed_seq_ids(2);
    AddSeq(&third, 3, {2}, 4)->add_sliding_block_ids(0);
    s.push_back(third);
    s.push_back(shutdown);
    WriteSeed(dir, "sliding_pool", s);
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  Config();
  shardserve_fuzz::Initialize(WriteSeeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  google::protobuf::io::ArrayInputStream bytes(data, static_cast<int>(std::min<size_t>(size, INT32_MAX)));
  google::protobuf::io::CodedInputStream in(&bytes);
  std::unique_ptr<Shard> shard;
  shardserve::v1::Assignment assignment;  // the last one (WorkerService::assignment_)
  bool assigned_this_stream = false, failed = false;
  CoordinatorMessage m;
  for (int i = 0; i < kMaxMessages; ++i) {
    if (!shardserve_fuzz::Next(&in, &m)) break;
    const shardserve::ControlState state{.assigned_this_stream = assigned_this_stream,
                                         .holds_shard = shard != nullptr,
                                         .failed = failed,
                                         .epoch = shard != nullptr ? shard->steps->epoch() : assignment.epoch()};
    switch (shardserve::NextControlAction(state, m)) {
      case shardserve::ControlAction::kSecondAssignment:
      case shardserve::ControlAction::kRegroupWithoutShard:
        failed = true;
        break;
      case shardserve::ControlAction::kAdoptWithoutShard:
        assignment = m.assignment();
        assigned_this_stream = true;
        failed = true;
        break;
      case shardserve::ControlAction::kLoad: {
        shard.reset();  // a load drops the shard held first
        assignment = m.assignment();
        assigned_this_stream = true;
        failed = false;
        const shardserve::ModelConfig& config = ConfigFor(assignment);
        const absl::Status s = shardserve::CheckLoadable(assignment, config);
        if (!s.ok()) {
          CheckRefusal(s);
          failed = true;
          break;
        }
        shard = std::make_unique<Shard>();
        shard->assignment = assignment;
        shard->limits = shardserve::FromProto(assignment.limits());
        shard->first = assignment.stage() == 0;
        shard->steps = std::make_unique<shardserve::StepState>(assignment, config.vocab_size);
        break;
      }
      case shardserve::ControlAction::kAdopt: {
        assigned_this_stream = true;
        const absl::Status s = shard->steps->Adopt(shard->assignment, m.assignment());
        assignment = m.assignment();
        failed = false;
        if (!s.ok()) {
          CheckRefusal(s, /*may_be_precondition=*/true);
          shard.reset();  // the worker drops a shard it cannot serve
          failed = true;
          break;
        }
        shard->assignment = assignment;
        break;
      }
      case shardserve::ControlAction::kStep: {
        const shardserve::v1::StepPlan& plan = m.step();
        absl::Status s = shard->steps->Prepare(plan);
        if (s.ok()) {
          s = shardserve::CheckStepBatch(shard->steps->batch(), shard->limits, ConfigFor(shard->assignment), shard->first);
        }
        if (!s.ok()) {
          // FailedPrecondition: a step of another epoch.
          CheckRefusal(s, /*may_be_precondition=*/plan.epoch() != shard->steps->epoch());
          failed = true;  // the running batch is undefined now: no more steps until a regroup
          break;
        }
        CheckAccepted(*shard, plan);
        shardserve_fuzz::Say("accepted step", absl::OkStatus());
        break;
      }
      case shardserve::ControlAction::kRefuseStep:
        break;  // answered with the failure, nothing checked
      case shardserve::ControlAction::kRegroup: {
        const shardserve::v1::Regroup& r = m.regroup();
        const absl::Status s = shard->steps->Regroup(shard->assignment, r);
        failed = false;
        if (!s.ok()) {
          CheckRefusal(s);
          failed = true;
          break;
        }
        // WorkerService's copy takes the new groups; the executor's (shard->assignment) keeps its
        // own, its epoch being the StepState's.
        assignment.set_epoch(r.epoch());
        assignment.set_tp_group(r.tp_group());
        assignment.set_send_group(r.send_group());
        assignment.set_recv_group(r.recv_group());
        break;
      }
      case shardserve::ControlAction::kShutdown:
      case shardserve::ControlAction::kRefused:
      case shardserve::ControlAction::kLetGo:
        return 0;
      case shardserve::ControlAction::kIgnore:
        break;
    }
  }
  return 0;
}
