#include "worker/comm/shared_memory_communicator.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "base/status_macros.h"
#include "worker/comm/checks.h"

namespace shardserve {
namespace {

// ---- The segment ------------------------------------------------------------------------------
//
// [Header, padded to a page] [RankSlot x size] [buffer 0: size x kSlotBytes] [buffer 1: the same]
//
// Collectives go through in chunks of at most kSlotBytes. Chunk number `seq` (counted from 1 over
// the group's life; every rank counts the same, since every rank calls the same collectives) uses
// buffer seq % 2: rank r copies its piece into its part of that buffer, stores `seq` in its
// RankSlot's `arrived` (a release), waits until every peer's `arrived` has reached `seq` (an
// acquire), and reads every rank's part. Two buffers suffice: a rank writes chunk seq + 2 into the
// buffer of chunk seq only after it has seen every peer arrive at seq + 1, which each peer does only
// after it has read chunk seq.

constexpr uint64_t kMagic = 0x31534d48'53534853;  // "SHSSHMS1"
constexpr size_t kSlotBytes = size_t{1} << 20;
constexpr size_t kPage = 4096;

struct Header {
  uint64_t magic;
  uint64_t nonce[2];  // random: proves a rank opened the segment rank 0 made, not a namesake
  int64_t size;
  int64_t slot_bytes;
};

enum RankState : uint32_t { kJoined = 1, kLeft = 2, kFailed = 3 };
enum OpKind : uint32_t {
  kSumF32 = 1,
  kSumI32 = 2,
  kGather = 3,
  kAllToAllCounts = 4,
  kAllToAllRows = 5,
  kSend = 6,  // of a group of two: a Send and its Recv meet as the two sides of one exchange
  kRecv = 7,
  kBarrier = 8,
};

// One rank's line, written by that rank (its peers write only `sleepers` and, once the rank's
// process has ended, `alive`). Cache-line pairs apart, so that a rank spinning on a peer's
// `arrived` does not steal the line its own writes go to.
struct alignas(128) RankSlot {
  std::atomic<uint32_t> arrived;   // the last chunk published; the futex word peers sleep on
  std::atomic<uint32_t> sleepers;  // peers asleep (or about to be) on `arrived`
  std::atomic<uint32_t> state;     // RankState
  uint32_t op[2];                  // the OpKind of the chunk in buffer 0 / 1
  int64_t op_bytes[2];             // and the bytes of its whole collective
  int64_t tensor[2][2 + Tensor::kMaxDims];  // a Send's or Recv's dtype, ndim and shape
  // A robust, process-shared mutex that a thread of the rank (Keeper) holds while it is in the
  // group. When that process ends, however it ends, the kernel marks the mutex's owner dead, and a
  // peer's trylock says so: a liveness check that needs no shared PID namespace (the workers of
  // one pod are containers with a PID namespace each).
  pthread_mutex_t alive;
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "the futex words are plain 32-bit atomics");

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }
size_t SlotsOffset() { return RoundUp(sizeof(Header), kPage); }
size_t BuffersOffset(int size) { return SlotsOffset() + RoundUp(sizeof(RankSlot) * size, kPage); }
size_t SegmentBytes(int size) { return BuffersOffset(size) + 2 * kSlotBytes * size; }

// A mapping of the segment, shared by the ranks one process holds: the tests run a group's ranks
// as threads of one process, which then see the segment at one address (so ThreadSanitizer sees
// their accesses meet, as they would across processes). Unmapped when its last rank lets it go.
class Mapping {
 public:
  Mapping() = default;
  bool ok() const { return region_ != nullptr; }
  Header* header() const { return reinterpret_cast<Header*>(base()); }
  RankSlot* slot(int rank) const { return reinterpret_cast<RankSlot*>(base() + SlotsOffset()) + rank; }
  uint8_t* piece(uint32_t seq, int rank, int size) const {
    return base() + BuffersOffset(size) + ((seq % 2) * size + rank) * kSlotBytes;
  }

