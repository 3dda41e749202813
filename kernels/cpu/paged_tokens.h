// The check of a paged attention's token metadata that the CPU backend's Attention
// (attention.cc) and MlaAttention (mla_attention.cc) make before they touch the cache.
#ifndef SHARDSERVE_KERNELS_CPU_PAGED_TOKENS_H_
#define SHARDSERVE_KERNELS_CPU_PAGED_TOKENS_H_

#include <cstdint>
#include <string>

#include "kernels/tensor.h"

namespace shardserve::cpu {

// What is wrong with the metadata, or "" when nothing is: each token's sequence in [0, block_tables
// rows), its position within its block table, and each table entry it reads (from the block of its
// first key, p - window + 1 with a window, else 0) a block of the cache's num_blocks.
std::string PagedTokensError(const Tensor& block_tables /*[seqs, max_blocks] i32*/, const Tensor& positions /*[n] i32*/,
                             const Tensor& token_seq /*[n] i32*/, int64_t num_blocks, int64_t block_size,
                             int64_t window);

}  // namespace shardserve::cpu

#endif  // SHARDSERVE_KERNELS_CPU_PAGED_TOKENS_H_
