// Tests of the Communicator implementations (worker/communicator.h, worker/comm/).
//
// Gloo runs over real TCP on loopback: each rank is a thread of this process with its own Gloo
// context (its own sockets and event loop), and the ranks meet through an InMemoryRendezvousStore.
// The collective cases run twice: over Gloo's TCP, and with WithSharedMemory's segment (the
// threads share a host); a peer process that dies is a child process of the test.
// Values are small multiples of 1/4, so every sum is exact in float and results compare with ==.
// All-to-all cases send uneven row counts, zeros included, and every rank checks all it received.
// The failure cases (a rank that never joins, a rank that skips a collective, a rank that exits,
// mismatched shapes) use a 2 s timeout and check that the call returns the right error within
// twice that; the times they took are printed. NCCL cases need GPUs and are skipped, with the
// reason, where there are too few.
//
// Every test runs under a watchdog that ends the program if the test outlives kTestLimit, so a
// hung collective fails instead of hanging; every thread a test starts is joined.
#include "worker/communicator.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <numeric>
#include <utility>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "kernels/tensor.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/host_cpus.h"
#include "worker/comm/interface_address.h"
#include "worker/comm/nccl_communicator.h"
#include "worker/comm/rendezvous.h"
#include "worker/comm/shared_memory_communicator.h"
#include "worker/comm/staged_communicator.h"
#include "worker/timed_communicator.h"

#if SHARDSERVE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace shardserve {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

// The timeout of the failure cases, and the bound on how long they may take to report it.
constexpr absl::Duration kTimeout = absl::Seconds(2);
const absl::Duration kTimeoutBound = 2 * kTimeout;
// The timeout where nothing should time out: generous, because CI machines are small and shared.
constexpr absl::Duration kNoTimeout = absl::Seconds(30);
// The watchdog's limit for a whole test: above kNoTimeout, so a timeout reports before it fires.
constexpr absl::Duration kTestLimit = absl::Seconds(90);

// ---- Harness ---------------------------------------------------------------------------------

// Ends the program when the current test runs past `limit`. Stopped (and joined) on destruction.
class Watchdog {
 public:
  explicit Watchdog(absl::Duration limit)
      : thread_([this, limit] {
          if (done_.WaitForNotificationWithTimeout(limit)) return;
          const ::testing::TestInfo* test = ::testing::UnitTest::GetInstance()->current_test_info();
          std::fprintf(stderr, "FATAL: %s.%s still running after %s: a communicator call hung\n",
                       test->test_suite_name(), test->name(), absl::FormatDuration(limit).c_str());
          std::_Exit(3);
        }) {}
  ~Watchdog() {
    done_.Notify();
    thread_.join();
  }

 private:
  absl::Notification done_;  // declared before thread_, which reads it
  std::thread thread_;
};

// A test fixture whose tests run under a Watchdog.
template <typename Base>
class Guarded : public Base {
  Watchdog watchdog_{kTestLimit};
};
using CommunicatorTest = Guarded<::testing::Test>;

// Runs fn(rank) for rank 0..size-1, each on a thread of its own, and joins them all.
void RunRanks(int size, const std::function<void(int rank)>& fn) {
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) threads.emplace_back(fn, rank);
  for (std::thread& t : threads) t.join();
}

absl::StatusOr<std::unique_ptr<Communicator>> JoinGloo(RendezvousStore* store, const std::string& group, int rank,
                                                       int size, absl::Duration timeout = kNoTimeout) {
  return MakeGlooCommunicator(store, group, rank, size, "127.0.0.1", timeout);
}

// How the ranks of a Gloo group exchange tensors: Gloo's TCP, or shared memory (the ranks are
// threads of one process, so they share a host).
enum class Transport { kTcp, kSharedMemory };
const char* TransportName(Transport t) { return t == Transport::kTcp ? "Tcp" : "SharedMemory"; }

// JoinGloo, then WithSharedMemory for kSharedMemory.
absl::StatusOr<std::unique_ptr<Communicator>> Join(Transport transport, RendezvousStore* store, const std::string& group,
                                                   int rank, int size, absl::Duration timeout = kNoTimeout) {
  absl::StatusOr<std::unique_ptr<Communicator>> comm = JoinGloo(store, group, rank, size, timeout);
  if (!comm.ok() || transport == Transport::kTcp) return comm;
  return WithSharedMemory(std::move(*comm), group, timeout);
}

// "Tcp_Size2", "SharedMemory_Size3": names of the tests over (transport, size).
using TransportAndSize = std::tuple<Transport, int>;
std::string TransportAndSizeName(const ::testing::TestParamInfo<TransportAndSize>& info) {
  return absl::StrCat(TransportName(std::get<0>(info.param)), "_Size", std::get<1>(info.param));
}

void PrintTime(const std::string& what, absl::Duration took) {
  std::printf("[   TIME   ] %s: %s\n", what.c_str(), absl::FormatDuration(took).c_str());
}

// Value i of rank r's all-reduce input: a multiple of 1/4 in [-1.5r-1.5, 1.5r+1.5].
float AllReduceInput(int r, int64_t i) { return static_cast<float>((r + 1) * (i % 13 - 6)) * 0.25f; }

// Row counts of an all-to-all: rank `from` sends rank `to` this many rows.
using AllToAllRows = int64_t (*)(int from, int to);
// 0, 1 or 2 rows; every size above one has pairs that send none.
int64_t UnevenRows(int from, int to) { return (from + 2 * to + 1) % 3; }
// Rank 0 sends nothing at all (its in has no rows); the others send 1 to 3 rows to every rank.
int64_t RankZeroSendsNothing(int from, int to) { return from == 0 ? 0 : (from + to) % 3 + 1; }
// 20 to 26 rows to every rank.
int64_t ManyRows(int from, int to) { return 20 + (from + 2 * to) % 7; }

// Element j of row k of the rows rank `from` sends rank `to`: a multiple of 1/4 that names all four
// where k < 10 and j < 10 (ManyRows' rows of 4096 differ from their neighbours' too).
float AllToAllValue(int from, int to, int64_t k, int64_t j) {
  return 0.25f * static_cast<float>(from * 1000 + to * 100 + k * 10 + j);
}

// One rank's side of an F32 all-to-all: its counts, its input, its output (-1 until written) and
// the output it must get.
struct AllToAllCase {
  AllToAllCase(int rank, int size, std::vector<int64_t> row, AllToAllRows rows) : row_shape(std::move(row)) {
    const int64_t row_elements = std::accumulate(row_shape.begin(), row_shape.end(), int64_t{1}, std::multiplies<>());
    for (int p = 0; p < size; ++p) {
      send_rows.push_back(rows(rank, p));
      recv_rows.push_back(rows(p, rank));
      for (int64_t k = 0; k < send_rows.back(); ++k) {
        for (int64_t j = 0; j < row_elements; ++j) in.push_back(AllToAllValue(rank, p, k, j));
      }
      for (int64_t k = 0; k < recv_rows.back(); ++k) {
        for (int64_t j = 0; j < row_elements; ++j) want.push_back(AllToAllValue(p, rank, k, j));
      }
    }
    out.assign(want.size(), -1.0f);
  }
  // [sum(counts), ...row_shape] over `data`.
  Tensor Rows(void* data, const std::vector<int64_t>& counts) const {
    Tensor t(data, DType::kF32, {std::accumulate(counts.begin(), counts.end(), int64_t{0})});
    for (int64_t d : row_shape) t.shape[t.ndim++] = d;
    return t;
  }
  Tensor InTensor() { return Rows(in.data(), send_rows); }
  Tensor OutTensor() { return Rows(out.data(), recv_rows); }
  absl::Status Run(Communicator& comm) {
    Tensor out_t = OutTensor();
    return comm.AllToAllV(&out_t, InTensor(), send_rows, recv_rows);
  }

  std::vector<int64_t> row_shape;  // the dimensions after the leading one
  std::vector<int64_t> send_rows, recv_rows;
  std::vector<float> in, out, want;
};

// ---- InMemoryRendezvousStore -----------------------------------------------------------------

TEST_F(CommunicatorTest, StoreGetWaitsForSet) {
  InMemoryRendezvousStore store;
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(50));
    EXPECT_TRUE(store.Set("g/k", std::string("v\0w", 3)).ok());
  });
  absl::StatusOr<std::string> value = store.Get("g/k", kNoTimeout);
  setter.join();
  ASSERT_TRUE(value.ok()) << value.status();
  EXPECT_EQ(*value, std::string("v\0w", 3));
}