  // Maps `bytes` of the open segment `fd` named `name`, or takes this process's mapping of it.
  static Mapping Map(const std::string& name, int fd, size_t bytes) {
    Mapping m;
    {
      absl::MutexLock lock(&mu_);
      std::weak_ptr<Region>& held = (*regions_)[name];
      m.region_ = held.lock();
      if (m.region_ == nullptr) {
        void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (base == MAP_FAILED) {
          regions_->erase(name);
          return m;
        }
        m.region_ = std::shared_ptr<Region>(new Region{name, static_cast<uint8_t*>(base), bytes}, Unmap);
        held = m.region_;
      }
    }
    if (m.region_->bytes != bytes) m.region_.reset();  // outside the lock: this may unmap it
    return m;
  }

 private:
  struct Region {
    std::string name;
    uint8_t* base;
    size_t bytes;
  };
  uint8_t* base() const { return region_->base; }
  static void Unmap(Region* r) {
    munmap(r->base, r->bytes);
    {
      absl::MutexLock lock(&mu_);
      auto it = regions_->find(r->name);
      if (it != regions_->end() && it->second.expired()) regions_->erase(it);
    }
    delete r;
  }

  static absl::Mutex mu_;
  static absl::flat_hash_map<std::string, std::weak_ptr<Region>>* regions_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<Region> region_;
};
absl::Mutex Mapping::mu_(absl::kConstInit);
absl::flat_hash_map<std::string, std::weak_ptr<Mapping::Region>>* Mapping::regions_ =
    new absl::flat_hash_map<std::string, std::weak_ptr<Mapping::Region>>();

// Holds a rank's `alive` mutex on a thread of its own from construction to destruction, so that
// the mutex is released exactly when the rank leaves the group or its process ends.
class Keeper {
 public:
  explicit Keeper(pthread_mutex_t* alive) : thread_([this, alive] {
    const bool locked = pthread_mutex_lock(alive) == 0;
    {
      std::unique_lock<std::mutex> lock(mu_);
      locked_ = locked;
      held_ = true;
      changed_.notify_all();
      changed_.wait(lock, [this] { return release_; });
    }
    if (locked) pthread_mutex_unlock(alive);
  }) {
    std::unique_lock<std::mutex> lock(mu_);
    changed_.wait(lock, [this] { return held_; });
  }
  ~Keeper() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      release_ = true;
    }
    changed_.notify_all();
    thread_.join();
  }
  bool ok() const { return locked_; }  // settled once the constructor returns

 private:
  // std's mutex and condition variable, not Abseil's: ThreadSanitizer sees pthread's (the
  // distribution's Abseil is not built with it).
  std::mutex mu_;
  std::condition_variable changed_;
  bool held_ = false, release_ = false, locked_ = false;
  std::thread thread_;  // last: it reads the members above
};

// Makes `slot`'s `alive` a robust, process-shared mutex. False if the system refuses.
bool InitAlive(RankSlot* slot) {
  pthread_mutexattr_t attr;
  if (pthread_mutexattr_init(&attr) != 0) return false;
  const bool ok = pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED) == 0 &&
                  pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST) == 0 &&
                  pthread_mutex_init(&slot->alive, &attr) == 0;
  pthread_mutexattr_destroy(&attr);
  return ok;
}

// True once the thread that held `slot`'s `alive` has let it go: its rank left, or its process
// ended (the kernel then marks the owner dead; this makes the mutex consistent and releases it, so
// that the other peers see it free too).
bool Released(RankSlot* slot) {
  const int rc = pthread_mutex_trylock(&slot->alive);
  if (rc == EBUSY) return false;
  if (rc == EOWNERDEAD) pthread_mutex_consistent(&slot->alive);
  if (rc == 0 || rc == EOWNERDEAD) pthread_mutex_unlock(&slot->alive);
  return true;
}

bool Reached(uint32_t arrived, uint32_t seq) { return static_cast<int32_t>(arrived - seq) >= 0; }

void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Shared (not private) futexes: the word is in a mapping of several processes.
void FutexWait(std::atomic<uint32_t>* word, uint32_t seen, absl::Duration limit) {
  const timespec ts = absl::ToTimespec(limit);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}
void FutexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

