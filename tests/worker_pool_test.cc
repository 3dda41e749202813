// The coordinator's worker pool (coordinator/cluster/worker_pool.h) without processes: what a
// worker's Register may say (every field is checked where it enters; a bad one refuses the worker
// with InvalidArgument naming the field and the value), and the heal protocol step by step
// (docs/healing.md) with fake workers.
#include "coordinator/cluster/worker_pool.h"

#include <cmath>
#include <filesystem>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardserve {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// A link that keeps what it is sent.
class FakeLink : public WorkerLink {
 public:
  bool Send(const v1::CoordinatorMessage& message) override {
    sent.push_back(message);
    return true;
  }
  void Cancel() override {}
  std::vector<v1::CoordinatorMessage> sent;
};

v1::Register GoodHello() {
  v1::Register h;
  h.set_protocol_version(kWorkerProtocolVersion);
  h.set_node("n0");
  h.set_device("cpu");
  h.set_memory_bytes(int64_t{16} << 30);
  h.set_address("127.0.0.1:1");
  h.set_collective_host("127.0.0.1");
  return h;
}

// A pool of `nodes` x `gpus_per_node` workers serving the llama_gqa fixture (owns its model).
struct TestPool {
  // Shuts the pool down and ends the streams of `workers` (the registered ones still connected).
  void Close(std::initializer_list<int> workers) {
    pool->Shutdown("test over");
    for (int i : workers) pool->Disconnect(i);
  }
  std::unique_ptr<ServedModel> model;
  std::unique_ptr<WorkerPool> pool;
};

TestPool MakePool(int nodes, int gpus_per_node, absl::Duration heartbeat_timeout = absl::Seconds(3)) {
  TestPool t;
  absl::StatusOr<std::unique_ptr<ServedModel>> model =
      ServedModel::Open((fs::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures/models/llama_gqa").string());
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return t;
  t.model = std::move(*model);
  PoolOptions options;
  options.nodes = nodes;
  options.gpus_per_node = gpus_per_node;
  options.limits = StepLimits{64, 8, 16, 0, 0};
  options.heartbeat_timeout = heartbeat_timeout;
  absl::StatusOr<std::unique_ptr<WorkerPool>> pool = WorkerPool::Create(t.model.get(), options);
  EXPECT_TRUE(pool.ok()) << pool.status();
  if (pool.ok()) t.pool = std::move(*pool);
  return t;
}

class WorkerPoolRegisterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Two workers on one node: one good Register does not complete the group.
    TestPool t = MakePool(/*nodes=*/1, /*gpus_per_node=*/2);
    ASSERT_NE(t.pool, nullptr);
    model_ = std::move(t.model);
    pool_ = std::move(t.pool);
  }
  void TearDown() override {
    for (int i : accepted_) pool_->Disconnect(i);
    pool_.reset();
  }
  // Registers `hello`; on success remembers the worker for TearDown.
  absl::StatusOr<int> Register(const v1::Register& hello) {
    absl::StatusOr<int> index = pool_->Register(hello, &link_);
    if (index.ok()) accepted_.push_back(*index);
    return index;
  }

  std::unique_ptr<ServedModel> model_;
  std::unique_ptr<WorkerPool> pool_;
  FakeLink link_;
  std::vector<int> accepted_;
};