TEST_F(CommunicatorTest, StoreKeysAreWrittenOnce) {
  InMemoryRendezvousStore store;
  ASSERT_TRUE(store.Set("e1/g/k", "first").ok());
  const absl::Status second = store.Set("e1/g/k", "second");
  EXPECT_EQ(second.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(second.message(), HasSubstr("'e1/g/k'"));
  EXPECT_TRUE(store.Set("e1/g/k", "first").ok());  // the same value: a retry
  EXPECT_EQ(*store.Get("e1/g/k", kNoTimeout), "first");
}

// --collective-interface: the loopback interface's address binds a working group; an unknown
// interface is an error naming the ones there are.
TEST_F(CommunicatorTest, InterfaceAddressBindsTheGroupToTheNamedInterface) {
  absl::StatusOr<std::string> lo = InterfaceAddress("lo");
  ASSERT_TRUE(lo.ok()) << lo.status();
  EXPECT_EQ(*lo, "127.0.0.1");
  const absl::Status missing = InterfaceAddress("nosuch0").status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.message(), HasSubstr("'nosuch0' does not exist"));
  EXPECT_THAT(missing.message(), HasSubstr("lo"));
  InMemoryRendezvousStore store;
  RunRanks(2, [&](int rank) {
    absl::StatusOr<std::unique_ptr<Communicator>> comm =
        MakeGlooCommunicator(&store, "e1/iface", rank, 2, *lo, absl::Seconds(60));
    ASSERT_TRUE(comm.ok()) << comm.status();
    EXPECT_TRUE((*comm)->Barrier().ok());
  });
}