const char* OpName(uint32_t op) {
  switch (op) {
    case kSumF32:
      return "AllReduceSum of F32";
    case kSumI32:
      return "AllReduceSum of I32";
    case kGather:
      return "AllGather";
    case kAllToAllCounts:
    case kAllToAllRows:
      return "AllToAllV";
    case kSend:
      return "Send";
    case kRecv:
      return "Recv";
    case kBarrier:
      return "Barrier";
    default:
      return "an unknown collective";
  }
}

// A tensor's dtype, ndim and shape as RankSlot::tensor holds them, and back (ndim clamped to a
// valid count: a peer's words are only described, never used as a shape).
void WriteShape(const Tensor& t, int64_t* words) {
  words[0] = static_cast<int64_t>(t.dtype);
  words[1] = t.ndim;
  std::copy(t.shape.begin(), t.shape.end(), words + 2);
}
Tensor ReadShape(const int64_t* words) {
  Tensor t;
  t.dtype = static_cast<DType>(words[0]);
  t.ndim = static_cast<int>(std::clamp<int64_t>(words[1], 0, Tensor::kMaxDims));
  std::copy(words + 2, words + 2 + Tensor::kMaxDims, t.shape.begin());
  return t;
}

// What a rank publishes ahead of an AllToAllV's rows: its `in`'s dtype and shape, then its
// send_rows and recv_rows (one int64 a rank each), so that every pair of ranks whose counts,
// dtypes or row shapes disagree sees it before any row moves.
class AllToAllHeader {
 public:
  static size_t Bytes(int size) { return sizeof(int64_t) * (2 + Tensor::kMaxDims + 2 * static_cast<size_t>(size)); }
  static void Write(const Tensor& in, absl::Span<const int64_t> send_rows, absl::Span<const int64_t> recv_rows,
                    int64_t* to) {
    to[0] = static_cast<int64_t>(in.dtype);
    to[1] = in.ndim;
    to = std::copy(in.shape.begin(), in.shape.end(), to + 2);
    std::copy(recv_rows.begin(), recv_rows.end(), std::copy(send_rows.begin(), send_rows.end(), to));
  }
  // A peer's header, as published (read in place; aligned, since each piece starts a MiB apart).
  AllToAllHeader(const uint8_t* from, int size) : words_(reinterpret_cast<const int64_t*>(from)), size_(size) {}
  int64_t send_rows(int q) const { return words_[2 + Tensor::kMaxDims + q]; }
  int64_t recv_rows(int q) const { return words_[2 + Tensor::kMaxDims + size_ + q]; }

  // That rank `p`'s rows for rank `rank` have the dtype and row shape of `out` and as many rows
  // as mine_recv[p], and that it expects mine_send[p] rows from `rank` (mine_send, mine_recv: the
  // calling rank's counts), in the words Gloo's transport uses.
  absl::Status Check(int p, int rank, const Tensor& out, absl::Span<const int64_t> mine_send,
                     absl::Span<const int64_t> mine_recv) const {
    Tensor theirs = out, want = out;
    theirs.dtype = static_cast<DType>(words_[0]);
    theirs.ndim = static_cast<int>(std::clamp<int64_t>(words_[1], 1, Tensor::kMaxDims));
    std::copy(words_ + 2, words_ + 2 + Tensor::kMaxDims, theirs.shape.begin());
    theirs.shape[0] = send_rows(rank);
    want.shape[0] = mine_recv[p];
    const bool same = theirs.dtype == want.dtype && words_[1] == want.ndim &&
                      std::equal(theirs.shape.begin(), theirs.shape.begin() + want.ndim, want.shape.begin());
    if (!same) {
      return comm::SendsOtherRowsThanExpected(p, comm::DescribeTensor(words_[0], theirs), comm::DescribeTensor(want));
    }
    if (recv_rows(rank) != mine_send[p]) return comm::ExpectsOtherRowCount(p, recv_rows(rank), mine_send[p]);
    return absl::OkStatus();
  }

 private:
  const int64_t* words_;
  int size_;
};

// ---- The communicator -------------------------------------------------------------------------

