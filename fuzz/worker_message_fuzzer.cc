// The coordinator's side of worker.proto, against a hostile worker. The first byte picks what the
// rest is:
//
//   even: a Connect stream, WorkerMessages each varint-length-delimited (at most kMaxMessages), as
//         WorkerControlService::Connect and WorkerPool take them: the first must be a Register
//         (CheckRegister, worker_messages.h); then each StepResult is checked (CheckStepResult) as
//         the answer to an in-flight step whose rows, logprobs and sampling role come from bits of
//         the first byte; a Failure's text is cut to kMaxFailureLength. (Which message the pool
//         takes in which phase is Membership::OnMessage's state machine, tested in
//         tests/worker_pool_test.cc, not here.)
//   odd:  rendezvous calls on a TP 2 x PP 2 group under epoch 1, each an op byte then a
//         varint-length-delimited RendezvousSetRequest or RendezvousGetRequest: op bit 0 Set or
//         Get, op bit 1 Revoke instead, (op >> 2) % 6 whose token: 0-3 the token RendezvousGrants
//         granted worker 0-3 (the fuzzer cannot guess 32 random bytes), 4-5 the request's own
//         token field. Each call runs RendezvousGrants::CheckSet/CheckGet, then
//         RendezvousTable::Set, or Get without waiting, as WorkerControlService does.
//
// Invariants: a Register's refusal is InvalidArgument (FailedPrecondition for another protocol
// version); an accepted one makes a cluster the planner takes (ValidateCluster, with the bandwidth
// the pool assumes when none is reported) and has printable names. A StepResult's refusal is
// InvalidArgument; an accepted one has the expected ids and logprob rows, all in the vocabulary.
// A rendezvous Set is let through only for a key of one of the caller's groups that names the
// caller's rank there (<group>/gloo/[rank_]<rank>, or <group>/nccl/unique_id for rank 0), with
// a token granted and not revoked; a Get only for a key under one of the caller's groups; a key
// keeps its first value (a second Set of another value is AlreadyExists), and a Get returns it.
//
// Seeds: SHARDSERVE_FUZZ_WRITE_SEEDS=DIR worker_message_fuzzer writes the seed corpus into DIR and
// exits. With SHARDSERVE_FUZZ_VERBOSE set, every verdict is printed.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "coordinator/cluster/group.h"
#include "coordinator/planner/cluster.h"
#include "coordinator/cluster/rendezvous_grants.h"
#include "coordinator/cluster/rendezvous_table.h"
#include "coordinator/cluster/worker_messages.h"
#include "fuzz/message_stream.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "shardserve/v1/worker.pb.h"

namespace {

constexpr int kMaxMessages = 64;
constexpr int64_t kVocab = 4096;        // the demo model's
constexpr double kAssumedBandwidth = 20e9;  // what GroupFormation plans with when a worker reports none
constexpr int kWorkers = 4;             // TP 2 x PP 2
using shardserve_fuzz::Say;

void Check(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "worker_message_fuzzer: %s\n", what);
  std::abort();
}

bool Printable(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return c > ' ' && c < 127; });
}