TEST_F(CommunicatorTest, StoreGetTimesOut) {
  InMemoryRendezvousStore store;
  ASSERT_TRUE(store.Set("g/other", "x").ok());
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> value = store.Get("g/k", absl::Milliseconds(100));
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(value.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(value.status().message(), HasSubstr("'g/k'"));
  EXPECT_GE(took, absl::Milliseconds(100));
  EXPECT_LT(took, absl::Seconds(2));
}

// ---- LocalCommunicator -----------------------------------------------------------------------

TEST_F(CommunicatorTest, LocalHasNoPeers) {
  LocalCommunicator local(nullptr);  // the backend is only used by AllGather
  float x[2] = {1, 2};
  Tensor t(x, DType::kF32, {2});
  EXPECT_TRUE(local.AllReduceSum(&t).ok());
  EXPECT_TRUE(local.Barrier().ok());
  EXPECT_EQ(local.Send(t, 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(local.Recv(&t, 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(x[0], 1);
  EXPECT_EQ(x[1], 2);
}

// A group of one sends all its rows to itself: AllToAllV copies them, after the same argument
// checks as every implementation (a group of one has no state to break).
TEST_F(CommunicatorTest, LocalAllToAllVCopiesItsOwnRows) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend(1);
  LocalCommunicator local(cpu.get());
  AllToAllCase c(0, 1, {2, 3}, UnevenRows);
  ASSERT_TRUE(c.Run(local).ok());
  EXPECT_EQ(c.out, c.want);
  Tensor out = c.OutTensor();
  const Tensor in = c.InTensor();
  const absl::Status short_count = local.AllToAllV(&out, in, {0}, {1});
  EXPECT_EQ(short_count.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(short_count.message(), HasSubstr("send_rows [0] adds up to 0, not the 1 rows of in"));
  EXPECT_EQ(local.AllToAllV(&out, in, {1, 0}, {1, 0}).code(), absl::StatusCode::kInvalidArgument);
  Tensor same = in;
  EXPECT_EQ(local.AllToAllV(&same, in, {1}, {1}).code(), absl::StatusCode::kInvalidArgument);
}

// ---- TimedCommunicator -----------------------------------------------------------------------

// Keeps what it is told.
class RecordingObserver final : public CollectiveObserver {
 public:
  void Observe(CollectiveOp op, double, uint64_t bytes) override { seen.emplace_back(op, bytes); }
  std::vector<std::pair<CollectiveOp, uint64_t>> seen;
};

// The worker's metrics see an all-to-all as one, with the bytes of the rows this rank sent.
TEST_F(CommunicatorTest, TimedReportsAnAllToAllWithTheBytesSent) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend(1);
  TimedCommunicator timed(std::make_unique<LocalCommunicator>(cpu.get()), cpu.get());
  RecordingObserver observer;
  timed.set_observer(&observer);
  AllToAllCase c(0, 1, {4}, RankZeroSendsNothing);
  ASSERT_TRUE(c.Run(timed).ok());
  AllToAllCase d(0, 1, {2, 3}, UnevenRows);
  ASSERT_TRUE(d.Run(timed).ok());
  EXPECT_EQ(d.out, d.want);
  EXPECT_EQ(observer.seen, (std::vector<std::pair<CollectiveOp, uint64_t>>{{CollectiveOp::kAllToAll, 0},
                                                                           {CollectiveOp::kAllToAll, 6 * 4}}));
}

// ---- Gloo: results ---------------------------------------------------------------------------

// Cases of two ranks, over each transport.
class GlooTransportTest : public Guarded<::testing::TestWithParam<Transport>> {};
INSTANTIATE_TEST_SUITE_P(Transports, GlooTransportTest, ::testing::Values(Transport::kTcp, Transport::kSharedMemory),
                         [](const ::testing::TestParamInfo<Transport>& info) { return TransportName(info.param); });

class GlooSizeTest : public Guarded<::testing::TestWithParam<TransportAndSize>> {
 protected:
  int GroupSize() const { return std::get<1>(GetParam()); }
  // Runs fn(comm, rank) on every rank of a Gloo group of GroupSize() ranks over the transport of
  // the parameter, each rank on its own thread.
  void OnEveryRank(const std::function<void(Communicator& comm, int rank)>& fn) {
    InMemoryRendezvousStore store;
    RunRanks(GroupSize(), [&](int rank) {
      absl::StatusOr<std::unique_ptr<Communicator>> comm =
          Join(std::get<0>(GetParam()), &store, "tp", rank, GroupSize());
      ASSERT_TRUE(comm.ok()) << comm.status();
      fn(**comm, rank);
    });
  }
};
INSTANTIATE_TEST_SUITE_P(Sizes, GlooSizeTest,
                         ::testing::Combine(::testing::Values(Transport::kTcp, Transport::kSharedMemory),
                                            ::testing::Values(1, 2, 3, 4)),
                         TransportAndSizeName);

// F32 with 5 elements (fewer than a ring segment per rank), 16384 (64 KiB: the largest gathered
// and summed in rank order), 16385 (the smallest that takes Gloo's ring) and 300007 (more than
// Gloo's 1 MiB segment, an odd count), then I32.
TEST_P(GlooSizeTest, AllReduceSum) {
  const int size = GroupSize();
  OnEveryRank([&](Communicator& comm, int rank) {
    EXPECT_EQ(comm.rank(), rank);
    EXPECT_EQ(comm.size(), size);
    for (int64_t n : {int64_t{5}, int64_t{16384}, int64_t{16385}, int64_t{300007}}) {
      std::vector<float> x(n);
      for (int64_t i = 0; i < n; ++i) x[i] = AllReduceInput(rank, i);
      Tensor t(x.data(), DType::kF32, {n});
      ASSERT_TRUE(comm.AllReduceSum(&t).ok()) << "n=" << n;
      int64_t wrong = 0;
      for (int64_t i = 0; i < n; ++i) {
        float want = 0;
        for (int r = 0; r < size; ++r) want += AllReduceInput(r, i);
        if (x[i] != want && wrong++ == 0)
          ADD_FAILURE() << "rank " << rank << " n=" << n << " [" << i << "] " << x[i] << " != " << want;
      }
      EXPECT_EQ(wrong, 0) << "rank " << rank << " n=" << n;
    }
    std::vector<int32_t> ids = {rank, 1000 * rank, -7};
    Tensor t(ids.data(), DType::kI32, {3});
    ASSERT_TRUE(comm.AllReduceSum(&t).ok());
    const int32_t rank_sum = size * (size - 1) / 2;
    EXPECT_EQ(ids, (std::vector<int32_t>{rank_sum, 1000 * rank_sum, -7 * size}));
  });
}

// Sums that float32 rounds (no exact want) still come out bit for bit the same on every rank, on
// both paths (gathered and summed in rank order; Gloo's ring): the TP ranks' activations stay
// identical. Each rank's result is all-gathered and compared byte for byte.
TEST_P(GlooSizeTest, AllReduceSumGivesEveryRankTheSameBits) {
  const int size = GroupSize();
  OnEveryRank([&](Communicator& comm, int rank) {
    for (int64_t n : {int64_t{1000}, int64_t{20000}}) {
      std::vector<float> x(n);
      for (int64_t i = 0; i < n; ++i) x[i] = std::sin(0.37f * static_cast<float>(i) + static_cast<float>(rank)) / 3.0f;
      Tensor t(x.data(), DType::kF32, {n});
      ASSERT_TRUE(comm.AllReduceSum(&t).ok()) << "n=" << n;
      std::vector<float> all(static_cast<size_t>(n * size));
      Tensor out(all.data(), DType::kF32, {size, n});
      ASSERT_TRUE(comm.AllGather(&out, t).ok()) << "n=" << n;
      for (int r = 1; r < size; ++r) {
        EXPECT_EQ(std::memcmp(all.data(), all.data() + r * n, static_cast<size_t>(n) * sizeof(float)), 0)
            << "rank " << r << "'s sum differs from rank 0's, n=" << n;
      }
    }
  });
}

// Rank r contributes [2, 3] = r * 100 + i; also a BF16 gather, since AllGather moves any dtype.
TEST_P(GlooSizeTest, AllGather) {
  const int size = GroupSize();
  OnEveryRank([&](Communicator& comm, int rank) {
    std::vector<float> in(6), out(6 * size, -1.0f);
    for (int i = 0; i < 6; ++i) in[i] = static_cast<float>(rank * 100 + i);
    Tensor out_t(out.data(), DType::kF32, {size, 2, 3});
    ASSERT_TRUE(comm.AllGather(&out_t, Tensor(in.data(), DType::kF32, {2, 3})).ok());
    for (int r = 0; r < size; ++r) {
      for (int i = 0; i < 6; ++i) EXPECT_EQ(out[r * 6 + i], static_cast<float>(r * 100 + i)) << "rank " << rank;
    }
    uint16_t mine = F32ToBf16(static_cast<float>(rank) + 0.5f);
    std::vector<uint16_t> gathered(size);
    Tensor gathered_t(gathered.data(), DType::kBF16, {size, 1});
    ASSERT_TRUE(comm.AllGather(&gathered_t, Tensor(&mine, DType::kBF16, {1})).ok());
    for (int r = 0; r < size; ++r) EXPECT_EQ(Bf16ToF32(gathered[r]), static_cast<float>(r) + 0.5f);
    // More than 1 MiB a rank (shared memory's piece), an odd count.
    const int64_t n = 300007;
    std::vector<float> big(n), all(n * size, -1.0f);
    for (int64_t i = 0; i < n; ++i) big[i] = AllReduceInput(rank, i);
    Tensor all_t(all.data(), DType::kF32, {size, n});
    ASSERT_TRUE(comm.AllGather(&all_t, Tensor(big.data(), DType::kF32, {n})).ok());
    int64_t wrong = 0;
    for (int r = 0; r < size; ++r) {
      for (int64_t i = 0; i < n; ++i) wrong += all[r * n + i] != AllReduceInput(r, i);
    }
    EXPECT_EQ(wrong, 0) << "rank " << rank;
  });
}

// Rows of [2, 3] with uneven counts, zeros included, then rows of [4] where rank 0 sends nothing,
// then rows of [4096] floats (16 KiB), 20 to 26 of them to each rank: more than 1 MiB from a rank
// of a group of four (shared memory's piece), its rows for one rank split over two pieces.
TEST_P(GlooSizeTest, AllToAllV) {
  const int size = GroupSize();
  OnEveryRank([&](Communicator& comm, int rank) {
    AllToAllCase uneven(rank, size, {2, 3}, UnevenRows);
    ASSERT_TRUE(uneven.Run(comm).ok()) << "rank " << rank;
    EXPECT_EQ(uneven.out, uneven.want) << "rank " << rank;
    AllToAllCase silent(rank, size, {4}, RankZeroSendsNothing);
    ASSERT_TRUE(silent.Run(comm).ok()) << "rank " << rank;
    EXPECT_EQ(silent.out, silent.want) << "rank " << rank;
    AllToAllCase big(rank, size, {4096}, ManyRows);
    ASSERT_TRUE(big.Run(comm).ok()) << "rank " << rank;
    EXPECT_TRUE(big.out == big.want) << "rank " << rank;
  });
}

// A stage waits at the barrier until the slowest (the last, after 100 ms per rank) has arrived.
TEST_P(GlooSizeTest, Barrier) {
  const int size = GroupSize();
  std::atomic<int> arrived{0};
  OnEveryRank([&](Communicator& comm, int rank) {
    for (int round = 1; round <= 2; ++round) {
      absl::SleepFor(absl::Milliseconds(100) * rank);
      arrived.fetch_add(1);
      ASSERT_TRUE(comm.Barrier().ok());
      EXPECT_GE(arrived.load(), round * size) << "rank " << rank << " left barrier " << round << " early";
    }
  });
  EXPECT_EQ(arrived.load(), 2 * size);
}

// A pipeline of three stages hands three micro-batches of different token counts down the line:
// stage 0 makes the hidden state, each later stage receives it and adds 1, stage 2 checks it.
// (With shared memory, a group of three sends over the host communicator.)
TEST_P(GlooTransportTest, SendRecvPipelineHandOff) {
  constexpr int kStages = 3;
  constexpr int64_t kHidden = 8;
  InMemoryRendezvousStore store;
  RunRanks(kStages, [&](int stage) {
    absl::StatusOr<std::unique_ptr<Communicator>> comm = Join(GetParam(), &store, "pp", stage, kStages);
    ASSERT_TRUE(comm.ok()) << comm.status();
    for (int64_t tokens : {int64_t{1}, int64_t{4}, int64_t{7}}) {
      std::vector<float> hidden(tokens * kHidden, -1.0f);
      Tensor h(hidden.data(), DType::kF32, {tokens, kHidden});
      if (stage == 0) {
        for (int64_t i = 0; i < tokens * kHidden; ++i) hidden[i] = static_cast<float>(tokens * 1000 + i);
      } else {
        ASSERT_TRUE((*comm)->Recv(&h, stage - 1).ok()) << "stage " << stage;
        for (float& v : hidden) v += 1.0f;
      }
      if (stage + 1 < kStages) {
        ASSERT_TRUE((*comm)->Send(h, stage + 1).ok()) << "stage " << stage;
      } else {
        for (int64_t i = 0; i < tokens * kHidden; ++i) {
          EXPECT_EQ(hidden[i], static_cast<float>(tokens * 1000 + i + kStages - 1)) << "tokens " << tokens;
        }
      }
    }
  });
}

// A pair of stages, as the worker's pipeline groups are: rank 0 sends a row, an empty tensor and
// more than 1 MiB (shared memory's piece, an odd count), an all-reduce between them; rank 1 sends
// the last back with 1 added.
TEST_P(GlooTransportTest, SendRecvOfAPair) {
  InMemoryRendezvousStore store;
  RunRanks(2, [&](int rank) {
    absl::StatusOr<std::unique_ptr<Communicator>> comm = Join(GetParam(), &store, "pp", rank, 2);
    ASSERT_TRUE(comm.ok()) << comm.status();
    Communicator& c = **comm;
    for (int64_t n : {int64_t{8}, int64_t{0}, int64_t{300007}}) {
      std::vector<float> x(n, -1.0f);
      Tensor t(x.data(), DType::kF32, {n});
      if (rank == 0) {
        for (int64_t i = 0; i < n; ++i) x[i] = AllReduceInput(3, i);
        ASSERT_TRUE(c.Send(t, 1).ok()) << "n=" << n;
      } else {
        ASSERT_TRUE(c.Recv(&t, 0).ok()) << "n=" << n;
        int64_t wrong = 0;
        for (int64_t i = 0; i < n; ++i) wrong += x[i] != AllReduceInput(3, i);
        EXPECT_EQ(wrong, 0) << "n=" << n;
      }
      float one[1] = {1.0f};
      Tensor o(one, DType::kF32, {1});
      ASSERT_TRUE(c.AllReduceSum(&o).ok());
      EXPECT_EQ(one[0], 2.0f);
      if (n == 300007) {
        if (rank == 1) {
          for (float& v : x) v += 1.0f;
          ASSERT_TRUE(c.Send(t, 0).ok());
        } else {
          ASSERT_TRUE(c.Recv(&t, 1).ok());
          int64_t wrong = 0;
          for (int64_t i = 0; i < n; ++i) wrong += x[i] != AllReduceInput(3, i) + 1.0f;
          EXPECT_EQ(wrong, 0);
        }
      }
    }
  });
}

// ---- Host-staged (StagedCommunicator over Gloo) ---------------------------------------------------

// A "device" whose memory holds every byte XOR 0x5A: only a communicator that copies through the
// copier sees the real values, so one that handed device pointers to Gloo would sum, gather and
// send scrambled bytes and fail these checks. `fail_after` copies succeed, then every copy fails.
class ScramblingCopier final : public DeviceCopier {
 public:
  explicit ScramblingCopier(int fail_after = -1) : fail_after_(fail_after) {}
  absl::Status ToHost(void* host_dst, const void* device_src, size_t bytes) override {
    return Copy(host_dst, device_src, bytes);
  }
  absl::Status ToDevice(void* device_dst, const void* host_src, size_t bytes) override {
    return Copy(device_dst, host_src, bytes);
  }
  absl::Status Synchronize() override { return absl::OkStatus(); }
  static void Scramble(void* p, size_t bytes) {
    for (size_t i = 0; i < bytes; ++i) static_cast<uint8_t*>(p)[i] ^= 0x5A;
  }

 private:
  absl::Status Copy(void* dst, const void* src, size_t bytes) {
    if (fail_after_ >= 0 && copies_++ >= fail_after_) return absl::InternalError("test copier: the device is gone");
    std::memcpy(dst, src, bytes);
    Scramble(dst, bytes);
    return absl::OkStatus();
  }
  const int fail_after_;
  int copies_ = 0;
};

// Two ranks, as two CUDA workers sharing one GPU with --collectives gloo would run them: an
// all-reduce of F32 and of BF16 (widened to float32 on the host: Gloo sums F32 and I32 only), an
// all-gather, a pipeline send/recv, an all-to-all and a barrier, every tensor in "device" memory.
TEST_F(CommunicatorTest, StagedOverGlooMovesDeviceTensors) {
  InMemoryRendezvousStore store;
  RunRanks(2, [&](int rank) {
    absl::StatusOr<std::unique_ptr<Communicator>> gloo = JoinGloo(&store, "staged", rank, 2);
    ASSERT_TRUE(gloo.ok()) << gloo.status();
    StagedCommunicator comm(std::move(*gloo), std::make_unique<ScramblingCopier>());
    EXPECT_EQ(comm.rank(), rank);
    EXPECT_EQ(comm.size(), 2);
    // F32, 300007 elements (over Gloo's 1 MiB segment).
    const int64_t n = 300007;
    std::vector<float> x(n);
    for (int64_t i = 0; i < n; ++i) x[i] = AllReduceInput(rank, i);
    ScramblingCopier::Scramble(x.data(), n * sizeof(float));
    Tensor t(x.data(), DType::kF32, {n});
    ASSERT_TRUE(comm.AllReduceSum(&t).ok());
    ScramblingCopier::Scramble(x.data(), n * sizeof(float));
    int64_t wrong = 0;
    for (int64_t i = 0; i < n; ++i) wrong += x[i] != AllReduceInput(0, i) + AllReduceInput(1, i);
    EXPECT_EQ(wrong, 0) << "rank " << rank;
    // BF16: multiples of 1/4 below 8 are exact in bfloat16, and so are their sums.
    std::vector<uint16_t> h(5);
    for (int i = 0; i < 5; ++i) h[i] = F32ToBf16(AllReduceInput(rank, i));
    ScramblingCopier::Scramble(h.data(), h.size() * 2);
    Tensor hb(h.data(), DType::kBF16, {5});
    ASSERT_TRUE(comm.AllReduceSum(&hb).ok());
    ScramblingCopier::Scramble(h.data(), h.size() * 2);
    for (int i = 0; i < 5; ++i) EXPECT_EQ(Bf16ToF32(h[i]), AllReduceInput(0, i) + AllReduceInput(1, i)) << i;
    // AllGather of [3] per rank into [2, 3].
    std::vector<float> in = {rank * 10.0f, rank * 10.0f + 1, rank * 10.0f + 2}, out(6, -1.0f);
    ScramblingCopier::Scramble(in.data(), 12);
    Tensor out_t(out.data(), DType::kF32, {2, 3});
    ASSERT_TRUE(comm.AllGather(&out_t, Tensor(in.data(), DType::kF32, {3})).ok());
    ScramblingCopier::Scramble(out.data(), 24);
    EXPECT_EQ(out, (std::vector<float>{0, 1, 2, 10, 11, 12})) << "rank " << rank;
    // Rank 0 sends its hidden state to rank 1.
    std::vector<float> hidden(4);
    for (int i = 0; i < 4; ++i) hidden[i] = rank == 0 ? 0.5f * i : -1.0f;
    ScramblingCopier::Scramble(hidden.data(), 16);
    Tensor ht(hidden.data(), DType::kF32, {1, 4});
    if (rank == 0) {
      ASSERT_TRUE(comm.Send(ht, 1).ok());
    } else {
      ASSERT_TRUE(comm.Recv(&ht, 0).ok());
      ScramblingCopier::Scramble(hidden.data(), 16);
      EXPECT_EQ(hidden, (std::vector<float>{0, 0.5f, 1, 1.5f}));
    }
    // An all-to-all of [2, 3] rows: rank 0 keeps one and sends none, rank 1 sends two and keeps one.
    AllToAllCase a2a(rank, 2, {2, 3}, UnevenRows);
    ScramblingCopier::Scramble(a2a.in.data(), a2a.in.size() * sizeof(float));
    ASSERT_TRUE(a2a.Run(comm).ok());
    ScramblingCopier::Scramble(a2a.out.data(), a2a.out.size() * sizeof(float));
    EXPECT_EQ(a2a.out, a2a.want) << "rank " << rank;
    EXPECT_TRUE(comm.Barrier().ok());
  });
}

// A failed copy breaks the communicator as a failed collective does: the error comes back, and
// every later call is FailedPrecondition quoting it (the peers are no longer in step).
TEST_F(CommunicatorTest, StagedCopyFailureBreaksTheCommunicator) {
  InMemoryRendezvousStore store;
  absl::StatusOr<std::unique_ptr<Communicator>> gloo = JoinGloo(&store, "staged-fail", 0, 1);
  ASSERT_TRUE(gloo.ok()) << gloo.status();
  StagedCommunicator comm(std::move(*gloo), std::make_unique<ScramblingCopier>(/*fail_after=*/2));
  float x[3] = {1, 2, 3};
  Tensor t(x, DType::kF32, {3});
  ASSERT_TRUE(comm.AllReduceSum(&t).ok());  // two copies
  absl::Status s = comm.AllReduceSum(&t);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_THAT(s.message(), HasSubstr("the device is gone"));
  s = comm.Barrier();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("the device is gone"));
}

// ---- Gloo: argument errors -------------------------------------------------------------------

TEST_F(CommunicatorTest, GlooRejectsBadArgumentsAndThenStaysBroken) {
  InMemoryRendezvousStore store;
  float x[4] = {};
  uint16_t h[4] = {};
  Tensor f32(x, DType::kF32, {4}), bf16(h, DType::kBF16, {4});

  absl::StatusOr<std::unique_ptr<Communicator>> comm = JoinGloo(&store, "bf16", 0, 1);
  ASSERT_TRUE(comm.ok()) << comm.status();
  absl::Status s = (*comm)->AllReduceSum(&bf16);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("F32 and I32"));
  s = (*comm)->AllReduceSum(&f32);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("F32 and I32"));  // it quotes the first error

  comm = JoinGloo(&store, "gather", 0, 1);
  ASSERT_TRUE(comm.ok()) << comm.status();
  Tensor wrong(x, DType::kF32, {2, 2});  // should be [1, 4]
  EXPECT_EQ((*comm)->AllGather(&wrong, f32).code(), absl::StatusCode::kInvalidArgument);

  comm = JoinGloo(&store, "self", 0, 1);
  ASSERT_TRUE(comm.ok()) << comm.status();
  EXPECT_EQ((*comm)->Send(f32, 0).code(), absl::StatusCode::kInvalidArgument);

  EXPECT_EQ(JoinGloo(&store, "g", 2, 2).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(JoinGloo(&store, "", 0, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(JoinGloo(&store, "g", 0, 1, absl::ZeroDuration()).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(JoinGloo(nullptr, "g", 0, 1).status().code(), absl::StatusCode::kInvalidArgument);
  // 192.0.2.1 (TEST-NET-1) is no address of this machine.
  absl::StatusOr<std::unique_ptr<Communicator>> unbindable =
      MakeGlooCommunicator(&store, "g", 0, 1, "192.0.2.1", kTimeout);
  EXPECT_EQ(unbindable.status().code(), absl::StatusCode::kInvalidArgument) << unbindable.status();
}

// Each bad AllToAllV on a communicator of its own: InvalidArgument naming the problem, and then
// the communicator is unusable, quoting it.
TEST_F(CommunicatorTest, GlooAllToAllVRejectsBadArgumentsAndThenStaysBroken) {
  InMemoryRendezvousStore store;
  float x[6] = {}, y[6] = {};
  uint16_t h[6] = {};
  const Tensor in(x, DType::kF32, {3, 2});
  Tensor out(y, DType::kF32, {3, 2}), bf16(h, DType::kBF16, {3, 2}), flat(y, DType::kF32, {6}), same = in;
  struct Case {
    Tensor* out;
    std::vector<int64_t> send_rows, recv_rows;
    std::string error;
  };
  const std::vector<Case> cases = {
      {&out, {3, 0}, {3}, "send_rows [3, 0] has 2 entries, not one per rank of the group of 1"},
      {&out, {3}, {}, "recv_rows [] has 0 entries"},
      {&out, {2}, {3}, "send_rows [2] adds up to 2, not the 3 rows of in"},
      {&out, {3}, {4}, "recv_rows [4] adds up to more than the 3 rows of out"},
      {&out, {-1}, {3}, "send_rows [-1] has a negative count"},
      {&bf16, {3}, {3}, "got out BF16 [3, 2] and in F32 [3, 2]"},
      {&flat, {3}, {3}, "got out F32 [6] and in F32 [3, 2]"},
      {&same, {3}, {3}, "in and out overlap"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    absl::StatusOr<std::unique_ptr<Communicator>> comm = JoinGloo(&store, absl::StrCat("a2a", i), 0, 1);
    ASSERT_TRUE(comm.ok()) << comm.status();
    absl::Status s = (*comm)->AllToAllV(c.out, in, c.send_rows, c.recv_rows);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.error;
    EXPECT_THAT(s.message(), HasSubstr(c.error));
    s = (*comm)->AllToAllV(&out, in, {3}, {3});
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << c.error;
    EXPECT_THAT(s.message(), HasSubstr(c.error));  // it quotes the first error
  }
}

// Rank 0 sends rank 1 two rows where rank 1 expects one. The counts travel ahead of the rows, so
// both ranks say so at once, and no row lands (not even a rank's own).
TEST_P(GlooTransportTest, AllToAllVWithCountsThatDisagreeIsAnErrorOnBothRanks) {
  InMemoryRendezvousStore store;
  RunRanks(2, [&](int rank) {
    absl::StatusOr<std::unique_ptr<Communicator>> comm = Join(GetParam(), &store, "ep", rank, 2, kTimeout);
    ASSERT_TRUE(comm.ok()) << comm.status();
    const std::vector<int64_t> send_rows = {1, rank == 0 ? 2 : 1}, recv_rows = {1, 1};
    std::vector<float> x(4 * (1 + send_rows[1]), 0.5f), y(4 * 2, -1.0f);
    Tensor out(y.data(), DType::kF32, {2, 4});
    const absl::Time start = absl::Now();
    const absl::Status s = (*comm)->AllToAllV(&out, Tensor(x.data(), DType::kF32, {1 + send_rows[1], 4}),
                                              send_rows, recv_rows);
    const absl::Duration took = absl::Now() - start;
    PrintTime(absl::StrCat("rank ", rank, " AllToAllV with counts that disagree"), took);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr(rank == 0 ? "rank 1 expects 1 row(s) from this rank, which sends it 2"
                                                 : "rank 0 sends F32 [2, 4] but this rank expected F32 [1, 4]"));
    EXPECT_LT(took, kTimeout);
    EXPECT_EQ(y, std::vector<float>(8, -1.0f)) << "rank " << rank;
  });
}

// The receiver names both shapes; the sender, whose payload is never taken, times out.
TEST_F(CommunicatorTest, GlooRecvOfTheWrongShapeIsAnError) {
  InMemoryRendezvousStore store;
  absl::Notification sender_done;
  RunRanks(2, [&](int rank) {
    absl::StatusOr<std::unique_ptr<Communicator>> comm = JoinGloo(&store, "pp", rank, 2, kTimeout);
    ASSERT_TRUE(comm.ok()) << comm.status();
    if (rank == 0) {
      std::vector<float> x(4 * 8, 1.0f);
      const absl::Time start = absl::Now();
      absl::Status s = (*comm)->Send(Tensor(x.data(), DType::kF32, {4, 8}), 1);
      const absl::Duration took = absl::Now() - start;
      sender_done.Notify();
      PrintTime("Send whose Recv rejected the shape", took);
      EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
      EXPECT_LT(took, kTimeoutBound);
    } else {
      std::vector<float> y(4 * 16, -1.0f);
      Tensor t(y.data(), DType::kF32, {4, 16});
      absl::Status s = (*comm)->Recv(&t, 0);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_THAT(s.message(), HasSubstr("rank 0 sent F32 [4, 8] but this rank expected F32 [4, 16]"));
      EXPECT_EQ(y[0], -1.0f);  // no payload byte landed
      EXPECT_EQ((*comm)->Recv(&t, 0).code(), absl::StatusCode::kFailedPrecondition);
      sender_done.WaitForNotification();  // closing now would turn the sender's timeout into a lost connection
    }
  });
}

// ---- Gloo: peers that fail -------------------------------------------------------------------

// Size 3; one rank never calls MakeGlooCommunicator. The other two time out, naming it.
class GlooMissingRankTest : public Guarded<::testing::TestWithParam<int>> {};
INSTANTIATE_TEST_SUITE_P(Ranks, GlooMissingRankTest, ::testing::Values(0, 2),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return absl::StrCat("MissingRank", info.param);
                         });

TEST_P(GlooMissingRankTest, RendezvousTimesOut) {
  const int missing = GetParam();
  InMemoryRendezvousStore store;
  RunRanks(3, [&](int rank) {
    if (rank == missing) return;
    const absl::Time start = absl::Now();
    absl::StatusOr<std::unique_ptr<Communicator>> comm = JoinGloo(&store, "tp", rank, 3, kTimeout);
    const absl::Duration took = absl::Now() - start;
    PrintTime(absl::StrCat("rank ", rank, " MakeGlooCommunicator without rank ", missing), took);
    EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded) << comm.status();
    EXPECT_THAT(comm.status().message(), HasSubstr(absl::StrCat("rank ", missing, " did not join within 2s")));
    EXPECT_THAT(comm.status().message(), HasSubstr("group 'tp'"));
    EXPECT_GE(took, kTimeout - absl::Milliseconds(10));
    EXPECT_LT(took, kTimeoutBound);
  });
}

// Every rank calls `collective` (op `op`) once; then the last rank skips the second call. The
// others must not hang: each gets DeadlineExceeded, or Unavailable when a peer that timed out first
// closed its connection before this rank's own timeout; the first to time out always gets
// DeadlineExceeded. Every later call fails at once with FailedPrecondition.
void ExpectARankThatSkipsIsATimeoutForTheOthers(
    Transport transport, int size, const std::string& op,
    const std::function<absl::Status(Communicator&, int rank)>& collective) {
  const int skipper = size - 1;
  InMemoryRendezvousStore store;
  absl::BlockingCounter others_done(size - 1);
  absl::Mutex mu;
  std::vector<absl::StatusCode> codes;
  RunRanks(size, [&](int rank) {
    absl::StatusOr<std::unique_ptr<Communicator>> comm = Join(transport, &store, "tp", rank, size, kTimeout);
    ASSERT_TRUE(comm.ok()) << comm.status();
    ASSERT_TRUE(collective(**comm, rank).ok());
    if (rank == skipper) {
      others_done.Wait();  // alive, but not calling; exiting would be a lost connection instead
      return;
    }
    const absl::Time start = absl::Now();
    absl::Status s = collective(**comm, rank);
    const absl::Duration took = absl::Now() - start;
    others_done.DecrementCount();
    PrintTime(absl::StrCat("rank ", rank, " ", op, " while rank ", skipper,
                           " skips it: ", absl::StatusCodeToString(s.code())),
              took);
    EXPECT_THAT(s.code(), AnyOf(absl::StatusCode::kDeadlineExceeded, absl::StatusCode::kUnavailable)) << s;
    EXPECT_THAT(s.message(), HasSubstr(absl::StrCat(op, " in group 'tp'")));
    EXPECT_LT(took, kTimeoutBound);
    {
      absl::MutexLock lock(&mu);
      codes.push_back(s.code());
    }
    // At once: the stored error (FailedPrecondition quoting the first), not a new exchange with
    // the silent rank, which would wait out its timeout and end in DeadlineExceeded or Unavailable.
    // The status says which; the time is only bounded by that timeout, which a call that tried
    // the network would take and one that returns the stored error, however loaded the machine,
    // does not.
    const absl::Time again = absl::Now();
    absl::Status later = (*comm)->Barrier();
    EXPECT_EQ(later.code(), absl::StatusCode::kFailedPrecondition) << later;
    EXPECT_THAT(later.message(), HasSubstr(s.message()));
    EXPECT_LT(absl::Now() - again, kTimeout);
  });
  EXPECT_THAT(codes, ::testing::Contains(absl::StatusCode::kDeadlineExceeded));
}

class GlooPeersTest : public Guarded<::testing::TestWithParam<TransportAndSize>> {};
INSTANTIATE_TEST_SUITE_P(Sizes, GlooPeersTest,
                         ::testing::Combine(::testing::Values(Transport::kTcp, Transport::kSharedMemory),
                                            ::testing::Values(2, 3, 4)),
                         TransportAndSizeName);

TEST_P(GlooPeersTest, RankThatSkipsAnAllReduceIsATimeoutForTheOthers) {
  const auto [transport, size] = GetParam();
  ExpectARankThatSkipsIsATimeoutForTheOthers(transport, size, "AllReduceSum", [](Communicator& comm, int) {
    float x[3] = {1, 2, 3};
    Tensor t(x, DType::kF32, {3});
    return comm.AllReduceSum(&t);
  });
}

TEST_P(GlooPeersTest, RankThatSkipsAnAllToAllIsATimeoutForTheOthers) {
  const auto [transport, size] = GetParam();
  ExpectARankThatSkipsIsATimeoutForTheOthers(transport, size, "AllToAllV", [size](Communicator& comm, int rank) {
    AllToAllCase c(rank, size, {3}, UnevenRows);
    return c.Run(comm);
  });
}

// A rank that goes away (its communicator destroyed, as when its process exits) is a lost
// connection for its peer, reported at once rather than after the timeout.

TEST_P(GlooTransportTest, PeerThatExitsIsUnavailable) {
  InMemoryRendezvousStore store;
  absl::Notification joined, gone;
  RunRanks(2, [&](int rank) {
    absl::StatusOr<std::unique_ptr<Communicator>> comm = Join(GetParam(), &store, "tp", rank, 2, kTimeout);
    if (rank == 0) joined.Notify();  // also on failure, so that rank 1 never waits for nothing
    ASSERT_TRUE(comm.ok()) << comm.status();
    if (rank == 1) {
      // Only once rank 0 has joined too: leaving while it still connects fails its join instead
      // (seen in CI: "Connection closed by peer" from rank 0's rendezvous).
      joined.WaitForNotification();
      comm->reset();
      gone.Notify();
      return;
    }
    gone.WaitForNotification();
    float x[3] = {1, 2, 3};
    Tensor t(x, DType::kF32, {3});
    const absl::Time start = absl::Now();
    absl::Status s = (*comm)->AllReduceSum(&t);
    const absl::Duration took = absl::Now() - start;
    PrintTime("AllReduceSum with a peer that exited", took);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_LT(took, kTimeout);
  });
}

// ---- Gloo with shared memory: what only it checks ----------------------------------------------

// Ranks that call different collectives, or one with different sizes, at the same point: every
// rank gets InvalidArgument naming both calls (Gloo's TCP would exchange mismatched bytes).
TEST_F(CommunicatorTest, SharedMemoryRanksThatCallDifferentCollectivesAreAnErrorOnEveryRank) {
  InMemoryRendezvousStore store;
  RunRanks(2, [&](int rank) {
    float x[4] = {1, 2, 3, 4};
    std::vector<float> gathered(8);
    absl::StatusOr<std::unique_ptr<Communicator>> kinds =
        Join(Transport::kSharedMemory, &store, "kinds", rank, 2, kTimeout);
    ASSERT_TRUE(kinds.ok()) << kinds.status();
    Tensor all(gathered.data(), DType::kF32, {2, 4}), mine(x, DType::kF32, {4});
    absl::Status s = rank == 0 ? (*kinds)->AllReduceSum(&mine) : (*kinds)->AllGather(&all, mine);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr(rank == 0 ? "shared-memory AllReduceSum in group 'kinds' (rank 0 of 2): rank "
                                                   "1 called AllGather of 16 bytes where this rank called "
                                                   "AllReduceSum of F32 of 16 bytes"
                                                 : "shared-memory AllGather in group 'kinds' (rank 1 of 2): rank 0 "
                                                   "called AllReduceSum of F32 of 16 bytes where this rank called "
                                                   "AllGather of 16 bytes"));
    EXPECT_EQ((*kinds)->Barrier().code(), absl::StatusCode::kFailedPrecondition);

    absl::StatusOr<std::unique_ptr<Communicator>> sizes =
        Join(Transport::kSharedMemory, &store, "sizes", rank, 2, kTimeout);
    ASSERT_TRUE(sizes.ok()) << sizes.status();
    Tensor t(x, DType::kF32, {4 - rank});
    s = (*sizes)->AllReduceSum(&t);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr(rank == 0 ? "rank 1 called AllReduceSum of F32 of 12 bytes where this rank "
                                                   "called AllReduceSum of F32 of 16 bytes"
                                                 : "rank 0 called AllReduceSum of F32 of 16 bytes where this rank "
                                                   "called AllReduceSum of F32 of 12 bytes"));
  });
}

// A Send and a Recv of different shapes, or two Sends: both ranks get InvalidArgument naming both
// sides, at once (over TCP the sender of a rejected Send times out: GlooRecvOfTheWrongShapeIsAnError).
TEST_F(CommunicatorTest, SharedMemorySendAndRecvThatDisagreeAreAnErrorOnBothRanks) {
  InMemoryRendezvousStore store;
  RunRanks(2, [&](int rank) {
    std::vector<float> x(4 * 16, -1.0f);
    absl::StatusOr<std::unique_ptr<Communicator>> shapes =
        Join(Transport::kSharedMemory, &store, "shapes", rank, 2, kTimeout);
    ASSERT_TRUE(shapes.ok()) << shapes.status();
    const absl::Time start = absl::Now();
    absl::Status s = rank == 0 ? (*shapes)->Send(Tensor(x.data(), DType::kF32, {4, 8}), 1)
                               : [&] {
                                   Tensor t(x.data(), DType::kF32, {4, 16});
                                   return (*shapes)->Recv(&t, 0);
                                 }();
    EXPECT_LT(absl::Now() - start, kTimeout);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr(rank == 0 ? "rank 1 expected F32 [4, 16] but this rank sent F32 [4, 8]"
                                                 : "rank 0 sent F32 [4, 8] but this rank expected F32 [4, 16]"));
    EXPECT_EQ(x[0], -1.0f);  // nothing landed

    absl::StatusOr<std::unique_ptr<Communicator>> sends =
        Join(Transport::kSharedMemory, &store, "sends", rank, 2, kTimeout);
    ASSERT_TRUE(sends.ok()) << sends.status();
    s = (*sends)->Send(Tensor(x.data(), DType::kF32, {4}), 1 - rank);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("rank ", 1 - rank, " called Send of 16 bytes where this rank "
                                                    "called Send of 16 bytes (a Send meets the peer's Recv)")));
  });
}

