// How a sparse layer's experts are split over the TP group: the plan the mixture-of-experts block
// (DecoderBlocks::MoeMlp) runs under, which reads the same for either split.
//
//   cut (the default): every rank routes all n tokens and computes every expert on its slice of
//     the expert's intermediate size (model/sharding.h); its partial sums meet in one all-reduce.
//     TokenRows is all n rows, Dispatch and Return keep the rows where they are, Join all-reduces.
//   expert parallel (--expert-parallel): rank r holds experts ExpertRange(E, r, t) whole.
//     TokenRows: rank r routes tokens [r * c, (r + 1) * c) of the step's n, c = ceil(n / t), clipped
//       to n (n = 5, t = 2: rows 0-2 and 3-4; n = 1, t = 2: row 0 and none).
//     Dispatch: the ranks all-gather their per-expert row counts, then each (token, expert) row
//       goes to its expert's rank by AllToAllV (the rows grouped by expert are grouped by rank too,
//       the experts being contiguous blocks); the owner regroups what it received by expert.
//     Return: the experts' outputs go back by AllToAllV, in the order they came.
//     Join: the ranks' combined rows (c each, the last ones padded) are all-gathered, which
//       leaves every rank with all n rows in token order (this replaces the all-reduce).
//
// Threading: not thread-safe; one step at a time (the shard's). The plan holds no step state: the
// scratch it works in is the layer's (MoeScratch, MoeHostScratch).
#ifndef SHARDSERVE_WORKER_SHARD_EXPERT_PLAN_H_
#define SHARDSERVE_WORKER_SHARD_EXPERT_PLAN_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "model/sharding.h"
#include "worker/communicator.h"

namespace shardserve {

// What a sparse layer (DecoderBlocks::MoeMlp) works in for n tokens of k experts each: n * k
// (token, expert) rows at most.
struct MoeScratch {
  Tensor router_logits;      // [n, experts] act: the router's product
  Tensor ids;                // [n, k] I32: each token's experts, in top-k order
  Tensor weights;            // [n, k] F32: their weights
  Tensor order;              // [n * k] I32: the (token, slot) pairs grouped by expert
  Tensor rows;               // [n, k] I32: each pair's row in the grouping
  Tensor offsets;            // [experts + 1] I32: where each expert's rows start (with expert
                             // parallelism, once Dispatch has sent them: this rank's experts' rows')
  Tensor row_counts;         // [experts] I32: rows per expert over the step's layers (MoeCountRows)
  Tensor tokens;             // [n * k] I32: each grouped row's token
  Tensor in;                 // [n * k, hidden] the grouped rows' inputs
  Tensor gate, up;           // [n * k, fe] each expert's products on its rows (this rank's slice)
  Tensor out;                // [n * k, hidden] each expert's output on its rows (partial sums)
  // The shared experts (Qwen2-MoE's, DeepSeek-V3's):
  Tensor shared_gate, shared_up;  // [n, fs] its products (this rank's slice)
  Tensor shared_out;              // [n, hidden] its output (partial sums), gated in place (Qwen2-MoE)
  Tensor shared_gate_logit;       // [n, 1] act: Qwen2-MoE's shared_expert_gate(h)
  // Expert parallelism only (model/families/moe.cc MoeBuffers):
  Tensor all_offsets;  // [tp, experts + 1] I32: every rank's `offsets`
  Tensor exchanged;    // [n * k, hidden] the rows received from the ranks (then the outputs sent back)
  Tensor regroup;      // [n * k] I32: each of this rank's experts' rows' place in `exchanged`
  Tensor ungroup;      // [n * k] I32: each row of `exchanged`'s place among the experts' rows
  Tensor gathered;     // [tp * ceil(n / tp), hidden] every rank's combined rows
};

// Host memory of the sparse layers, sized at load for the step limits. With the experts cut a
// step's grouping stays on the device (so a step graph can record it); expert parallelism reads
// the ranks' row counts on the host to size its exchanges.
struct MoeHostScratch {
  // Expert parallelism only:
  std::vector<int32_t> all_offsets;            // [tp * (experts + 1)]
  std::vector<int32_t> local_offsets;          // [experts + 1] this rank's experts' rows, regrouped
  std::vector<int32_t> regroup, ungroup;       // [n * k]
  std::vector<int64_t> send_rows, recv_rows;   // [tp]
  // Rows each expert of this rank computed since load (its load-balance counter), per expert id
  // [experts]: with the experts cut every rank counts every row; with expert parallelism each row
  // once, on its expert's rank. MoeScratch::row_counts of the steps run since the last read are
  // added to it (ModelShard::ExpertRowsTotal).
  std::vector<uint64_t> expert_rows_total;
  std::vector<int32_t> row_counts;  // [experts] the device's counts as read
};

// The rows this rank's experts compute on: `in` [rows, hidden] grouped by expert, their outputs
// into `out` [rows, hidden]; expert e's rows are [offsets[e], offsets[e + 1]) (device memory,
// [E + 1] I32, for e in ExpertPlan::experts).
struct ExpertRows {
  Tensor in, out, offsets;
};

struct ExpertPlan {
  Communicator* group = nullptr;  // the TP group
  bool expert_parallel = false;
  int64_t num_experts = 0;
  Range experts;  // the experts this rank computes (all of them when cut)

  // The rows of the step's n tokens this rank routes and combines.
  Range TokenRows(int64_t n) const;
  // m.in's first `sent` rows (this rank's (token, expert) rows grouped by expert, m.offsets
  // counting them) -> the rows this rank's experts compute on.
  absl::Status Dispatch(Backend& be, MoeScratch& m, MoeHostScratch& host, int64_t sent, ExpertRows* rows) const;
  // The experts' outputs (rows.out) -> *out [sent, hidden]: the outputs of this rank's `sent` rows,
  // in the order Dispatch took them.
  absl::Status Return(Backend& be, MoeScratch& m, MoeHostScratch& host, const ExpertRows& rows, int64_t sent,
                      Tensor* out) const;
  // proj's first TokenRows(n).size() rows (this rank's tokens' MoE output) -> proj [n, hidden]: every
  // token's output, on every rank.
  absl::Status Join(Backend& be, MoeScratch& m, Tensor* proj) const;
};

}  // namespace shardserve

#endif  // SHARDSERVE_WORKER_SHARD_EXPERT_PLAN_H_
