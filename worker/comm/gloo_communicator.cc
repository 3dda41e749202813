#include "worker/comm/gloo_communicator.h"

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/common/error.h>
#include <gloo/common/logging.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "base/status_macros.h"
#include "worker/comm/checks.h"

namespace shardserve {
namespace {

// ---- Exceptions to Status -------------------------------------------------------------------

// Gloo (this 2022 snapshot) has no exception type for a timeout: UnboundBuffer's waits throw an
// IoException "Timed out waiting ...", and a connect throws "Connect timeout ...". After a local
// timeout Gloo closes every pair, and the other pending operations see "Application timeout caused
// pair closure"; all of these are timeouts. A peer that closed its end is "Connection closed by
// peer": a lost connection, not a timeout.
bool IsGlooTimeout(const char* what) {
  const std::string lower = absl::AsciiStrToLower(what);
  return absl::StrContains(lower, "timed out") || absl::StrContains(lower, "timeout");
}

// Runs `body`, which calls into Gloo, and returns its Status, or a Status for what it threw, so no
// exception leaves this file: a timeout -> DeadlineExceeded, any other I/O error -> Unavailable,
// anything else (a failed GLOO_ENFORCE, a system error) -> Internal. The message is Gloo's.
template <typename Body>
absl::Status CallGloo(Body&& body) {
  try {
    return body();
  } catch (const gloo::IoException& e) {
    return absl::Status(IsGlooTimeout(e.what()) ? absl::StatusCode::kDeadlineExceeded : absl::StatusCode::kUnavailable,
                        e.what());
  } catch (const gloo::EnforceNotMet& e) {
    return absl::InternalError(absl::StrCat("Gloo check failed: ", e.what()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("Gloo error: ", e.what()));
  } catch (...) {
    return absl::InternalError("Gloo threw something that is not a std::exception");
  }
}

// Gloo writes to its sockets with writev, which raises SIGPIPE when the peer has closed the
// connection (it exited, or gave up after a timeout), and SIGPIPE's default action ends this
// process. Ignored, the write fails with EPIPE instead, which Gloo reports as an IoException and
// Run as Unavailable. Done once per process, and only while SIGPIPE has its default action, so a
// handler the program installed is left alone.
void IgnoreSigpipe() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current {};
    if (sigaction(SIGPIPE, nullptr, &current) != 0 || current.sa_handler != SIG_DFL) return;
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    sigaction(SIGPIPE, &ignore, nullptr);
  });
}

// ---- Rendezvous -----------------------------------------------------------------------------

// Gloo's view of a RendezvousStore during one group's rendezvous. Keys get the group's prefix, and
// every wait ends at one deadline for the whole rendezvous (the timeouts Gloo passes are ignored).
// Gloo's Store interface reports failure only by exception, so the first failure is kept as a
// Status and thrown as a gloo::IoException; MakeGlooCommunicator returns the kept Status.
// Used by one thread (the one in MakeGlooCommunicator); `store` must outlive it.
class GlooStore final : public gloo::rendezvous::Store {
 public:
  GlooStore(RendezvousStore* store, std::string prefix, std::string where, absl::Duration timeout)
      : store_(store),
        prefix_(std::move(prefix)),
        where_(std::move(where)),
        timeout_(timeout),
        deadline_(absl::Now() + timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    if (absl::Status s = store_->Set(prefix_ + key, std::string(data.begin(), data.end())); !s.ok()) Fail(s, key);
  }

  std::vector<char> get(const std::string& key) override {
    absl::StatusOr<std::string> value =
        store_->Get(prefix_ + key, std::max(deadline_ - absl::Now(), absl::ZeroDuration()));
    if (!value.ok()) Fail(value.status(), key);
    return std::vector<char>(value->begin(), value->end());
  }