class SharedMemoryCommunicator final : public Communicator {
 public:
  SharedMemoryCommunicator(std::unique_ptr<Communicator> host, Mapping mapping, std::unique_ptr<Keeper> keeper,
                           std::string where, absl::Duration timeout)
      : host_(std::move(host)),
        mapping_(std::move(mapping)),
        keeper_(std::move(keeper)),
        where_(std::move(where)),
        timeout_(timeout),
        rank_(host_->rank()),
        size_(host_->size()),
        mine_(mapping_.slot(rank_)) {}

  ~SharedMemoryCommunicator() override { Leave(kLeft); }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  absl::Status AllReduceSum(Tensor* t) override {
    return Guard("AllReduceSum", [&]() -> absl::Status {
      switch (t->dtype) {
        case DType::kF32:
          return Sum<float>(kSumF32, t->as<float>(), static_cast<size_t>(t->numel()));
        case DType::kI32:
          return Sum<int32_t>(kSumI32, t->as<int32_t>(), static_cast<size_t>(t->numel()));
        default:
          return absl::InvalidArgumentError(absl::StrCat("shared memory sums F32 and I32 tensors, not ",
                                                         DTypeName(t->dtype),
                                                         " (the CPU backend's activations are F32)"));
      }
    });
  }

  // out[p] = rank p's in: each chunk of in's bytes to every rank's row of out.
  absl::Status AllGather(Tensor* out, const Tensor& in) override {
    return Guard("AllGather", [&]() -> absl::Status {
      SHARDSERVE_RETURN_IF_ERROR(comm::CheckAllGatherShapes(*out, in, size_));
      const size_t bytes = in.bytes();
      const uint8_t* src = static_cast<const uint8_t*>(in.data);
      uint8_t* dst = out->as<uint8_t>();
      for (size_t at = 0; at < bytes; at += kSlotBytes) {
        const size_t n = std::min(kSlotBytes, bytes - at);
        SHARDSERVE_ASSIGN_OR_RETURN(const uint32_t seq, Exchange(kGather, bytes, src + at, n));
        for (int p = 0; p < size_; ++p) std::memcpy(dst + p * bytes + at, mapping_.piece(seq, p, size_), n);
      }
      return absl::OkStatus();
    });
  }

  // Two rounds: every rank's counts and row shape (AllToAllHeader), checked against this rank's
  // before any row moves; then every rank's whole `in`, in pieces of at most kSlotBytes, from which
  // each rank copies the rows sent to it.
  absl::Status AllToAllV(Tensor* out, const Tensor& in, absl::Span<const int64_t> send_rows,
                         absl::Span<const int64_t> recv_rows) override {
    return Guard("AllToAllV", [&]() -> absl::Status {
      SHARDSERVE_ASSIGN_OR_RETURN(const int64_t row_elements,
                                  CheckAllToAllVArgs(*out, in, send_rows, recv_rows, rank_, size_));
      const size_t row_bytes = static_cast<size_t>(row_elements) * DTypeSize(in.dtype);
      const size_t header_bytes = AllToAllHeader::Bytes(size_);
      AllToAllHeader::Write(in, send_rows, recv_rows, header_.data());
      SHARDSERVE_ASSIGN_OR_RETURN(const uint32_t counts_seq,
                                  Exchange(kAllToAllCounts, header_bytes, header_.data(), header_bytes));
      // What each peer sends this rank, where its rows for this rank start in its `in`, and the
      // most pieces any rank's `in` takes.
      size_t pieces = 0, recv_at = 0;
      for (int p = 0; p < size_; ++p) {
        const AllToAllHeader theirs(mapping_.piece(counts_seq, p, size_), size_);
        SHARDSERVE_RETURN_IF_ERROR(theirs.Check(p, rank_, *out, send_rows, recv_rows));
        size_t at = 0, total = 0;
        for (int q = 0; q < size_; ++q) {
          if (q == rank_) at = total;
          total += static_cast<size_t>(theirs.send_rows(q)) * row_bytes;
        }
        from_at_[p] = at;
        from_bytes_[p] = static_cast<size_t>(recv_rows[p]) * row_bytes;
        to_at_[p] = recv_at;
        recv_at += from_bytes_[p];
        pieces = std::max(pieces, (total + kSlotBytes - 1) / kSlotBytes);
      }
      const uint8_t* src = static_cast<const uint8_t*>(in.data);
      uint8_t* dst = out->as<uint8_t>();
      const size_t in_bytes = in.bytes();
      for (size_t k = 0; k < pieces; ++k) {
        const size_t begin = k * kSlotBytes, end = begin + kSlotBytes;
        const size_t n = begin < in_bytes ? std::min(kSlotBytes, in_bytes - begin) : 0;
        SHARDSERVE_ASSIGN_OR_RETURN(const uint32_t seq, Exchange(kAllToAllRows, pieces, src + begin, n));
        for (int p = 0; p < size_; ++p) {
          // the part of [from_at, from_at + from_bytes) of rank p's `in` that lies in this piece
          const size_t lo = std::max(begin, from_at_[p]), hi = std::min(end, from_at_[p] + from_bytes_[p]);
          if (lo >= hi) continue;
          std::memcpy(dst + to_at_[p] + (lo - from_at_[p]), mapping_.piece(seq, p, size_) + (lo - begin), hi - lo);
        }
      }
      return absl::OkStatus();
    });
  }