void Stream(uint8_t selector, google::protobuf::io::CodedInputStream* in) {
  // The in-flight step this worker answers.
  const int rows = (selector >> 1) & 7;
  const bool wants_logprobs = (selector >> 4) & 1, sampler = (selector >> 5) & 1;
  const int want_ids = sampler ? rows : 0, want_logprobs = sampler && wants_logprobs ? rows : 0;
  shardserve::v1::WorkerMessage m;
  for (int i = 0; i < kMaxMessages; ++i) {
    if (!shardserve_fuzz::Next(in, &m)) return;
    if (i == 0) {
      if (!m.has_register_()) return;  // refused: the first message must be register
      const shardserve::v1::Register& r = m.register_();
      const absl::Status s = shardserve::CheckRegister(r);
      Say("register", s);
      if (!s.ok()) {
        Check(absl::IsInvalidArgument(s) || absl::IsFailedPrecondition(s), "a refused Register that is not InvalidArgument");
        return;
      }
      for (const std::string* name : {&r.node(), &r.device(), &r.address(), &r.collective_host(), &r.metrics_address()}) {
        Check(Printable(*name) && name->size() <= shardserve::kMaxNameLength, "an accepted name that is not printable");
      }
      shardserve::ClusterSpec c;
      c.gpu = shardserve::GpuSpec{r.device(), static_cast<uint64_t>(r.memory_bytes()),
                                  r.memory_bytes_per_s() == 0 ? kAssumedBandwidth : r.memory_bytes_per_s()};
      c.gpus_per_node = {1};
      c.intra_node_bytes_per_s = 10e9;
      c.inter_node_bytes_per_s = 1.25e9;
      Check(shardserve::ValidateCluster(c).ok(), "an accepted Register the planner does not take");
      continue;
    }
    switch (m.msg_case()) {
      case shardserve::v1::WorkerMessage::kStepResult: {
        const shardserve::v1::StepResult& r = m.step_result();
        const absl::Status s = shardserve::CheckStepResult(r, want_ids, want_logprobs, kVocab);
        Say("step result", s);
        if (!s.ok()) {
          Check(absl::IsInvalidArgument(s), "a refused StepResult that is not InvalidArgument");
          break;
        }
        Check(r.sampled_ids_size() == want_ids && r.logprobs_size() == want_logprobs, "the wrong number of rows");
        for (int32_t id : r.sampled_ids()) Check(id >= 0 && id < kVocab, "a sampled id outside the vocabulary");
        for (const shardserve::v1::RowLogprobs& l : r.logprobs()) {
          Check(l.top_ids_size() == l.top_logprobs_size() && l.top_ids_size() <= 20, "a malformed logprob row");
          for (int32_t id : l.top_ids()) Check(id >= 0 && id < kVocab, "a logprob id outside the vocabulary");
        }
        Check(std::isfinite(r.forward_seconds()) && r.forward_seconds() >= 0, "a timing that is not finite");
        break;
      }
      case shardserve::v1::WorkerMessage::kFailure:
        Check(m.failure().message().substr(0, shardserve::kMaxFailureLength).size() <= shardserve::kMaxFailureLength,
              "a failure kept beyond its length");
        break;
      default:
        break;  // Loaded, Heartbeat, a second Register: the pool's state machine
    }
  }
}

// Whether rank `rank` of `group` may write `key` (an oracle written apart from RendezvousGrants).
bool MayWrite(const std::string& group, int rank, const std::string& key) {
  if (key.size() <= group.size() + 1 || key.compare(0, group.size(), group) != 0 || key[group.size()] != '/') {
    return false;
  }
  std::string rest = key.substr(group.size() + 1);
  if (rest == "nccl/unique_id") return rank == 0;
  if (rest.rfind("gloo/", 0) != 0) return false;
  rest = rest.substr(5);
  if (rest.rfind("rank_", 0) == 0) rest = rest.substr(5);
  if (rest.empty() || rest.size() > 9 || rest.find_first_not_of("0123456789") != std::string::npos) return false;
  return std::stoi(rest) == rank;
}

bool Under(const std::string& group, const std::string& key) {
  return key.size() > group.size() + 1 && key.compare(0, group.size(), group) == 0 && key[group.size()] == '/';
}