// A RendezvousStore in a directory, one file a key: for ranks in separate processes.
class DirectoryStore final : public RendezvousStore {
 public:
  explicit DirectoryStore(std::string dir) : dir_(std::move(dir)) {}
  absl::Status Set(const std::string& key, const std::string& value) override {
    const std::string tmp = absl::StrCat(Path(key), ".", getpid());
    {
      std::ofstream out(tmp, std::ios::binary);
      out << value;
      if (!out) return absl::InternalError(absl::StrCat("cannot write ", tmp));
    }
    if (std::rename(tmp.c_str(), Path(key).c_str()) != 0) return absl::InternalError("rename failed");
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      std::ifstream in(Path(key), std::ios::binary);
      if (in) return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      if (absl::Now() > deadline) return absl::DeadlineExceededError(absl::StrCat("no key '", key, "'"));
      absl::SleepFor(absl::Milliseconds(1));
    }
  }

 private:
  std::string Path(std::string key) const {
    std::replace(key.begin(), key.end(), '/', '_');
    return absl::StrCat(dir_, "/", key);
  }
  const std::string dir_;
};

// A peer whose process dies without a word (SIGKILL: no destructor tells the segment it left) is
// Unavailable once the liveness check sees its mutex's owner dead (every 10 ms of waiting), not
// after the timeout. The peer is a child process. No watchdog here: its thread would be copied
// into the child half way; the child ends itself (alarm) and the waits are bounded by the
// communicator's timeout.
// The ranks of a group on one host against the CPUs they share (OversubscriptionNote).
RankCpus Cpus(int threads, std::initializer_list<int> cpus) {
  RankCpus r;
  r.threads = threads;
  CPU_ZERO(&r.cpus);
  for (int c : cpus) CPU_SET(c, &r.cpus);
  return r;
}