TEST_F(WorkerPoolRegisterTest, BadFieldsRefuseTheWorkerNamingTheFieldAndTheValue) {
  struct Case {
    std::string name;
    v1::Register hello;
    std::vector<std::string> expected;  // substrings of the message
  };
  std::vector<Case> cases;
  auto with = [](auto change) {
    v1::Register h = GoodHello();
    change(h);
    return h;
  };
  cases.push_back({"NaN bandwidth",
                   with([](v1::Register& h) { h.set_memory_bytes_per_s(std::numeric_limits<double>::quiet_NaN()); }),
                   {"register.memory_bytes_per_s", "nan"}});
  cases.push_back({"negative bandwidth", with([](v1::Register& h) { h.set_memory_bytes_per_s(-5e9); }),
                   {"register.memory_bytes_per_s", "-5e+09"}});
  cases.push_back({"infinite bandwidth",
                   with([](v1::Register& h) { h.set_memory_bytes_per_s(std::numeric_limits<double>::infinity()); }),
                   {"register.memory_bytes_per_s", "inf"}});
  cases.push_back({"bandwidth below the planner's range", with([](v1::Register& h) { h.set_memory_bytes_per_s(10); }),
                   {"register.memory_bytes_per_s", "got 10"}});
  cases.push_back({"unknown products' dtype",
                   with([](v1::Register& h) { h.set_cpu_matmul(static_cast<v1::CpuMatMulDtype>(7)); }),
                   {"register.cpu_matmul", "got 7"}});
  cases.push_back({"negative memory", with([](v1::Register& h) { h.set_memory_bytes(-1); }),
                   {"register.memory_bytes", "got -1"}});
  cases.push_back({"zero memory", with([](v1::Register& h) { h.set_memory_bytes(0); }),
                   {"register.memory_bytes", "got 0"}});
  cases.push_back({"memory above 2^50", with([](v1::Register& h) { h.set_memory_bytes(int64_t{1} << 51); }),
                   {"register.memory_bytes", "2^50", "got 2251799813685248"}});
  for (const char* device : {"tpu:-1", "tpu", "cuda:-1", "cuda:+1", "cuda:", "cuda:4096", "cuda:99999",
                             "cuda:1x", "CPU"}) {
    cases.push_back({absl::StrCat("device ", device), with([&](v1::Register& h) { h.set_device(device); }),
                     {"register.device", absl::StrCat("\"", device, "\"")}});
  }
  for (const Case& c : cases) {
    absl::StatusOr<int> index = Register(c.hello);
    ASSERT_FALSE(index.ok()) << c.name << " was accepted";
    EXPECT_EQ(index.status().code(), absl::StatusCode::kInvalidArgument) << c.name;
    for (const std::string& s : c.expected) {
      EXPECT_THAT(std::string(index.status().message()), HasSubstr(s)) << c.name;
    }
  }
  EXPECT_TRUE(link_.sent.empty());
}

TEST_F(WorkerPoolRegisterTest, ZeroBandwidthMeansNotReportedAndGoodDevicesAreAccepted) {
  v1::Register unreported = GoodHello();  // memory_bytes_per_s 0: not reported
  absl::StatusOr<int> a = Register(unreported);
  EXPECT_TRUE(a.ok()) << a.status();
  v1::Register gpu = GoodHello();
  gpu.set_device("cuda:4095");
  gpu.set_memory_bytes(int64_t{1} << 50);
  gpu.set_memory_bytes_per_s(3.35e12);
  // The second of two workers completes the group: it is formed and planned, and each worker is
  // sent its Assignment.
  absl::StatusOr<int> b = Register(gpu);
  EXPECT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(link_.sent.size(), 2u) << "an Assignment (or a Shutdown) for each worker";
}

// ---- Healing, message by message (docs/healing.md) ----------------------------------------------

v1::WorkerMessage LoadedMessage(uint64_t epoch) {
  v1::WorkerMessage m;
  m.mutable_loaded()->set_epoch(epoch);
  m.mutable_loaded()->set_weight_bytes(1);
  return m;
}

v1::WorkerMessage FailureMessage(uint64_t epoch, uint64_t step_id, const std::string& text) {
  v1::WorkerMessage m;
  m.mutable_failure()->set_epoch(epoch);
  m.mutable_failure()->set_step_id(step_id);
  m.mutable_failure()->set_message(text);
  return m;
}