  // In a group of two (a pipeline's pair of stages) a Send and the peer's Recv are the two sides of
  // one exchange: the sender publishes the tensor, the receiver its expected dtype and shape, each
  // checks the other's, and the receiver copies the tensor out; like Gloo's, a Send returns once
  // the peer has posted its Recv. In a larger group a pair's Send/Recv is not a step of every
  // rank's sequence, so the host communicator carries it (its messages name the operation).
  absl::Status Send(const Tensor& t, int peer) override {
    if (size_ != 2) return Guard("Send", [&] { return host_->Send(t, peer); }, /*own=*/false);
    return Guard("Send", [&]() -> absl::Status {
      SHARDSERVE_RETURN_IF_ERROR(comm::CheckPeer(peer, rank_, size_));
      return PointToPoint(kSend, t, static_cast<const uint8_t*>(t.data), nullptr);
    });
  }
  absl::Status Recv(Tensor* t, int peer) override {
    if (size_ != 2) return Guard("Recv", [&] { return host_->Recv(t, peer); }, /*own=*/false);
    return Guard("Recv", [&]() -> absl::Status {
      SHARDSERVE_RETURN_IF_ERROR(comm::CheckPeer(peer, rank_, size_));
      return PointToPoint(kRecv, *t, nullptr, t->as<uint8_t>());
    });
  }
  absl::Status Barrier() override {
    return Guard("Barrier", [&] { return Exchange(kBarrier, 0, nullptr, 0).status(); });
  }

 private:
  // data[i] = the sum over the ranks of their data[i], added in rank order r = 0, 1, ... on every
  // rank, so every rank gets the same bits.
  template <typename T>
  absl::Status Sum(OpKind op, T* data, size_t n) {
    const size_t bytes = n * sizeof(T);
    for (size_t at = 0; at < bytes; at += kSlotBytes) {
      const size_t chunk = std::min(kSlotBytes, bytes - at);
      T* out = data + at / sizeof(T);
      SHARDSERVE_ASSIGN_OR_RETURN(const uint32_t seq, Exchange(op, bytes, out, chunk));
      const size_t m = chunk / sizeof(T);
      const T* a = reinterpret_cast<const T*>(mapping_.piece(seq, 0, size_));
      const T* b = reinterpret_cast<const T*>(mapping_.piece(seq, 1, size_));
      for (size_t i = 0; i < m; ++i) out[i] = a[i] + b[i];
      for (int r = 2; r < size_; ++r) {
        const T* c = reinterpret_cast<const T*>(mapping_.piece(seq, r, size_));
        for (size_t i = 0; i < m; ++i) out[i] += c[i];
      }
    }
    return absl::OkStatus();
  }