void Rendezvous(google::protobuf::io::CodedInputStream* in) {
  static const shardserve::Group group = [] {
    std::vector<shardserve::Member> members;
    for (int i = 0; i < kWorkers; ++i) members.push_back({i, i < 2 ? "n0" : "n1"});
    absl::StatusOr<shardserve::Group> g = shardserve::FormGroup({2, 2}, members, 1);
    Check(g.ok(), "the group does not form");
    return *g;
  }();
  shardserve::RendezvousGrants grants;
  shardserve::RendezvousTable table;
  std::vector<std::string> tokens(kWorkers);
  std::vector<std::vector<shardserve::GroupRank>> groups(kWorkers);
  for (const shardserve::Slot& slot : group.slots) {
    groups[slot.worker] = shardserve::RendezvousGroupsOf(slot);
    tokens[slot.worker] = grants.Grant(slot.worker, "w" + std::to_string(slot.worker), group.epoch, groups[slot.worker]);
  }
  std::set<int> revoked;
  std::map<std::string, std::string> written;  // the first value of each key
  for (int i = 0; i < kMaxMessages; ++i) {
    uint8_t op = 0;
    if (!in->ReadRaw(&op, 1)) return;
    const int who = (op >> 2) % 6;
    if (op & 2) {
      if (who < kWorkers) {
        grants.Revoke(who);
        revoked.insert(who);
      }
      continue;
    }
    const bool set = op & 1;
    shardserve::v1::RendezvousSetRequest set_request;
    shardserve::v1::RendezvousGetRequest get_request;
    if (!shardserve_fuzz::Next(in, set ? static_cast<google::protobuf::MessageLite*>(&set_request) : &get_request)) {
      return;
    }
    const std::string& key = set ? set_request.key() : get_request.key();
    const std::string& own = set ? set_request.token() : get_request.token();
    const std::string& token = who < kWorkers ? tokens[who] : own;
    // Whose grant the token is: a granted worker's, not revoked; or none (a token the fuzzer made).
    int holder = -1;
    for (int w = 0; w < kWorkers; ++w) {
      if (token == tokens[w] && !revoked.count(w)) holder = w;
    }
    if (set) {
      const absl::Status allowed = grants.CheckSet(token, key);
      Say("set", allowed);
      if (!allowed.ok()) {
        Check(absl::IsPermissionDenied(allowed), "a refused Set that is not PermissionDenied");
        continue;
      }
      Check(holder >= 0, "a Set let through without a valid token");
      bool may = false;
      for (const auto& [name, rank] : groups[holder]) may |= MayWrite(name, rank, key);
      Check(may, "a Set let through for a key another rank owns");
      const absl::Status s = table.Set(key, set_request.value());
      Say("table set", s);
      auto it = written.find(key);
      if (s.ok()) {
        Check(it == written.end() || it->second == set_request.value(), "a key written twice with another value");
        written.emplace(key, set_request.value());
      } else {
        Check(absl::IsInvalidArgument(s) || absl::IsAlreadyExists(s) || absl::IsResourceExhausted(s),
              "a refused table Set of an unexpected kind");
        Check(!absl::IsAlreadyExists(s) || (it != written.end() && it->second != set_request.value()),
              "AlreadyExists for a key not written with another value");
      }
    } else {
      const absl::Status allowed = grants.CheckGet(token, key);
      Say("get", allowed);
      if (!allowed.ok()) {
        Check(absl::IsPermissionDenied(allowed), "a refused Get that is not PermissionDenied");
        continue;
      }
      Check(holder >= 0, "a Get let through without a valid token");
      bool member = false;
      for (const auto& [name, rank] : groups[holder]) member |= Under(name, key);
      Check(member, "a Get let through for a key of another group");
      absl::StatusOr<std::string> value = table.Get(key, absl::InfinitePast(), [] { return false; });
      Say("table get", value.status());
      auto it = written.find(key);
      if (it == written.end()) {
        Check(absl::IsDeadlineExceeded(value.status()), "a Get of a key never written that does not time out");
      } else {
        Check(value.ok() && *value == it->second, "a Get that does not return the key's first value");
      }
    }
  }
}

// ---- The seed corpus (SHARDSERVE_FUZZ_WRITE_SEEDS) ----