TEST(WorkerPoolHealTest, ALostWorkerIsReplacedUnderANewEpochAndTheSurvivorRegroups) {
  TestPool t = MakePool(/*nodes=*/1, /*gpus_per_node=*/2);
  ASSERT_NE(t.pool, nullptr);
  WorkerPool& pool = *t.pool;
  FakeLink a, b, small_link, stranger_link, c;
  const absl::StatusOr<int> wa = pool.Register(GoodHello(), &a), wb = pool.Register(GoodHello(), &b);
  ASSERT_TRUE(wa.ok() && wb.ok());
  ASSERT_EQ(a.sent.size(), 1u);
  ASSERT_TRUE(a.sent[0].has_assignment());
  EXPECT_EQ(a.sent[0].assignment().epoch(), 1u);
  EXPECT_EQ(a.sent[0].assignment().tp_group(), "e1/tp/stage0");
  pool.OnMessage(*wa, LoadedMessage(1));
  pool.OnMessage(*wb, LoadedMessage(1));
  ASSERT_TRUE(pool.CheckServing().ok()) << pool.CheckServing();
  EXPECT_EQ(pool.StateName(), "serving");

  // A step in flight when worker b is lost: it fails naming b, and the group heals.
  v1::StepPlan step;
  step.set_step_id(7);
  ASSERT_TRUE(pool.StartStep(step, 0, false).ok());
  ASSERT_EQ(a.sent.size(), 2u);
  EXPECT_EQ(a.sent[1].step().epoch(), 1u) << "every plan carries the epoch";
  pool.Disconnect(*wb);
  EXPECT_EQ(pool.StateName(), "healing");
  ASSERT_TRUE(pool.HealingSince().has_value());
  StepOutcome outcome;
  const absl::Status failed = pool.FinishStep(7, absl::Seconds(5), &outcome);
  EXPECT_TRUE(absl::IsUnavailable(failed));
  EXPECT_THAT(failed.message(), HasSubstr("worker w1 (node n0, stage 0, tp rank 1) is lost"));
  EXPECT_THAT(failed.message(), HasSubstr("its slot (node n0, stage 0, tp rank 1) waits for a worker from node n0"));
  pool.DropSteps();
  EXPECT_FALSE(pool.StartStep(step, 0, false).ok()) << "no step starts while healing";

  // Replacements that do not fit are refused, saying why; the slot stays open.
  v1::Register small = GoodHello();
  small.set_memory_bytes(1024);
  const absl::StatusOr<int> refused = pool.Register(small, &small_link);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("cannot take slot (node n0, stage 0, tp rank 1): its shard needs"));
  v1::Register stranger = GoodHello();
  stranger.set_node("n5");
  const absl::StatusOr<int> elsewhere = pool.Register(stranger, &stranger_link);
  ASSERT_FALSE(elsewhere.ok());
  EXPECT_THAT(elsewhere.status().message(), HasSubstr("node n5 is not one of its nodes (n0)"));
  EXPECT_EQ(pool.StateName(), "healing");

  // Survivor a has not answered step 7 yet: a fitting replacement registers, but the group waits.
  const absl::StatusOr<int> wc = pool.Register(GoodHello(), &c);
  ASSERT_TRUE(wc.ok()) << wc.status();
  EXPECT_TRUE(c.sent.empty());
  // a's failure of step 7 (its all-reduce lost b) settles it; a is not lost for it.
  pool.OnMessage(*wa, FailureMessage(1, 7, "step 7 failed: lost the connection to rank 1"));
  ASSERT_EQ(c.sent.size(), 1u);
  ASSERT_TRUE(c.sent[0].has_assignment());
  EXPECT_EQ(c.sent[0].assignment().epoch(), 2u);
  EXPECT_EQ(c.sent[0].assignment().tp_rank(), 1);
  EXPECT_EQ(c.sent[0].assignment().tp_group(), "e2/tp/stage0");
  ASSERT_EQ(a.sent.size(), 3u);
  ASSERT_TRUE(a.sent[2].has_regroup());
  EXPECT_EQ(a.sent[2].regroup().epoch(), 2u);
  EXPECT_EQ(a.sent[2].regroup().tp_group(), "e2/tp/stage0");
  EXPECT_EQ(pool.epoch(), 2u);
  // Each Assignment and Regroup grants its worker the epoch's groups and its rank in them
  // (rendezvous_grants.h); the Regroup's token replaces the one of epoch 1.
  RendezvousGrants* grants = pool.rendezvous_grants();
  const std::string token_a1 = a.sent[0].assignment().rendezvous_token();
  const std::string token_a2 = a.sent[2].regroup().rendezvous_token();
  const std::string token_c2 = c.sent[0].assignment().rendezvous_token();
  EXPECT_TRUE(grants->CheckSet(token_a2, "e2/tp/stage0/gloo/0").ok());
  EXPECT_TRUE(grants->CheckSet(token_c2, "e2/tp/stage0/gloo/rank_1").ok());
  EXPECT_TRUE(grants->CheckGet(token_c2, "e2/tp/stage0/gloo/0").ok());
  EXPECT_TRUE(absl::IsPermissionDenied(grants->CheckSet(token_c2, "e2/tp/stage0/gloo/0")));
  EXPECT_TRUE(absl::IsPermissionDenied(grants->CheckSet(token_a1, "e2/tp/stage0/gloo/0")));
  EXPECT_TRUE(absl::IsPermissionDenied(grants->CheckGet(token_a1, "e1/tp/stage0/gloo/1")));

  // A stale failure (epoch 1) changes nothing; Loaded under epoch 2 from both: serving again.
  pool.OnMessage(*wa, FailureMessage(1, 8, "late news from the old group"));
  pool.OnMessage(*wa, LoadedMessage(2));
  EXPECT_EQ(pool.StateName(), "healing");
  pool.OnMessage(*wc, LoadedMessage(2));
  EXPECT_TRUE(pool.CheckServing().ok()) << pool.CheckServing();
  EXPECT_FALSE(pool.HealingSince().has_value());
  step.set_step_id(9);
  ASSERT_TRUE(pool.StartStep(step, 0, false).ok());
  ASSERT_EQ(c.sent.size(), 2u);
  EXPECT_EQ(c.sent[1].step().epoch(), 2u);
  v1::ClusterStatus status;
  pool.FillStatus(&status);
  EXPECT_EQ(status.state(), "serving");
  EXPECT_EQ(status.epoch(), 2u);
  t.Close({*wa, *wc});
}