  // One side of a Send (src: the tensor's bytes) or Recv (dst: where they go) of `t` in a group of
  // two, in pieces of at most kSlotBytes; one exchange even for an empty tensor, so that the two
  // sides meet and check each other's shape.
  absl::Status PointToPoint(OpKind op, const Tensor& t, const uint8_t* src, uint8_t* dst) {
    const size_t bytes = t.bytes();
    const int peer = 1 - rank_;
    for (size_t at = 0; at == 0 || at < bytes; at += kSlotBytes) {
      const size_t n = std::min(kSlotBytes, bytes - at);
      SHARDSERVE_ASSIGN_OR_RETURN(const uint32_t seq, Exchange(op, bytes, src == nullptr ? nullptr : src + at,
                                                               src == nullptr ? 0 : n, &t));
      if (dst != nullptr && n > 0) std::memcpy(dst + at, mapping_.piece(seq, peer, size_), n);
    }
    return absl::OkStatus();
  }

  // Publishes this rank's `n` bytes at `src` as the next chunk of operation `op` (of `op_bytes` in
  // all; for a Send or Recv also `tensor`'s shape) and waits until every peer has published the
  // same chunk; returns its number, whose buffer the caller then reads. The peers must have called
  // the same operation with as many bytes (a Send: the peer's Recv of the same dtype and shape).
  absl::StatusOr<uint32_t> Exchange(OpKind op, size_t op_bytes, const void* src, size_t n,
                                    const Tensor* tensor = nullptr) {
    const uint32_t seq = ++seq_;
    if (n > 0) std::memcpy(mapping_.piece(seq, rank_, size_), src, n);
    mine_->op[seq % 2] = op;
    mine_->op_bytes[seq % 2] = static_cast<int64_t>(op_bytes);
    if (tensor != nullptr) WriteShape(*tensor, mine_->tensor[seq % 2]);
    mine_->arrived.store(seq, std::memory_order_seq_cst);
    if (mine_->sleepers.load(std::memory_order_seq_cst) != 0) FutexWakeAll(&mine_->arrived);
    SHARDSERVE_RETURN_IF_ERROR(WaitForPeers(seq));
    const uint32_t matching = op == kSend ? kRecv : op == kRecv ? kSend : op;
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      const RankSlot* peer = mapping_.slot(p);
      const uint32_t theirs = peer->op[seq % 2];
      const int64_t their_bytes = peer->op_bytes[seq % 2];
      // A Send and its Recv compare shapes below, which names them better than their bytes.
      if (theirs != matching || (tensor == nullptr && their_bytes != static_cast<int64_t>(op_bytes))) {
        return absl::InvalidArgumentError(absl::StrCat(
            "rank ", p, " called ", OpName(theirs), " of ", their_bytes, " bytes where this rank called ", OpName(op),
            " of ", op_bytes, " bytes", tensor != nullptr ? " (a Send meets the peer's Recv)" : ""));
      }
      if (tensor == nullptr) continue;
      const int64_t* words = peer->tensor[seq % 2];
      const Tensor other = ReadShape(words);
      if (other.dtype != tensor->dtype || other.ndim != tensor->ndim ||
          !std::equal(tensor->shape.begin(), tensor->shape.begin() + tensor->ndim, other.shape.begin())) {
        const std::string theirs_described = comm::DescribeTensor(words[0], other);
        const std::string mine = comm::DescribeTensor(*tensor);
        if (op == kRecv) return comm::SentOtherThanExpected(p, theirs_described, mine);
        return absl::InvalidArgumentError(
            absl::StrCat("rank ", p, " expected ", theirs_described, " but this rank sent ", mine));
      }
    }
    return seq;
  }

  // Waits until every peer has published chunk `seq`: a short spin (a peer in step arrives within
  // microseconds), then sleeps on the peer's futex word, waking every 10 ms to look for a peer
  // that left, failed or whose process ended, and giving up after timeout_.
  absl::Status WaitForPeers(uint32_t seq) {
    constexpr int kSpins = 4000;
    const absl::Time start = absl::Now();
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      RankSlot* peer = mapping_.slot(p);
      for (int spin = 0; !Reached(peer->arrived.load(std::memory_order_acquire), seq); ++spin) {
        if (spin < kSpins) {
          CpuRelax();
          continue;
        }
        const uint32_t state = peer->state.load(std::memory_order_acquire);
        if (state != kJoined || Released(peer)) {
          if (Reached(peer->arrived.load(std::memory_order_acquire), seq)) break;  // arrived, then went
          return absl::UnavailableError(absl::StrCat(
              "rank ", p,
              state == kFailed ? " gave up after an error of its own"
              : state == kLeft ? " left the group (its communicator was destroyed: the process is ending)"
                               : "'s process ended"));
        }
        const absl::Time now = absl::Now();
        if (now - start > timeout_) {
          std::vector<int> missing;
          for (int q = 0; q < size_; ++q) {
            if (q != rank_ && !Reached(mapping_.slot(q)->arrived.load(std::memory_order_acquire), seq)) {
              missing.push_back(q);
            }
          }
          return absl::DeadlineExceededError(absl::StrCat(
              "timed out: rank", missing.size() == 1 ? " " : "s ", absl::StrJoin(missing, ", "),
              " did not arrive within ", absl::FormatDuration(timeout_), " (a peer is hung or not calling it)"));
        }
        peer->sleepers.fetch_add(1, std::memory_order_seq_cst);
        const uint32_t seen = peer->arrived.load(std::memory_order_seq_cst);
        if (!Reached(seen, seq)) FutexWait(&peer->arrived, seen, absl::Milliseconds(10));
        peer->sleepers.fetch_sub(1, std::memory_order_seq_cst);
      }
    }
    return absl::OkStatus();
  }

  // Runs operation `op` unless the communicator is already broken; an error breaks it and tells the
  // peers (who then stop waiting for this rank). An error of one of this class's `own` operations
  // gets the operation and the group named; the host's name them already.
  template <typename Body>
  absl::Status Guard(const char* op, Body&& body, bool own = true) {
    if (!broken_.ok()) {
      return absl::FailedPreconditionError(absl::StrCat("shared-memory ", op, " in ", where_,
                                                        ": the communicator is unusable after an earlier error: ",
                                                        broken_.message()));
    }
    const absl::Status status = body();
    if (status.ok()) return status;
    broken_ = own ? absl::Status(status.code(),
                                 absl::StrCat("shared-memory ", op, " in ", where_, ": ", status.message()))
                  : status;
    Leave(kFailed);
    return broken_;
  }

  // Tells the peers this rank is out of the group, and wakes any that sleep on it.
  void Leave(RankState state) {
    if (mine_->state.load(std::memory_order_relaxed) != kJoined) return;
    mine_->state.store(state, std::memory_order_seq_cst);
    FutexWakeAll(&mine_->arrived);
  }

  const std::unique_ptr<Communicator> host_;
  const Mapping mapping_;
  const std::unique_ptr<Keeper> keeper_;  // after mapping_, so it lets go of `alive` before the unmap
  const std::string where_;
  const absl::Duration timeout_;
  const int rank_, size_;
  RankSlot* const mine_;
  uint32_t seq_ = 0;      // the chunks this rank has published
  // AllToAllV's: this rank's header, and where each peer's rows for it lie (sized once).
  std::vector<int64_t> header_ = std::vector<int64_t>(AllToAllHeader::Bytes(size_) / sizeof(int64_t));
  std::vector<size_t> from_at_ = std::vector<size_t>(size_), from_bytes_ = from_at_, to_at_ = from_at_;
  absl::Status broken_;  // the first error; once set, every call fails at once
};