void WriteSeeds(const std::string& dir) {
  auto write = [&](const std::string& name, const std::string& bytes) { shardserve_fuzz::WriteFile(dir, name, bytes); };
  auto delimited = [](const google::protobuf::MessageLite& m) { return shardserve_fuzz::Delimited(m); };
  shardserve::v1::WorkerMessage reg;
  shardserve::v1::Register* r = reg.mutable_register_();
  r->set_protocol_version(shardserve::kWorkerProtocolVersion);
  r->set_node("node0");
  r->set_device("cpu");
  r->set_memory_bytes(int64_t{8} << 30);
  r->set_address("127.0.0.1:50061");
  r->set_collective_host("127.0.0.1");
  r->set_metrics_address("127.0.0.1:9101");
  shardserve::v1::WorkerMessage loaded;
  loaded.mutable_loaded()->set_weight_bytes(1 << 20);
  loaded.mutable_loaded()->set_kv_blocks(64);
  loaded.mutable_loaded()->set_load_seconds(0.5);
  loaded.mutable_loaded()->set_epoch(1);
  shardserve::v1::WorkerMessage heartbeat;
  heartbeat.mutable_heartbeat();
  // The sampler of a step of 2 rows with logprobs: selector bits rows = 2, logprobs, sampler.
  const uint8_t sampler_selector = (2 << 1) | (1 << 4) | (1 << 5);
  shardserve::v1::WorkerMessage result;
  shardserve::v1::StepResult* s = result.mutable_step_result();
  s->set_step_id(1);
  s->set_epoch(1);
  s->add_sampled_ids(17);
  s->add_sampled_ids(4095);
  s->set_forward_seconds(0.01);
  s->set_collective_seconds(0.001);
  for (int row = 0; row < 2; ++row) {
    shardserve::v1::RowLogprobs* l = s->add_logprobs();
    l->set_logprob(-0.5f);
    l->add_top_ids(17);
    l->add_top_logprobs(-0.5f);
  }
  write("sampler_stream", std::string(1, static_cast<char>(sampler_selector)) + delimited(reg) + delimited(loaded) +
                              delimited(heartbeat) + delimited(result));
  // A worker that does not sample (selector 0: no rows from it), on CUDA with a bandwidth, then a
  // failure.
  r->set_device("cuda:1");
  r->set_memory_bytes(int64_t{80} << 30);
  r->set_memory_bytes_per_s(2e12);
  r->set_spare(true);
  shardserve::v1::WorkerMessage quiet;
  quiet.mutable_step_result()->set_step_id(1);
  quiet.mutable_step_result()->set_epoch(1);
  shardserve::v1::WorkerMessage failure;
  failure.mutable_failure()->set_message("worker w1 (node node0, stage 0, tp rank 1): collective timed out");
  failure.mutable_failure()->set_epoch(1);
  failure.mutable_failure()->set_step_id(2);
  write("cuda_spare_stream", std::string(1, '\0') + delimited(reg) + delimited(quiet) + delimited(failure));

  // Rendezvous: worker 0 (stage 0, tp rank 0) publishes its TP group key and reads its peer's; worker
  // 1 publishes its own; a Get of an unwritten key; worker 3 (stage 1) publishes on the pipeline pair.
  static const shardserve::Group group = [] {
    std::vector<shardserve::Member> members;
    for (int i = 0; i < kWorkers; ++i) members.push_back({i, i < 2 ? "n0" : "n1"});
    return *shardserve::FormGroup({2, 2}, members, 1);
  }();
  auto call = [&](bool set, int who, const std::string& key, const std::string& value) {
    const uint8_t op = static_cast<uint8_t>((who << 2) | (set ? 1 : 0));
    std::string bytes(1, static_cast<char>(op));
    if (set) {
      shardserve::v1::RendezvousSetRequest q;
      q.set_key(key);
      q.set_value(value);
      return bytes + delimited(q);
    }
    shardserve::v1::RendezvousGetRequest q;
    q.set_key(key);
    return bytes + delimited(q);
  };
  const shardserve::Slot& s0 = group.at(0, 0);
  const shardserve::Slot& s1 = group.at(1, 0);
  std::string tp = std::string(1, '\1') + call(true, s0.worker, s0.tp_group + "/gloo/rank_" + std::to_string(s0.tp_rank), "127.0.0.1:40001") +
                   call(true, group.at(0, 1).worker, s0.tp_group + "/gloo/rank_1", "127.0.0.1:40002") +
                   call(false, s0.worker, s0.tp_group + "/gloo/rank_1", "") +
                   call(false, s0.worker, s0.tp_group + "/gloo/rank_9", "");
  write("rendezvous_tp", tp);
  std::string pp = std::string(1, '\1') + call(true, s0.worker, s0.send_group + "/nccl/unique_id", std::string(128, 'x')) +
                   call(false, s1.worker, s1.recv_group + "/nccl/unique_id", "") +
                   call(true, s1.worker, s1.recv_group + "/gloo/1", "127.0.0.1:40003") +
                   std::string(1, static_cast<char>((s1.worker << 2) | 2)) +  // revoke stage 1's worker
                   call(false, s1.worker, s1.recv_group + "/gloo/1", "");
  write("rendezvous_pp_revoke", pp);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  shardserve_fuzz::Initialize(WriteSeeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  google::protobuf::io::ArrayInputStream bytes(data + 1, static_cast<int>(std::min<size_t>(size - 1, INT32_MAX)));
  google::protobuf::io::CodedInputStream in(&bytes);
  if (data[0] % 2 == 0) {
    Stream(data[0], &in);
  } else {
    Rendezvous(&in);
  }
  return 0;
}