// Registers two workers of node n0 with `pool` (1 x 2: the group forms) at *wa and *wb; each link
// got its Assignment.
void RegisterPair(WorkerPool& pool, FakeLink* a, FakeLink* b, int* wa, int* wb) {
  const absl::StatusOr<int> ia = pool.Register(GoodHello(), a), ib = pool.Register(GoodHello(), b);
  ASSERT_TRUE(ia.ok() && ib.ok());
  ASSERT_EQ(a->sent.size(), 1u);
  ASSERT_EQ(b->sent.size(), 1u);
  ASSERT_TRUE(a->sent[0].has_assignment() && b->sent[0].has_assignment());
  *wa = *ia;
  *wb = *ib;
}

// A worker the pool marks lost while its stream stays open (a malformed message; a frozen worker
// that sends no heartbeat) loses its rendezvous grant at once, not only when its stream ends; its
// peer's grant stands.
TEST(WorkerPoolHealTest, ALostWorkersRendezvousTokenIsRevokedWhileItsStreamIsOpen) {
  TestPool t = MakePool(/*nodes=*/1, /*gpus_per_node=*/2);
  ASSERT_NE(t.pool, nullptr);
  WorkerPool& pool = *t.pool;
  FakeLink a, b;
  int wa = -1, wb = -1;
  ASSERT_NO_FATAL_FAILURE(RegisterPair(pool, &a, &b, &wa, &wb));
  const std::string token_a = a.sent[0].assignment().rendezvous_token();
  const std::string token_b = b.sent[0].assignment().rendezvous_token();
  RendezvousGrants* grants = pool.rendezvous_grants();
  ASSERT_TRUE(grants->CheckSet(token_a, "e1/tp/stage0/gloo/0").ok());
  // A second Register on its stream: a is lost (malformed), its stream not ended (no Disconnect).
  v1::WorkerMessage again;
  *again.mutable_register_() = GoodHello();
  pool.OnMessage(wa, again);
  const absl::Status denied = grants->CheckSet(token_a, "e1/tp/stage0/gloo/0");
  EXPECT_TRUE(absl::IsPermissionDenied(denied)) << denied;
  EXPECT_TRUE(absl::IsPermissionDenied(grants->CheckGet(token_a, "e1/tp/stage0/gloo/1")));
  EXPECT_TRUE(grants->CheckSet(token_b, "e1/tp/stage0/gloo/1").ok());
  t.Close({wa, wb});
}