  void wait(const std::vector<std::string>& keys) override {
    for (const std::string& key : keys) get(key);
  }

  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& /*gloo's timeout*/) override {
    wait(keys);
  }

  // OK until a store call fails; then that failure, explained.
  const absl::Status& error() const { return error_; }

 private:
  // Gloo's keys are "rank_<r>" (rank r's host name) and "<r>" (rank r's addresses): both are
  // published by rank r, so a missing key means rank r has not joined.
  static std::string Publisher(const std::string& key) {
    int rank = 0;
    return absl::SimpleAtoi(absl::StripPrefix(key, "rank_"), &rank) ? absl::StrCat("rank ", rank) : "a peer";
  }

  [[noreturn]] void Fail(const absl::Status& s, const std::string& key) {
    const std::string what =
        s.code() == absl::StatusCode::kDeadlineExceeded
            ? absl::StrCat("timed out: ", Publisher(key), " did not join within ", absl::FormatDuration(timeout_))
            : std::string("failed: the rendezvous store returned an error");
    error_ = absl::Status(s.code(), absl::StrCat("Gloo rendezvous of ", where_, " ", what, ": ", s.message()));
    throw gloo::IoException(std::string(error_.message()));
  }

  RendezvousStore* const store_;
  const std::string prefix_;
  const std::string where_;
  const absl::Duration timeout_;
  const absl::Time deadline_;
  absl::Status error_;
};

// ---- Point to point -------------------------------------------------------------------------

// Gloo matches a send with a recv by (pair, slot), in order. Send/Recv use two slots of their own:
// the header, then the payload; AllToAllV two more. Gloo's collectives use slot prefixes 0x01-0x08
// (gloo/types.h).
constexpr uint8_t kP2pSlotPrefix = 0x40;
const uint64_t kHeaderSlot = gloo::Slot::build(kP2pSlotPrefix, 0);
const uint64_t kPayloadSlot = gloo::Slot::build(kP2pSlotPrefix, 1);
const uint64_t kAllToAllHeaderSlot = gloo::Slot::build(kP2pSlotPrefix, 2);
const uint64_t kAllToAllPayloadSlot = gloo::Slot::build(kP2pSlotPrefix, 3);

// What Send puts ahead of a tensor, so that Recv checks it expected the same dtype and shape before
// any payload byte lands: given more bytes than the receiver posted, Gloo's event loop fails a
// check and the process aborts; given fewer, the tail of the tensor is silently left unwritten.
// The ranks run the same build on the same architecture, so the struct goes on the wire as is.
struct P2pHeader {
  uint32_t magic;
  uint32_t dtype;
  int64_t ndim;
  int64_t shape[Tensor::kMaxDims];
};
static_assert(std::has_unique_object_representations_v<P2pHeader>, "P2pHeader is compared with memcmp");
constexpr uint32_t kP2pMagic = 0x53534831;  // "SSH1": shardserve tensor header, version 1

P2pHeader HeaderOf(const Tensor& t) {
  P2pHeader h{};
  h.magic = kP2pMagic;
  h.dtype = static_cast<uint32_t>(t.dtype);
  h.ndim = t.ndim;
  for (int i = 0; i < std::min(t.ndim, Tensor::kMaxDims); ++i) h.shape[i] = t.shape[i];
  return h;
}

std::string Describe(const P2pHeader& h) {
  if (h.magic != kP2pMagic || h.ndim < 0 || h.ndim > Tensor::kMaxDims) return "a malformed tensor header";
  Tensor t;
  t.dtype = static_cast<DType>(h.dtype);
  t.ndim = static_cast<int>(h.ndim);
  std::copy(h.shape, h.shape + t.ndim, t.shape.begin());
  return comm::DescribeTensor(h.dtype, t);
}

// What AllToAllV tells each peer before any row moves: the rows it sends the peer, as the header
// of a [rows, ...row shape] tensor, and the rows it expects from the peer. Both ends of a pair whose
// counts (or dtypes, or row shapes) disagree see it, and return InvalidArgument instead of letting
// Gloo abort the process or leave rows unwritten (see P2pHeader).
struct AllToAllHeader {
  P2pHeader sends;
  int64_t expects;
};
static_assert(std::has_unique_object_representations_v<AllToAllHeader>, "AllToAllHeader is compared with memcmp");

// `t` with `rows` rows: the shape of one rank's block of an AllToAllV tensor.
Tensor WithRows(const Tensor& t, int64_t rows) {
  Tensor block = t;
  block.shape[0] = rows;
  return block;
}

// ---- The communicator -----------------------------------------------------------------------

// c[i] = a[i] + b[i], Gloo's reduction signature.
template <typename T>
void Sum(void* c, const void* a, const void* b, size_t n) {
  T* out = static_cast<T*>(c);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) out[i] = x[i] + y[i];
}