TEST(HostCpusTest, ThreadsBeyondTheSharedCpusAreNamedWithEachRanksShare) {
  // Two workers of 2 threads on the same 2 CPUs (each with OpenMP's default on a 2-CPU host).
  const std::vector<RankCpus> two = {Cpus(2, {0, 1}), Cpus(2, {0, 1})};
  EXPECT_THAT(OversubscriptionNote(two), ::testing::AllOf(::testing::HasSubstr("2 ranks on this host run 4 compute "
                                                                               "threads on its 2 CPUs"),
                                                          ::testing::HasSubstr("--threads 1 ")));
  // Four ranks of 3 threads on 8 CPUs: 12 > 8; a share of 2 each.
  const std::vector<RankCpus> four = {Cpus(3, {0, 1, 2, 3, 4, 5, 6, 7}), Cpus(3, {0, 1, 2, 3, 4, 5, 6, 7}),
                                      Cpus(3, {0, 1, 2, 3, 4, 5, 6, 7}), Cpus(3, {0, 1, 2, 3, 4, 5, 6, 7})};
  EXPECT_THAT(OversubscriptionNote(four), ::testing::HasSubstr("run 12 compute threads on its 8 CPUs"));
  EXPECT_THAT(OversubscriptionNote(four), ::testing::HasSubstr("--threads 2 "));
  // More ranks than CPUs: a share of at least one thread.
  EXPECT_THAT(OversubscriptionNote({Cpus(1, {0}), Cpus(1, {0})}),
              ::testing::HasSubstr("2 compute threads on its 1 CPU:"));
  EXPECT_THAT(OversubscriptionNote({Cpus(1, {0}), Cpus(1, {0})}), ::testing::HasSubstr("--threads 1 "));
}

