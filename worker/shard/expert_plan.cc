#include "worker/shard/expert_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace shardserve {

Range ExpertPlan::TokenRows(int64_t n) const {
  if (!expert_parallel) return {0, n};
  const int64_t t = group->size(), r = group->rank(), c = (n + t - 1) / t;
  return {std::min(n, r * c), std::min(n, (r + 1) * c)};
}

absl::Status ExpertPlan::Dispatch(Backend& be, MoeScratch& m, MoeHostScratch& host, int64_t sent,
                                  ExpertRows* rows) const {
  if (!expert_parallel) {
    // every expert is here (cut): the rows stay where they are
    *rows = {m.in.Rows(0, sent), m.out.Rows(0, sent), m.offsets};
    return absl::OkStatus();
  }
  const int t = group->size(), r = group->rank();
  const int64_t E = num_experts, W = E + 1;
  // every rank's rows per expert (its MoeGroupByExpert offsets), so each knows what to send and
  // what it receives
  Tensor all(m.all_offsets.data, DType::kI32, {t, W});
  SHARDSERVE_RETURN_IF_ERROR(group->AllGather(&all, m.offsets));
  SHARDSERVE_RETURN_IF_ERROR(be.CopyToHost(host.all_offsets.data(), all.data, all.bytes()));
  const int32_t* mine = &host.all_offsets[static_cast<size_t>(r) * W];
  int64_t received = 0;
  for (int p = 0; p < t; ++p) {
    const Range theirs = ExpertRange(E, p, t);
    const int32_t* from = &host.all_offsets[static_cast<size_t>(p) * W];
    host.send_rows[p] = mine[theirs.end] - mine[theirs.begin];
    host.recv_rows[p] = from[experts.end] - from[experts.begin];
    received += host.recv_rows[p];
  }
  if (received > m.exchanged.dim(0)) {
    return absl::InternalError(absl::StrCat("expert parallelism: ", received, " rows routed to this rank's experts, ",
                                            "more than the ", m.exchanged.dim(0), " the step buffers hold"));
  }
  // each row to its expert's rank (rank p's rows arrive as one block, grouped by expert)
  Tensor exchanged = m.exchanged.Rows(0, received);
  SHARDSERVE_RETURN_IF_ERROR(group->AllToAllV(&exchanged, m.in.Rows(0, sent), host.send_rows, host.recv_rows));
  // regrouped by expert: expert e's rows from rank 0, then from rank 1, ... (transformers' order
  // within an expert is the tokens', and the ranks hold consecutive tokens)
  int64_t row = 0;
  std::fill(host.local_offsets.begin(), host.local_offsets.end(), 0);
  for (int64_t e = experts.begin; e < experts.end; ++e) {
    host.local_offsets[e] = static_cast<int32_t>(row);
    int64_t block = 0;  // where rank p's rows start in exchanged
    for (int p = 0; p < t; ++p) {
      const int32_t* from = &host.all_offsets[static_cast<size_t>(p) * W];
      const int64_t begin = block + from[e] - from[experts.begin], count = from[e + 1] - from[e];
      for (int64_t j = 0; j < count; ++j, ++row) {
        host.regroup[row] = static_cast<int32_t>(begin + j);
        host.ungroup[begin + j] = static_cast<int32_t>(row);
      }
      block += host.recv_rows[p];
    }
  }
  for (int64_t e = experts.end; e <= E; ++e) host.local_offsets[e] = static_cast<int32_t>(row);
  // m.offsets, sent above, now counts this rank's experts' rows
  SHARDSERVE_RETURN_IF_ERROR(be.CopyToDevice(m.offsets.data, host.local_offsets.data(), m.offsets.bytes()));
  Tensor regroup = m.regroup.Rows(0, received), ungroup = m.ungroup.Rows(0, received);
  SHARDSERVE_RETURN_IF_ERROR(be.CopyToDevice(regroup.data, host.regroup.data(), received * sizeof(int32_t)));
  SHARDSERVE_RETURN_IF_ERROR(be.CopyToDevice(ungroup.data, host.ungroup.data(), received * sizeof(int32_t)));
  // m.in is free once sent: the regrouped rows go there (a row gather)
  Tensor in = m.in.Rows(0, received);
  SHARDSERVE_RETURN_IF_ERROR(be.Embedding(&in, exchanged, regroup, 0));
  *rows = {in, m.out.Rows(0, received), m.offsets};
  return absl::OkStatus();
}

absl::Status ExpertPlan::Return(Backend& be, MoeScratch& m, MoeHostScratch& host, const ExpertRows& rows,
                                int64_t sent, Tensor* out) const {
  *out = m.out.Rows(0, sent);
  if (!expert_parallel) return absl::OkStatus();  // computed in place
  // the outputs in the order the rows arrived (a row gather), then back to their tokens' ranks
  const int64_t received = rows.out.dim(0);
  Tensor exchanged = m.exchanged.Rows(0, received);
  SHARDSERVE_RETURN_IF_ERROR(be.Embedding(&exchanged, rows.out, m.ungroup.Rows(0, received), 0));
  return group->AllToAllV(out, exchanged, host.recv_rows, host.send_rows);
}

absl::Status ExpertPlan::Join(Backend& be, MoeScratch& m, Tensor* proj) const {
  // cut: the experts' partial sums (row-parallel down_proj), summed once
  if (!expert_parallel) return group->AllReduceSum(proj);
  // expert parallel: every rank's c rows (the first ones of its proj; rows past its tokens are
  // padding) gathered in rank order, which is token order: the first n rows are the step's
  const int64_t n = proj->dim(0), t = group->size(), c = (n + t - 1) / t, H = proj->dim(1);
  Tensor gathered(m.gathered.data, proj->dtype, {t, c, H});
  SHARDSERVE_RETURN_IF_ERROR(group->AllGather(&gathered, proj->Rows(0, c)));
  return be.CopyOnDevice(proj->data, gathered.data, proj->bytes());
}

}  // namespace shardserve