// ---- Setup ------------------------------------------------------------------------------------

// What rank 0 tells the others about the segment it made (ok = 0: it could not make one).
struct Offer {
  char name[48];
  uint64_t nonce[2];
  int32_t ok;
  int32_t padding;
};

// Creates, sizes (with the memory reserved), maps and stamps a new segment for `size` ranks; fills
// `offer`. False, with nothing left behind, if any step fails (no /dev/shm, or too little room).
bool CreateSegment(int size, Mapping* mapping, Offer* offer) {
  uint64_t random[3] = {};
  if (getrandom(random, sizeof(random), 0) != static_cast<ssize_t>(sizeof(random))) return false;
  absl::SNPrintF(offer->name, sizeof(offer->name), "/shardserve-%016x", random[0]);
  const int fd = shm_open(offer->name, O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) return false;
  const size_t bytes = SegmentBytes(size);
  if (posix_fallocate(fd, 0, static_cast<off_t>(bytes)) == 0) *mapping = Mapping::Map(offer->name, fd, bytes);
  close(fd);
  if (!mapping->ok()) {
    shm_unlink(offer->name);
    return false;
  }
  Header* h = mapping->header();
  h->nonce[0] = offer->nonce[0] = random[1];
  h->nonce[1] = offer->nonce[1] = random[2];
  h->size = size;
  h->slot_bytes = kSlotBytes;
  h->magic = kMagic;
  offer->ok = 1;
  return true;
}