TEST(HostCpusTest, ThreadsWithinTheirCpusAreFine) {
  EXPECT_EQ(OversubscriptionNote({Cpus(1, {0, 1}), Cpus(1, {0, 1})}), "");  // launch's share
  EXPECT_EQ(OversubscriptionNote({Cpus(2, {0, 1, 2, 3}), Cpus(1, {0, 1, 2, 3})}), "");
  // Ranks pinned to CPUs of their own count apart: 2 + 2 threads on 4 CPUs.
  EXPECT_EQ(OversubscriptionNote({Cpus(2, {0, 1}), Cpus(2, {2, 3})}), "");
  EXPECT_NE(OversubscriptionNote({Cpus(2, {0, 1}), Cpus(3, {2, 3})}), "");
  EXPECT_EQ(OversubscriptionNote({}), "");
}

// HostCpuShare through a group: every rank gathers the others' threads and affinity, and all
// return the same note.
TEST(HostCpusTest, HostCpuShareGathersEveryRanksThreadsAndCpus) {
  cpu_set_t mine;
  ASSERT_EQ(sched_getaffinity(0, sizeof(mine), &mine), 0);
  const int cpus = CPU_COUNT(&mine);
  for (const int threads : {1, cpus + 1}) {
    InMemoryRendezvousStore store;
    std::string notes[2];
    RunRanks(2, [&](int rank) {
      absl::StatusOr<std::unique_ptr<Communicator>> comm =
          Join(Transport::kSharedMemory, &store, absl::StrCat("cpus", threads), rank, 2, kTimeout);
      ASSERT_TRUE(comm.ok()) << comm.status();
      absl::StatusOr<std::string> note = HostCpuShare(**comm, threads);
      ASSERT_TRUE(note.ok()) << note.status();
      notes[rank] = *note;
    });
    EXPECT_EQ(notes[0], notes[1]);
    if (2 * threads > cpus) {
      EXPECT_THAT(notes[0], ::testing::HasSubstr(absl::StrCat("2 ranks on this host run ", 2 * threads,
                                                              " compute threads on its ", cpus, " CPU")));
    } else {
      EXPECT_EQ(notes[0], "");
    }
  }
}

