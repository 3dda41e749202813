// Group formation: which registered worker holds which slot (pipeline stage, TP rank) of a
// TP x PP layout, its global rank, and the names of the collective groups it joins, under an
// epoch. Pure functions of their arguments: no locks, no I/O. The coordinator's GroupFormation and
// Membership (group_formation.h, membership.h) call them, and Membership sends the result to the
// workers (worker.proto Assignment); the layers a stage holds come from the plan
// (coordinator/planner), not from here.
//
// Ranks, written once. A group of TP x PP workers has one slot per (stage, tp_rank):
//
//     rank = stage * tp + tp_rank
//
// A TP group is the ranks of one stage (consecutive: they all-reduce inside one node); a PP group
// is the ranks of one tp_rank across the stages (stride tp: the hidden state goes down it). Worked
// example, 8 workers on 4 nodes, TP=2, PP=4:
//
//     stage 0 (node n0): ranks 0 1
//     stage 1 (node n1): ranks 2 3
//     stage 2 (node n2): ranks 4 5
//     stage 3 (node n3): ranks 6 7
//     TP groups [0,1] [2,3] [4,5] [6,7]
//     PP groups [0,2,4,6] [1,3,5,7]
//
// Along a PP group the hidden state moves one pair of adjacent stages at a time (rank 0 -> 2,
// 2 -> 4, 4 -> 6), and each pair is its own 2-rank communicator: a worker's send group is the pair
// with the next stage, its recv group the pair with the previous one.
//
// Slots: the nodes, in the natural order of their names ("n2" before "n10"), are the stages, and a
// node's workers, in registration order, are that stage's TP ranks.
//
// Epochs: every group has a number, starting at 1; a group re-formed around a replacement gets the
// next one. Every group name starts with it ("e1/tp/stage0", "e1/pp/tp0/stage0-1"), so a re-formed
// group never meets an old one's keys in the rendezvous store (worker/comm/rendezvous.h: keys are
// never deleted, a name serves one communicator).
#ifndef SHARDSERVE_COORDINATOR_CLUSTER_GROUP_H_
#define SHARDSERVE_COORDINATOR_CLUSTER_GROUP_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace shardserve {

// The layout: TP ranks per stage (workers per node) x PP stages (nodes).
struct GroupShape {
  int tp = 1;
  int pp = 1;
};

// A registered worker: the caller's index for it, and the node it runs on.
struct Member {
  int index = -1;
  std::string node;
};

// One place in the group and who holds it.
struct Slot {
  int stage = 0;
  int tp_rank = 0;
  int rank = 0;      // stage * tp + tp_rank
  int worker = -1;   // the Member's index
  std::string node;  // the Member's node: the stage's node
  // The stage's TP group, "e1/tp/stage0", and its ranks: stage * tp + 0 .. tp - 1.
  std::string tp_group;
  std::vector<int> tp_ranks;
  // The tp_rank's PP group, "e1/pp/tp0", and its ranks: tp_rank, tp + tp_rank, ...,
  // (pp - 1) * tp + tp_rank. No communicator spans it: its pairs below are the communicators.
  std::string pp_group;
  std::vector<int> pp_ranks;
  // The pipeline pairs, "e1/pp/tp0/stage0-1" for stages 0 and 1: send_group with the next stage
  // (empty on the last), recv_group with the previous one (empty on the first).
  std::string send_group;
  std::string recv_group;
};

struct Group {
  GroupShape shape;
  uint64_t epoch = 0;
  std::vector<std::string> nodes;  // by stage
  std::vector<Slot> slots;         // by rank

  // The slot (stage, tp_rank); both must be inside the shape.
  const Slot& at(int stage, int tp_rank) const;
};

// The rank formula above, the one place it is written.
int RankOf(const GroupShape& shape, int stage, int tp_rank);

// Node names in natural order, digit runs compared as numbers: "n2" before "n10", so that stage i
// is node i for nodes named with their index.
bool NaturalLess(std::string_view a, std::string_view b);

// Places `registered` (in registration order) into the slots of `shape` under `epoch` (>= 1).
// InvalidArgument naming the numbers when the shape is not 1..4096 workers, when there are not
// tp x pp workers, not pp nodes, or a node without exactly tp workers, or a worker index twice.
absl::StatusOr<Group> FormGroup(const GroupShape& shape, const std::vector<Member>& registered, uint64_t epoch);

// `g` re-formed with `replacement` in the slot (stage, tp_rank), under epoch g.epoch + 1: the same
// slots and ranks, every survivor where it was, every group name new. InvalidArgument when the slot
// is outside the shape, the replacement is already in the group, or it runs on another node than
// the slot's (its TP peers are on that node, and node names order the stages).
absl::StatusOr<Group> Replace(const Group& g, int stage, int tp_rank, const Member& replacement);

// `g` re-formed by the same workers under epoch g.epoch + 1: every slot and rank as it was, every
// group name new (the survivors of a failed step form new communicators).
Group NextEpoch(const Group& g);

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_CLUSTER_GROUP_H_