// Owns its Gloo context: the TCP connections to every peer, and (through the device) the thread
// that runs Gloo's event loop. Not thread-safe (see Communicator).
class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(std::shared_ptr<gloo::rendezvous::Context> context, std::string where, absl::Duration timeout)
      : context_(std::move(context)),
        where_(std::move(where)),
        other_ranks_(comm::OtherRanks(context_->rank, context_->size)),
        timeout_(timeout),
        gloo_timeout_(absl::ToChronoMilliseconds(timeout)) {}

  int rank() const override { return context_->rank; }
  int size() const override { return context_->size; }

  absl::Status AllReduceSum(Tensor* t) override {
    return Run("AllReduceSum", other_ranks_, [&]() -> absl::Status {
      const size_t n = static_cast<size_t>(t->numel());
      switch (t->dtype) {
        case DType::kF32:
          SumOverRanks(t->as<float>(), n, &gathered_f32_);
          return absl::OkStatus();
        case DType::kI32:
          SumOverRanks(t->as<int32_t>(), n, &gathered_i32_);
          return absl::OkStatus();
        default:
          return absl::InvalidArgumentError(absl::StrCat("Gloo sums F32 and I32 tensors, not ", DTypeName(t->dtype),
                                                         " (the CPU backend's activations are F32)"));
      }
    });
  }

  // AllReduceSum: data[i] = the sum over the ranks of their data[i].
  template <typename T>
  void SumOverRanks(T* data, size_t n, std::vector<T>* gathered) {
    if (n * sizeof(T) > kGatherSumBytes) {
      gloo::AllreduceOptions opts(context_);
      opts.setOutput(data, n);
      opts.setReduceFunction(&Sum<T>);
      opts.setTimeout(gloo_timeout_);
      gloo::allreduce(opts);
      return;
    }
    // Small tensors (a decode step's activations): every rank's tensor to every rank in one
    // all-gather, then summed here in rank order r = 0, 1, ... (the same bits on every rank): one
    // exchange instead of the ring's reduce-scatter and all-gather, whose messages and wake-ups,
    // not their bytes, are the cost at this size (docs/performance.md, "CPU, TP across hosts").
    if (n == 0) return;
    gathered->resize(n * static_cast<size_t>(size()));
    gloo::AllgatherOptions opts(context_);
    opts.setInput(data, n);
    opts.setOutput(gathered->data(), gathered->size());
    opts.setTimeout(gloo_timeout_);
    gloo::allgather(opts);
    for (size_t i = 0; i < n; ++i) {
      T sum = (*gathered)[i];
      for (size_t r = 1; r < static_cast<size_t>(size()); ++r) sum += (*gathered)[r * n + i];
      data[i] = sum;
    }
  }

  absl::Status AllGather(Tensor* out, const Tensor& in) override {
    return Run("AllGather", other_ranks_, [&]() -> absl::Status {
      SHARDSERVE_RETURN_IF_ERROR(comm::CheckAllGatherShapes(*out, in, size()));
      if (in.bytes() == 0) return absl::OkStatus();
      gloo::AllgatherOptions opts(context_);
      // Gloo gathers bytes here: the dtype only sets the element size, and bytes need no reduction.
      opts.setInput(static_cast<uint8_t*>(in.data), in.bytes());
      opts.setOutput(out->as<uint8_t>(), out->bytes());
      opts.setTimeout(gloo_timeout_);
      gloo::allgather(opts);
      return absl::OkStatus();
    });
  }

  absl::Status Send(const Tensor& t, int peer) override {
    return Run("Send", absl::StrCat("rank ", peer), [&]() -> absl::Status {
      SHARDSERVE_RETURN_IF_ERROR(comm::CheckPeer(peer, rank(), size()));
      P2pHeader header = HeaderOf(t);
      auto header_buf = context_->createUnboundBuffer(&header, sizeof(header));
      header_buf->send(peer, kHeaderSlot);
      std::unique_ptr<gloo::transport::UnboundBuffer> payload;
      if (t.bytes() > 0) {
        payload = context_->createUnboundBuffer(t.data, t.bytes());
        payload->send(peer, kPayloadSlot);
      }
      header_buf->waitSend(gloo_timeout_);
      if (payload) payload->waitSend(gloo_timeout_);
      return absl::OkStatus();
    });
  }

  absl::Status Recv(Tensor* t, int peer) override {
    return Run("Recv", absl::StrCat("rank ", peer), [&]() -> absl::Status {
      SHARDSERVE_RETURN_IF_ERROR(comm::CheckPeer(peer, rank(), size()));
      P2pHeader got{};
      auto header_buf = context_->createUnboundBuffer(&got, sizeof(got));
      header_buf->recv(peer, kHeaderSlot);
      header_buf->waitRecv(gloo_timeout_);
      const P2pHeader want = HeaderOf(*t);
      if (std::memcmp(&got, &want, sizeof(got)) != 0) {
        return comm::SentOtherThanExpected(peer, Describe(got), Describe(want));
      }
      if (t->bytes() == 0) return absl::OkStatus();
      auto payload = context_->createUnboundBuffer(t->data, t->bytes());
      payload->recv(peer, kPayloadSlot);
      payload->waitRecv(gloo_timeout_);
      return absl::OkStatus();
    });
  }

  // Two rounds, each posted to every peer before any wait, so no order of the ranks deadlocks:
  // the headers (AllToAllHeader), checked before any row moves, then the rows. A rank's rows to
  // itself are a memcpy.
  absl::Status AllToAllV(Tensor* out, const Tensor& in, absl::Span<const int64_t> send_rows,
                         absl::Span<const int64_t> recv_rows) override {
    return Run("AllToAllV", other_ranks_, [&]() -> absl::Status {
      SHARDSERVE_ASSIGN_OR_RETURN(const int64_t row_elements,
                                  CheckAllToAllVArgs(*out, in, send_rows, recv_rows, rank(), size()));
      const size_t row_bytes = static_cast<size_t>(row_elements) * DTypeSize(in.dtype);
      const int n = size();

      std::vector<AllToAllHeader> told(n), heard(n);
      for (int p = 0; p < n; ++p) told[p] = {HeaderOf(WithRows(in, send_rows[p])), recv_rows[p]};
      auto told_buf = context_->createUnboundBuffer(told.data(), n * sizeof(AllToAllHeader));
      auto heard_buf = context_->createUnboundBuffer(heard.data(), n * sizeof(AllToAllHeader));
      for (int p = 0; p < n; ++p) {
        if (p == rank()) continue;
        heard_buf->recv(p, kAllToAllHeaderSlot, p * sizeof(AllToAllHeader), sizeof(AllToAllHeader));
        told_buf->send(p, kAllToAllHeaderSlot, p * sizeof(AllToAllHeader), sizeof(AllToAllHeader));
      }
      for (int i = 1; i < n; ++i) heard_buf->waitRecv(gloo_timeout_);
      for (int i = 1; i < n; ++i) told_buf->waitSend(gloo_timeout_);
      for (int p = 0; p < n; ++p) {
        if (p == rank()) continue;
        const P2pHeader want = HeaderOf(WithRows(*out, recv_rows[p]));
        if (std::memcmp(&heard[p].sends, &want, sizeof(want)) != 0) {
          return comm::SendsOtherRowsThanExpected(p, Describe(heard[p].sends), Describe(want));
        }
        if (heard[p].expects != send_rows[p]) return comm::ExpectsOtherRowCount(p, heard[p].expects, send_rows[p]);
      }

      // Gloo takes a byte count of 0 as "the rest of the buffer": empty blocks are not posted.
      std::unique_ptr<gloo::transport::UnboundBuffer> in_buf, out_buf;
      if (in.bytes() > 0) in_buf = context_->createUnboundBuffer(in.data, in.bytes());
      if (out->bytes() > 0) out_buf = context_->createUnboundBuffer(out->data, out->bytes());
      int sends = 0, recvs = 0;
      size_t send_at = 0, recv_at = 0;
      for (int p = 0; p < n; ++p) {
        const size_t send_bytes = static_cast<size_t>(send_rows[p]) * row_bytes;
        const size_t recv_bytes = static_cast<size_t>(recv_rows[p]) * row_bytes;
        if (p == rank()) {
          if (send_bytes > 0) std::memcpy(out->as<uint8_t>() + recv_at, in.as<uint8_t>() + send_at, send_bytes);
        } else {
          if (recv_bytes > 0) {
            out_buf->recv(p, kAllToAllPayloadSlot, recv_at, recv_bytes);
            ++recvs;
          }
          if (send_bytes > 0) {
            in_buf->send(p, kAllToAllPayloadSlot, send_at, send_bytes);
            ++sends;
          }
        }
        send_at += send_bytes;
        recv_at += recv_bytes;
      }
      for (int i = 0; i < recvs; ++i) out_buf->waitRecv(gloo_timeout_);
      for (int i = 0; i < sends; ++i) in_buf->waitSend(gloo_timeout_);
      return absl::OkStatus();
    });
  }

  absl::Status Barrier() override {
    return Run("Barrier", other_ranks_, [&]() -> absl::Status {
      gloo::BarrierOptions opts(context_);
      opts.setTimeout(gloo_timeout_);
      gloo::barrier(opts);
      return absl::OkStatus();
    });
  }

 private:
  // Runs operation `op`, which waits on `peers`, unless the communicator is already broken; an
  // error breaks it. Explains Gloo's timeouts and lost connections in terms of the group.
  template <typename Body>
  absl::Status Run(const char* op, const std::string& peers, Body&& body) {
    if (!broken_.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "Gloo ", op, " in ", where_, ": the communicator is unusable after an earlier error: ", broken_.message()));
    }
    const absl::Status status = CallGloo(std::forward<Body>(body));
    if (status.ok()) return status;
    std::string why;
    if (status.code() == absl::StatusCode::kDeadlineExceeded) {
      why = absl::StrCat("timed out: no progress from ", peers, " within ", absl::FormatDuration(timeout_),
                         " (a peer is dead, hung, or not calling ", op, "): ");
    } else if (status.code() == absl::StatusCode::kUnavailable) {
      why = absl::StrCat("lost the connection to ", peers,
                         " (a peer exited, or gave up after its own timeout and closed it): ");
    }
    broken_ = absl::Status(status.code(), absl::StrCat("Gloo ", op, " in ", where_, ": ", why, status.message()));
    return broken_;
  }

  // Constant after construction.
  const std::shared_ptr<gloo::rendezvous::Context> context_;
  const std::string where_;        // "group 'tp0' (rank 1 of 2)"
  const std::string other_ranks_;  // the ranks a collective waits on, for messages
  const absl::Duration timeout_;
  const std::chrono::milliseconds gloo_timeout_;
  // AllReduceSum of at most this many bytes gathers every rank's tensor and sums (SumOverRanks),
  // into these: reused, so a decode step allocates nothing.
  static constexpr size_t kGatherSumBytes = 64 << 10;
  std::vector<float> gathered_f32_;
  std::vector<int32_t> gathered_i32_;

  // The first error; once set, every call fails at once.
  absl::Status broken_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> MakeGlooCommunicator(RendezvousStore* store,
                                                                   const std::string& group_name, int rank, int size,
                                                                   const std::string& bind_address,
                                                                   absl::Duration timeout) {
  SHARDSERVE_RETURN_IF_ERROR(comm::CheckGroupArgs("Gloo", store, group_name, rank, size, timeout));
  const std::string where = comm::GroupWhere(group_name, rank, size);
  IgnoreSigpipe();

  std::shared_ptr<gloo::transport::Device> device;
  absl::Status status = CallGloo([&] {
    gloo::transport::tcp::attr attr;
    attr.hostname = bind_address;
    device = gloo::transport::tcp::CreateDevice(attr);
    return absl::OkStatus();
  });
  if (!status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Gloo communicator for ", where, ": cannot listen on '", bind_address, "': ", status.message()));
  }

  GlooStore gloo_store(store, absl::StrCat(group_name, "/gloo/"), where, timeout);
  std::shared_ptr<gloo::rendezvous::Context> context;
  status = CallGloo([&] {
    context = std::make_shared<gloo::rendezvous::Context>(rank, size);
    context->setTimeout(absl::ToChronoMilliseconds(timeout));
    context->connectFullMesh(gloo_store, device);
    return absl::OkStatus();
  });
  if (!gloo_store.error().ok()) return gloo_store.error();
  if (!status.ok()) {
    return absl::Status(status.code(), absl::StrCat("Gloo rendezvous of ", where, " on ", bind_address,
                                                    " failed while connecting to the peers: ", status.message()));
  }
  return std::make_unique<GlooCommunicator>(std::move(context), where, timeout);
}

}  // namespace shardserve