TEST(SharedMemoryProcessTest, PeerProcessThatDiesIsUnavailable) {
  char dir[] = "/tmp/communicator_test_XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  float x[3] = {1, 2, 3};
  Tensor t(x, DType::kF32, {3});
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    alarm(60);
    DirectoryStore store(dir);
    absl::StatusOr<std::unique_ptr<Communicator>> comm = Join(Transport::kSharedMemory, &store, "tp", 1, 2);
    if (!comm.ok() || !(*comm)->AllReduceSum(&t).ok()) _exit(2);
    kill(getpid(), SIGKILL);
  }
  DirectoryStore store(dir);
  absl::StatusOr<std::unique_ptr<Communicator>> comm = Join(Transport::kSharedMemory, &store, "tp", 0, 2);
  absl::Status first = comm.ok() ? (*comm)->AllReduceSum(&t) : comm.status();
  EXPECT_TRUE(first.ok()) << first;
  EXPECT_EQ(x[2], 6.0f);
  absl::Status s;
  absl::Duration took;
  if (first.ok()) {
    const absl::Time start = absl::Now();
    s = (*comm)->AllReduceSum(&t);
    took = absl::Now() - start;
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "child status " << status;
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(first.ok());
  PrintTime("shared-memory AllReduceSum with a peer process killed", took);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("rank 1's process ended"));
  EXPECT_LT(took, kNoTimeout / 4);
}

// Gloo writes with writev, and a write to a connection the peer has closed raises SIGPIPE, whose
// default action would end this process instead of giving an Unavailable error.
TEST_F(CommunicatorTest, GlooLeavesSigpipeIgnored) {
  InMemoryRendezvousStore store;
  ASSERT_TRUE(JoinGloo(&store, "tp", 0, 1).ok());
  struct sigaction action {};
  ASSERT_EQ(sigaction(SIGPIPE, nullptr, &action), 0);
  EXPECT_EQ(action.sa_handler, SIG_IGN);
}

// A Send that no Recv ever matches.
TEST_F(CommunicatorTest, GlooSendToAPeerThatNeverReceivesTimesOut) {
  InMemoryRendezvousStore store;
  absl::Notification sender_done;
  RunRanks(2, [&](int rank) {
    absl::StatusOr<std::unique_ptr<Communicator>> comm = JoinGloo(&store, "pp", rank, 2, kTimeout);
    ASSERT_TRUE(comm.ok()) << comm.status();
    if (rank == 1) {
      sender_done.WaitForNotification();
      return;
    }
    float x[3] = {1, 2, 3};
    const absl::Time start = absl::Now();
    absl::Status s = (*comm)->Send(Tensor(x, DType::kF32, {3}), 1);
    const absl::Duration took = absl::Now() - start;
    sender_done.Notify();
    PrintTime("Send that no Recv matches", took);
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_THAT(s.message(), HasSubstr("Send in group 'pp' (rank 0 of 2): timed out: no progress from rank 1"));
    EXPECT_LT(took, kTimeoutBound);
  });
}

// ---- NCCL ------------------------------------------------------------------------------------

#if SHARDSERVE_HAVE_CUDA

// Why a test that needs `n` GPUs cannot run here, or "" when it can.
std::string MissingGpus(int n) {
  const int count = CudaDeviceCount();
  if (count == 0) return "no CUDA device";
  if (count < n) return absl::StrCat("needs ", n, " CUDA devices, found ", count);
  return "";
}