TEST(WorkerPoolHealTest, AFrozenWorkersRendezvousTokenIsRevokedWhenItsHeartbeatsStop) {
  TestPool t = MakePool(/*nodes=*/1, /*gpus_per_node=*/2, /*heartbeat_timeout=*/absl::Milliseconds(300));
  ASSERT_NE(t.pool, nullptr);
  WorkerPool& pool = *t.pool;
  FakeLink a, b;
  int wa = -1, wb = -1;
  ASSERT_NO_FATAL_FAILURE(RegisterPair(pool, &a, &b, &wa, &wb));
  const std::string token = a.sent[0].assignment().rendezvous_token();
  // Silent (frozen) with its stream open: the monitor marks it lost after the heartbeat timeout.
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  bool lost = false;
  while (!lost && absl::Now() < deadline) {
    v1::ClusterStatus status;
    pool.FillStatus(&status);
    lost = status.workers_size() >= 1 && status.workers(0).worker_id() == "w0" &&
           status.workers(0).state() == v1::WORKER_STATE_LOST;
    if (!lost) absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_TRUE(lost) << "the silent worker was not marked lost";
  const absl::Status denied = pool.rendezvous_grants()->CheckSet(token, "e1/tp/stage0/gloo/0");
  EXPECT_TRUE(absl::IsPermissionDenied(denied)) << denied;
  t.Close({wa, wb});
}

// ---- Spares of a group that is still forming --------------------------------------------------

v1::Register HelloFrom(const std::string& node, bool spare = false) {
  v1::Register h = GoodHello();
  h.set_node(node);
  h.set_spare(spare);
  return h;
}

v1::WorkerMessage HeartbeatMessage() {
  v1::WorkerMessage m;
  m.mutable_heartbeat();
  return m;
}

// The worker ids the status shows as idle spares (cluster_status.cc: "spare: takes the next ...").
std::vector<std::string> SparesIn(WorkerPool& pool) {
  v1::ClusterStatus status;
  pool.FillStatus(&status);
  std::vector<std::string> ids;
  for (const v1::WorkerStatus& w : status.workers()) {
    if (w.detail().rfind("spare:", 0) == 0) ids.push_back(w.worker_id());
  }
  return ids;
}

TEST(WorkerPoolSpareTest, AWorkerForAFullNodeWhileTheGroupFormsWaitsAsItsSpareAndTakesALostSlot) {
  TestPool t = MakePool(/*nodes=*/2, /*gpus_per_node=*/1);
  ASSERT_NE(t.pool, nullptr);
  WorkerPool& pool = *t.pool;
  FakeLink a, b, small_link, gpu_link, stranger_link, c;
  const absl::StatusOr<int> wa = pool.Register(HelloFrom("n0"), &a);
  ASSERT_TRUE(wa.ok()) << wa.status();
  // Node n0 has its one worker and the group is not complete: b waits as a spare of n0.
  const absl::StatusOr<int> wb = pool.Register(HelloFrom("n0"), &b);
  ASSERT_TRUE(wb.ok()) << wb.status();
  // One that could never hold n0's shard (too little memory) is let go when the group forms,
  // saying why; one on another kind of device is refused at once.
  v1::Register small = HelloFrom("n0");
  small.set_memory_bytes(1024);
  const absl::StatusOr<int> wsmall = pool.Register(small, &small_link);
  ASSERT_TRUE(wsmall.ok()) << wsmall.status();
  v1::Register gpu = HelloFrom("n0");
  gpu.set_device("cuda:0");
  const absl::StatusOr<int> wgpu = pool.Register(gpu, &gpu_link);
  ASSERT_FALSE(wgpu.ok());
  EXPECT_EQ(wgpu.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(wgpu.status().message(), HasSubstr("device cuda:0 cannot be a spare of node n0"));
  EXPECT_EQ(SparesIn(pool), (std::vector<std::string>{"w1", "w2"}));
  EXPECT_EQ(pool.StateName(), "starting");

  // n1's worker completes the group: a and c are assigned, b stays a spare, the small one is let go.
  const absl::StatusOr<int> wc = pool.Register(HelloFrom("n1"), &c);
  ASSERT_TRUE(wc.ok()) << wc.status();
  ASSERT_EQ(a.sent.size(), 1u);
  ASSERT_TRUE(a.sent[0].has_assignment());
  EXPECT_EQ(a.sent[0].assignment().stage(), 0);
  ASSERT_EQ(c.sent.size(), 1u);
  ASSERT_TRUE(c.sent[0].has_assignment());
  EXPECT_EQ(c.sent[0].assignment().stage(), 1);
  EXPECT_TRUE(b.sent.empty());
  ASSERT_EQ(small_link.sent.size(), 1u);
  ASSERT_TRUE(small_link.sent[0].has_shutdown());
  EXPECT_THAT(small_link.sent[0].shutdown().reason(), HasSubstr("cannot take slot (node n0, stage 0, tp rank 0)"));
  EXPECT_FALSE(small_link.sent[0].shutdown().let_go()) << "refused, not let go after an assignment";
  EXPECT_EQ(SparesIn(pool), (std::vector<std::string>{"w1"}));
  // A worker from a node that is not one of the group's is still refused.
  const absl::StatusOr<int> stranger = pool.Register(HelloFrom("n7"), &stranger_link);
  ASSERT_FALSE(stranger.ok());
  EXPECT_THAT(stranger.status().message(), HasSubstr("node n7 is not one of its nodes (n0, n1)"));

  // a is lost once the group serves: the spare b takes its slot under epoch 2.
  pool.OnMessage(*wa, LoadedMessage(1));
  pool.OnMessage(*wc, LoadedMessage(1));
  ASSERT_TRUE(pool.CheckServing().ok()) << pool.CheckServing();
  pool.Disconnect(*wa);
  pool.OnMessage(*wc, HeartbeatMessage());  // the survivor is settled: the group re-forms
  ASSERT_EQ(b.sent.size(), 1u);
  ASSERT_TRUE(b.sent[0].has_assignment());
  EXPECT_EQ(b.sent[0].assignment().epoch(), 2u);
  EXPECT_EQ(b.sent[0].assignment().stage(), 0);
  t.Close({*wb, *wsmall, *wc});
}

TEST(WorkerPoolSpareTest, ASpareTakesThePlaceOfAWorkerThatLeavesBeforeTheGroupForms) {
  TestPool t = MakePool(/*nodes=*/2, /*gpus_per_node=*/1);
  ASSERT_NE(t.pool, nullptr);
  WorkerPool& pool = *t.pool;
  FakeLink a, b, c;
  const absl::StatusOr<int> wa = pool.Register(HelloFrom("n0"), &a);
  const absl::StatusOr<int> wb = pool.Register(HelloFrom("n0"), &b);
  ASSERT_TRUE(wa.ok() && wb.ok());
  pool.Disconnect(*wa);
  EXPECT_TRUE(SparesIn(pool).empty()) << "the spare joined the forming group";
  const absl::StatusOr<int> wc = pool.Register(HelloFrom("n1"), &c);
  ASSERT_TRUE(wc.ok()) << wc.status();
  ASSERT_EQ(b.sent.size(), 1u);
  ASSERT_TRUE(b.sent[0].has_assignment());
  EXPECT_EQ(b.sent[0].assignment().stage(), 0);
  ASSERT_EQ(c.sent.size(), 1u);
  EXPECT_EQ(c.sent[0].assignment().stage(), 1);
  EXPECT_TRUE(a.sent.empty());
  t.Close({*wb, *wc});
}

// A spare worker (Register.spare) that could never take a slot is refused, naming its node and the
// group's nodes, or why it does not fit: at once when that is known (the forming group has all its
// nodes; the group has formed), else when the group forms. Spares may still come first.
TEST(WorkerPoolSpareTest, ASpareThatCanNeverTakeASlotIsRefusedNamingItsNodeAndTheGroupsNodes) {
  TestPool t = MakePool(/*nodes=*/2, /*gpus_per_node=*/2);
  ASSERT_NE(t.pool, nullptr);
  WorkerPool& pool = *t.pool;
  FakeLink first, unknown_node, a0, a1, too_many, b0, b1, stranger, small_link, late;
  // Before any worker: spares of n0 and n5 are kept (the group's nodes are not known yet).
  const absl::StatusOr<int> s_first = pool.Register(HelloFrom("n0", /*spare=*/true), &first);
  ASSERT_TRUE(s_first.ok()) << s_first.status();
  const absl::StatusOr<int> s_n5 = pool.Register(HelloFrom("n5", /*spare=*/true), &unknown_node);
  ASSERT_TRUE(s_n5.ok()) << s_n5.status();
  const absl::StatusOr<int> w_a0 = pool.Register(HelloFrom("n0"), &a0), w_a1 = pool.Register(HelloFrom("n1"), &a1);
  ASSERT_TRUE(w_a0.ok() && w_a1.ok());
  // The forming group has its 2 nodes: a spare of a third is refused at once.
  const absl::StatusOr<int> s_n7 = pool.Register(HelloFrom("n7", /*spare=*/true), &too_many);
  ASSERT_FALSE(s_n7.ok()) << "a spare of node n7 was accepted";
  EXPECT_EQ(s_n7.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s_n7.status().message(), HasSubstr("the group already has its 2 nodes (n0, n1): node n7"));
  // The group forms: n5's spare is told why it is refused; n0's stays.
  const absl::StatusOr<int> w_b0 = pool.Register(HelloFrom("n0"), &b0), w_b1 = pool.Register(HelloFrom("n1"), &b1);
  ASSERT_TRUE(w_b0.ok() && w_b1.ok());
  ASSERT_EQ(a0.sent.size(), 1u);
  ASSERT_TRUE(a0.sent[0].has_assignment());
  EXPECT_TRUE(first.sent.empty());
  ASSERT_EQ(unknown_node.sent.size(), 1u);
  ASSERT_TRUE(unknown_node.sent[0].has_shutdown());
  EXPECT_THAT(unknown_node.sent[0].shutdown().reason(), HasSubstr("node n5 is not one of the group's nodes (n0, n1)"));
  EXPECT_EQ(SparesIn(pool), (std::vector<std::string>{"w0"}));

  // Once the group has formed: a spare of another node, or one too small for its node's shard, is
  // refused at once; a fitting one of n1 is kept.
  const absl::StatusOr<int> s_stranger = pool.Register(HelloFrom("n7", /*spare=*/true), &stranger);
  ASSERT_FALSE(s_stranger.ok()) << "a spare of node n7 was accepted";
  EXPECT_EQ(s_stranger.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s_stranger.status().message(), HasSubstr("node n7 is not one of its nodes (n0, n1)"));
  v1::Register small = HelloFrom("n1", /*spare=*/true);
  small.set_memory_bytes(1024);
  const absl::StatusOr<int> s_small = pool.Register(small, &small_link);
  ASSERT_FALSE(s_small.ok()) << "a spare too small for n1's shard was accepted";
  EXPECT_EQ(s_small.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s_small.status().message(), HasSubstr("cannot take slot (node n1, stage 1, tp rank 0)"));
  const absl::StatusOr<int> s_late = pool.Register(HelloFrom("n1", /*spare=*/true), &late);
  ASSERT_TRUE(s_late.ok()) << s_late.status();
  EXPECT_EQ(SparesIn(pool), (std::vector<std::string>{"w0", "w6"}));
  t.Close({*s_first, *s_n5, *w_a0, *w_a1, *w_b0, *w_b1, *s_late});
}

}  // namespace
}  // namespace shardserve