// Maps the segment rank 0 offered and checks it is that one (same magic, nonce and sizes).
bool OpenSegment(const Offer& offer, int size, Mapping* mapping) {
  const int fd = shm_open(offer.name, O_RDWR, 0);
  if (fd < 0) return false;
  const size_t bytes = SegmentBytes(size);
  struct stat st {};
  Mapping m;
  if (fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) == bytes) m = Mapping::Map(offer.name, fd, bytes);
  close(fd);
  if (!m.ok()) return false;
  const Header* h = m.header();
  if (h->magic != kMagic || h->nonce[0] != offer.nonce[0] || h->nonce[1] != offer.nonce[1] || h->size != size ||
      h->slot_bytes != static_cast<int64_t>(kSlotBytes)) {
    return false;
  }
  *mapping = std::move(m);
  return true;
}

// Every rank's `flag` (0 or 1) gathered through `host`; true if all are 1.
absl::StatusOr<bool> AllRanks(Communicator& host, int32_t flag) {
  std::vector<int32_t> all(host.size());
  Tensor out(all.data(), DType::kI32, {host.size()});
  SHARDSERVE_RETURN_IF_ERROR(host.AllGather(&out, Tensor(&flag, DType::kI32, {})));
  return std::all_of(all.begin(), all.end(), [](int32_t f) { return f == 1; });
}

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> WithSharedMemory(std::unique_ptr<Communicator> host,
                                                               const std::string& group_name, absl::Duration timeout) {
  const int rank = host->rank(), size = host->size();
  if (size == 1) return host;

  // Rank 0 makes the segment and offers it to all.
  Mapping mapping;
  std::unique_ptr<Keeper> keeper;  // after mapping: destroyed first
  Offer offer{};
  if (rank == 0) CreateSegment(size, &mapping, &offer);
  std::vector<Offer> offers(size);
  Tensor offers_t(offers.data(), DType::kI8, {size, static_cast<int64_t>(sizeof(Offer))});
  SHARDSERVE_RETURN_IF_ERROR(
      host->AllGather(&offers_t, Tensor(&offer, DType::kI8, {static_cast<int64_t>(sizeof(Offer))})));
  Offer made = offers[0];
  made.name[sizeof(made.name) - 1] = '\0';

  // Every rank maps it and joins its line (its `alive` held from now on); once all have tried,
  // the name is no longer needed. Where any rank could not, the group keeps to `host`.
  auto join = [&]() -> bool {
    if (made.ok != 1 || (rank != 0 && !OpenSegment(made, size, &mapping))) return false;
    RankSlot* mine = mapping.slot(rank);
    if (!InitAlive(mine)) return false;
    keeper = std::make_unique<Keeper>(&mine->alive);
    if (!keeper->ok()) return false;
    mine->state.store(kJoined, std::memory_order_seq_cst);
    return true;
  };
  absl::StatusOr<bool> all_joined = AllRanks(*host, join() ? 1 : 0);
  if (rank == 0 && made.ok == 1) shm_unlink(made.name);
  if (!all_joined.ok()) return all_joined.status();
  if (!*all_joined) return host;
  std::string where = comm::GroupWhere(group_name, rank, size);
  return std::make_unique<SharedMemoryCommunicator>(std::move(host), std::move(mapping), std::move(keeper),
                                                    std::move(where), timeout);
}

}  // namespace shardserve