// A device allocation on the current device with synchronous host copies, freed on destruction.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) { EXPECT_EQ(cudaMalloc(&data_, bytes), cudaSuccess); }
  ~DeviceBuffer() { cudaFree(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return data_; }
  void Upload(const void* host) { EXPECT_EQ(cudaMemcpy(data_, host, bytes_, cudaMemcpyHostToDevice), cudaSuccess); }
  void Download(void* host) const { EXPECT_EQ(cudaMemcpy(host, data_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess); }

 private:
  void* data_ = nullptr;
  size_t bytes_;
};

// Rank `rank` of an NCCL group on GPU `device`, with a stream of its own; fn runs with the
// communicator, which is destroyed before the stream.
void WithNccl(RendezvousStore* store, const std::string& group, int rank, int size, int device, absl::Duration timeout,
              const std::function<void(absl::StatusOr<std::unique_ptr<Communicator>>&)>& fn) {
  ASSERT_EQ(cudaSetDevice(device), cudaSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  {
    absl::StatusOr<std::unique_ptr<Communicator>> comm =
        MakeNcclCommunicator(store, group, rank, size, device, stream, timeout);
    fn(comm);
  }
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// Runs `c` with its tensors in device memory of the current device; returns the output.
std::vector<float> RunOnDevice(Communicator& comm, AllToAllCase& c) {
  DeviceBuffer in(c.in.size() * sizeof(float)), out(c.out.size() * sizeof(float));
  in.Upload(c.in.data());
  out.Upload(c.out.data());
  Tensor out_t = c.Rows(out.data(), c.recv_rows);
  EXPECT_TRUE(comm.AllToAllV(&out_t, c.Rows(in.data(), c.send_rows), c.send_rows, c.recv_rows).ok());
  out.Download(c.out.data());
  return c.out;
}

TEST_F(CommunicatorTest, NcclGroupOfOne) {
  if (std::string why = MissingGpus(1); !why.empty()) GTEST_SKIP() << why;
  InMemoryRendezvousStore store;
  WithNccl(&store, "tp", 0, 1, /*device=*/0, kNoTimeout, [&](absl::StatusOr<std::unique_ptr<Communicator>>& comm) {
    ASSERT_TRUE(comm.ok()) << comm.status();
    const std::vector<float> x = {1.5f, -2.0f, 0.25f};
    DeviceBuffer in(sizeof(float) * 3), out(sizeof(float) * 3);
    in.Upload(x.data());
    Tensor t(in.data(), DType::kF32, {3});
    ASSERT_TRUE((*comm)->AllReduceSum(&t).ok());
    Tensor gathered(out.data(), DType::kF32, {1, 3});
    ASSERT_TRUE((*comm)->AllGather(&gathered, t).ok());
    ASSERT_TRUE((*comm)->Barrier().ok());
    std::vector<float> got(3);
    out.Download(got.data());
    EXPECT_EQ(got, x);
    AllToAllCase a2a(0, 1, {2, 3}, UnevenRows);  // one row, to itself
    EXPECT_EQ(RunOnDevice(**comm, a2a), a2a.want);
  });
}

// Size 2, and only one rank joins (on GPU 0): rank 0 waits for NCCL's init, rank 1 for the unique id.
TEST_F(CommunicatorTest, NcclRankThatNeverJoinsTimesOut) {
  if (std::string why = MissingGpus(1); !why.empty()) GTEST_SKIP() << why;
  for (int present : {0, 1}) {
    InMemoryRendezvousStore store;
    std::thread alone([&] {
      WithNccl(&store, "tp", present, 2, /*device=*/0, kTimeout,
               [&](absl::StatusOr<std::unique_ptr<Communicator>>& comm) {
                 EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded) << comm.status();
               });
    });
    const absl::Time start = absl::Now();
    alone.join();
    const absl::Duration took = absl::Now() - start;
    PrintTime(absl::StrCat("MakeNcclCommunicator of rank ", present, " alone"), took);
    EXPECT_LT(took, kTimeoutBound);
  }
}

// Two GPUs: sums in F32 and BF16, a gather, a pipeline hand-off each way, an all-to-all, a barrier.
TEST_F(CommunicatorTest, NcclTwoRanks) {
  if (std::string why = MissingGpus(2); !why.empty()) GTEST_SKIP() << why;
  InMemoryRendezvousStore store;
  RunRanks(2, [&](int rank) {
    WithNccl(&store, "tp", rank, 2, /*device=*/rank, kNoTimeout,
             [&](absl::StatusOr<std::unique_ptr<Communicator>>& comm) {
               ASSERT_TRUE(comm.ok()) << comm.status();
               constexpr int64_t n = 1000;
               std::vector<float> x(n);
               for (int64_t i = 0; i < n; ++i) x[i] = AllReduceInput(rank, i);
               DeviceBuffer f32(sizeof(float) * n);
               f32.Upload(x.data());
               Tensor t(f32.data(), DType::kF32, {n});
               ASSERT_TRUE((*comm)->AllReduceSum(&t).ok());
               f32.Download(x.data());
               for (int64_t i = 0; i < n; ++i) EXPECT_EQ(x[i], AllReduceInput(0, i) + AllReduceInput(1, i)) << i;

               std::vector<uint16_t> h(n);
               for (int64_t i = 0; i < n; ++i) h[i] = F32ToBf16(AllReduceInput(rank, i));
               DeviceBuffer bf16(sizeof(uint16_t) * n);
               bf16.Upload(h.data());
               Tensor hb(bf16.data(), DType::kBF16, {n});
               ASSERT_TRUE((*comm)->AllReduceSum(&hb).ok());
               bf16.Download(h.data());
               for (int64_t i = 0; i < n; ++i)
                 EXPECT_EQ(Bf16ToF32(h[i]), AllReduceInput(0, i) + AllReduceInput(1, i)) << i;

               const std::vector<float> mine = {static_cast<float>(rank), static_cast<float>(rank) + 0.5f};
               DeviceBuffer in(sizeof(float) * 2), out(sizeof(float) * 4);
               in.Upload(mine.data());
               Tensor gathered(out.data(), DType::kF32, {2, 2});
               ASSERT_TRUE((*comm)->AllGather(&gathered, Tensor(in.data(), DType::kF32, {2})).ok());
               std::vector<float> all(4);
               out.Download(all.data());
               EXPECT_EQ(all, (std::vector<float>{0.0f, 0.5f, 1.0f, 1.5f}));

               // Stage 0 sends to stage 1, then stage 1 sends back: `in` carries the hidden state.
               const int peer = 1 - rank;
               Tensor hidden(in.data(), DType::kF32, {2});
               if (rank == 0) {
                 ASSERT_TRUE((*comm)->Send(hidden, peer).ok());
                 ASSERT_TRUE((*comm)->Recv(&hidden, peer).ok());
               } else {
                 ASSERT_TRUE((*comm)->Recv(&hidden, peer).ok());
                 ASSERT_TRUE((*comm)->Send(hidden, peer).ok());
               }
               std::vector<float> got(2);
               in.Download(got.data());
               EXPECT_EQ(got, (std::vector<float>{0.0f, 0.5f}));  // rank 0's values, on both ranks

               // Rows of [2, 3]: rank 0 keeps one and sends rank 1 none, rank 1 sends two and keeps one.
               AllToAllCase a2a(rank, 2, {2, 3}, UnevenRows);
               EXPECT_EQ(RunOnDevice(**comm, a2a), a2a.want) << "rank " << rank;
               ASSERT_TRUE((*comm)->Barrier().ok());
             });
  });
}

TEST_F(CommunicatorTest, NcclRankThatSkipsAnAllReduceIsATimeout) {
  if (std::string why = MissingGpus(2); !why.empty()) GTEST_SKIP() << why;
  InMemoryRendezvousStore store;
  absl::Notification rank0_done;
  RunRanks(2, [&](int rank) {
    WithNccl(&store, "tp", rank, 2, /*device=*/rank, kTimeout,
             [&](absl::StatusOr<std::unique_ptr<Communicator>>& comm) {
               ASSERT_TRUE(comm.ok()) << comm.status();
               DeviceBuffer buf(sizeof(float) * 4);
               Tensor t(buf.data(), DType::kF32, {4});
               ASSERT_TRUE((*comm)->AllReduceSum(&t).ok());
               if (rank == 1) {
                 rank0_done.WaitForNotification();
                 return;
               }
               const absl::Time start = absl::Now();
               absl::Status s = (*comm)->AllReduceSum(&t);
               const absl::Duration took = absl::Now() - start;
               rank0_done.Notify();
               PrintTime("NCCL AllReduceSum while rank 1 skips it", took);
               EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
               EXPECT_LT(took, kTimeoutBound);
               EXPECT_EQ((*comm)->Barrier().code(), absl::StatusCode::kFailedPrecondition);
             });
  });
}

#else  // !SHARDSERVE_HAVE_CUDA

TEST_F(CommunicatorTest, NcclIsUnimplementedWithoutCuda) {
  InMemoryRendezvousStore store;
  absl::StatusOr<std::unique_ptr<Communicator>> comm = MakeNcclCommunicator(&store, "tp", 0, 1, 0, nullptr, kTimeout);
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(comm.status().message(), HasSubstr("SHARDSERVE_WITH_CUDA"));
}

#endif  // SHARDSERVE_HAVE_CUDA

}  // namespace
}  // namespace shardserve
