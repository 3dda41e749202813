// Group formation (coordinator/cluster/group.h): slots, ranks, TP and PP groups and their names
// for every layout, the errors for a wrong set of workers, and a replacement joining a group.
#include "coordinator/cluster/group.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace shardserve {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

struct Layout {
  int tp;
  int pp;
};

std::string LayoutName(const ::testing::TestParamInfo<Layout>& info) {
  return "TP" + std::to_string(info.param.tp) + "_PP" + std::to_string(info.param.pp);
}

// Stage s runs on node "n<5 s>": n0, n5, n10, n15, ... so that, from 3 stages on, the natural
// order of the names differs from their byte order ("n10" < "n5").
std::string NodeOf(int stage) { return "n" + std::to_string(5 * stage); }

// The workers of a layout, registered interleaved across the nodes (the last stage's first), with
// indices 100, 101, ... that are not ranks. `expected[{stage, tp_rank}]` is the index that slot
// must get: a node's workers take its TP ranks in registration order.
struct Registration {
  std::vector<Member> members;
  std::map<std::pair<int, int>, int> expected;
};

Registration Register(const Layout& l) {
  Registration r;
  int index = 100;
  for (int tp_rank = 0; tp_rank < l.tp; ++tp_rank) {
    for (int stage = l.pp - 1; stage >= 0; --stage) {
      r.members.push_back(Member{index, NodeOf(stage)});
      r.expected[{stage, tp_rank}] = index++;
    }
  }
  return r;
}

// Every group name of `g`: TP groups, PP groups and pipeline pairs.
std::set<std::string> Names(const Group& g) {
  std::set<std::string> names;
  for (const Slot& s : g.slots) {
    for (const std::string& n : {s.tp_group, s.pp_group, s.send_group, s.recv_group}) {
      if (!n.empty()) names.insert(n);
    }
  }
  return names;
}

class GroupTest : public ::testing::TestWithParam<Layout> {};

TEST_P(GroupTest, EverySlotFilledOnceByTheExpectedWorker) {
  const Layout l = GetParam();
  const Registration r = Register(l);
  absl::StatusOr<Group> g = FormGroup(GroupShape{l.tp, l.pp}, r.members, 1);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->epoch, 1u);
  ASSERT_EQ(g->slots.size(), static_cast<size_t>(l.tp * l.pp));
  std::set<int> workers;
  for (const Slot& s : g->slots) {
    EXPECT_EQ(s.worker, (r.expected.at({s.stage, s.tp_rank}))) << "stage " << s.stage << " tp " << s.tp_rank;
    EXPECT_EQ(s.node, NodeOf(s.stage));
    EXPECT_TRUE(workers.insert(s.worker).second) << "worker " << s.worker << " holds two slots";
  }
  EXPECT_EQ(workers.size(), r.members.size());
}

TEST_P(GroupTest, RankIsStageTimesTpPlusTpRank) {
  const Layout l = GetParam();
  absl::StatusOr<Group> g = FormGroup(GroupShape{l.tp, l.pp}, Register(l).members, 1);
  ASSERT_TRUE(g.ok()) << g.status();
  for (int stage = 0; stage < l.pp; ++stage) {
    for (int tp_rank = 0; tp_rank < l.tp; ++tp_rank) {
      const int rank = stage * l.tp + tp_rank;
      EXPECT_EQ(RankOf(g->shape, stage, tp_rank), rank);
      const Slot& s = g->slots[rank];
      EXPECT_EQ(s.rank, rank);
      EXPECT_EQ(s.stage, stage);
      EXPECT_EQ(s.tp_rank, tp_rank);
      EXPECT_EQ(&g->at(stage, tp_rank), &s);
    }
  }
}

TEST_P(GroupTest, TpGroupsAreTheRanksOfOneStage) {
  const Layout l = GetParam();
  absl::StatusOr<Group> g = FormGroup(GroupShape{l.tp, l.pp}, Register(l).members, 1);
  ASSERT_TRUE(g.ok()) << g.status();
  std::set<std::string> names;
  for (const Slot& s : g->slots) {
    EXPECT_EQ(s.tp_group, "e1/tp/stage" + std::to_string(s.stage));
    names.insert(s.tp_group);
    ASSERT_EQ(s.tp_ranks.size(), static_cast<size_t>(l.tp));
    for (int k = 0; k < l.tp; ++k) {
      const Slot& peer = g->slots[s.tp_ranks[k]];
      EXPECT_EQ(peer.stage, s.stage);
      EXPECT_EQ(peer.tp_rank, k);
      EXPECT_EQ(peer.node, s.node) << "a TP group stays on one node";
      EXPECT_EQ(peer.tp_group, s.tp_group);
    }
  }
  EXPECT_EQ(names.size(), static_cast<size_t>(l.pp)) << "one TP group per stage";
}

TEST_P(GroupTest, PpGroupsAreTheRanksOfOneTpRankAcrossStages) {
  const Layout l = GetParam();
  absl::StatusOr<Group> g = FormGroup(GroupShape{l.tp, l.pp}, Register(l).members, 1);
  ASSERT_TRUE(g.ok()) << g.status();
  std::set<std::string> pairs;
  for (const Slot& s : g->slots) {
    EXPECT_EQ(s.pp_group, "e1/pp/tp" + std::to_string(s.tp_rank));
    ASSERT_EQ(s.pp_ranks.size(), static_cast<size_t>(l.pp));
    for (int stage = 0; stage < l.pp; ++stage) {
      const Slot& peer = g->slots[s.pp_ranks[stage]];
      EXPECT_EQ(peer.stage, stage);
      EXPECT_EQ(peer.tp_rank, s.tp_rank);
      EXPECT_EQ(peer.pp_group, s.pp_group);
    }
    // The pipeline pairs: this slot's send group is the next stage's recv group, same TP rank.
    if (s.stage + 1 < l.pp) {
      EXPECT_EQ(s.send_group, g->at(s.stage + 1, s.tp_rank).recv_group);
      EXPECT_THAT(s.send_group, HasSubstr(s.pp_group + "/"));
      EXPECT_TRUE(pairs.insert(s.send_group).second) << s.send_group << " names two pairs";
    } else {
      EXPECT_EQ(s.send_group, "");
    }
    if (s.stage == 0) {
      EXPECT_EQ(s.recv_group, "");
    }
  }
  EXPECT_EQ(pairs.size(), static_cast<size_t>(l.tp * (l.pp - 1)));
  for (const std::string& name : Names(*g)) EXPECT_EQ(name.rfind("e1/", 0), 0u) << name;
}

TEST_P(GroupTest, StagesFollowTheNaturalOrderOfNodeNames) {
  const Layout l = GetParam();
  absl::StatusOr<Group> g = FormGroup(GroupShape{l.tp, l.pp}, Register(l).members, 1);
  ASSERT_TRUE(g.ok()) << g.status();
  std::vector<std::string> want;
  for (int stage = 0; stage < l.pp; ++stage) want.push_back(NodeOf(stage));
  EXPECT_EQ(g->nodes, want);
}

TEST_P(GroupTest, TooManyWorkersIsAnErrorNamingTheNumbers) {
  const Layout l = GetParam();
  std::vector<Member> members = Register(l).members;
  members.push_back(Member{999, NodeOf(0)});
  absl::StatusOr<Group> g = FormGroup(GroupShape{l.tp, l.pp}, members, 1);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(g.status().message(),
              HasSubstr("needs " + std::to_string(l.tp * l.pp) + " workers, got " + std::to_string(l.tp * l.pp + 1)));
}

TEST_P(GroupTest, TooFewWorkersIsAnErrorNamingTheNumbers) {
  const Layout l = GetParam();
  std::vector<Member> members = Register(l).members;
  members.pop_back();
  absl::StatusOr<Group> g = FormGroup(GroupShape{l.tp, l.pp}, members, 1);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(g.status().message(),
              HasSubstr("needs " + std::to_string(l.tp * l.pp) + " workers, got " + std::to_string(l.tp * l.pp - 1)));
}

TEST_P(GroupTest, WorkersSpreadWrongOverNodesIsAnError) {
  const Layout l = GetParam();
  std::vector<Member> members = Register(l).members;
  // The right number of workers, but one on a node of its own: PP + 1 nodes, or (TP = 1) a
  // node with two workers.
  members.back().node = "extra";
  if (l.tp == 1) members.back().node = members.front().node;
  absl::StatusOr<Group> g = FormGroup(GroupShape{l.tp, l.pp}, members, 1);
  if (l.tp == 1 && l.pp == 1) {
    EXPECT_TRUE(g.ok()) << "one worker on its own node is always a group";
    return;
  }
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
  if (l.tp == 1) {
    EXPECT_THAT(g.status().message(),
                HasSubstr("needs " + std::to_string(l.pp) + " nodes, got " + std::to_string(l.pp - 1)));
  } else {
    EXPECT_THAT(g.status().message(),
                HasSubstr("needs " + std::to_string(l.pp) + " nodes, got " + std::to_string(l.pp + 1)));
  }
}

TEST_P(GroupTest, ReplacingAnySlotKeepsEveryOtherSlot) {
  const Layout l = GetParam();
  absl::StatusOr<Group> g = FormGroup(GroupShape{l.tp, l.pp}, Register(l).members, 1);
  ASSERT_TRUE(g.ok()) << g.status();
  for (const Slot& lost : g->slots) {
    absl::StatusOr<Group> next = Replace(*g, lost.stage, lost.tp_rank, Member{500, lost.node});
    ASSERT_TRUE(next.ok()) << next.status();
    EXPECT_EQ(next->epoch, 2u);
    for (const Slot& s : next->slots) {
      const Slot& before = g->slots[s.rank];
      EXPECT_EQ(s.worker, s.rank == lost.rank ? 500 : before.worker);
      EXPECT_EQ(std::tie(s.stage, s.tp_rank, s.node), std::tie(before.stage, before.tp_rank, before.node));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, GroupTest,
                         ::testing::Values(Layout{1, 1}, Layout{2, 1}, Layout{8, 1}, Layout{1, 2}, Layout{1, 3},
                                           Layout{2, 2}, Layout{4, 2}, Layout{2, 4}, Layout{3, 5}, Layout{1, 12}),
                         LayoutName);

// ---- The worked example of group.h and other single cases ----------------------------------------

TEST(GroupExampleTest, TP2_PP4_GroupsAsInTheComment) {
  std::vector<Member> members;
  for (int k = 0; k < 8; ++k) members.push_back(Member{k, "n" + std::to_string(k / 2)});
  absl::StatusOr<Group> g = FormGroup(GroupShape{2, 4}, members, 1);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_THAT(g->at(0, 0).tp_ranks, ElementsAre(0, 1));
  EXPECT_THAT(g->at(1, 1).tp_ranks, ElementsAre(2, 3));
  EXPECT_THAT(g->at(3, 0).tp_ranks, ElementsAre(6, 7));
  EXPECT_THAT(g->at(2, 0).pp_ranks, ElementsAre(0, 2, 4, 6));
  EXPECT_THAT(g->at(0, 1).pp_ranks, ElementsAre(1, 3, 5, 7));
  EXPECT_EQ(g->at(1, 0).send_group, "e1/pp/tp0/stage1-2");
  EXPECT_EQ(g->at(1, 0).recv_group, "e1/pp/tp0/stage0-1");
  EXPECT_EQ(g->at(1, 0).tp_group, "e1/tp/stage1");
}

TEST(GroupExampleTest, NodeNamesInNaturalOrder) {
  EXPECT_TRUE(NaturalLess("n2", "n10"));
  EXPECT_FALSE(NaturalLess("n10", "n2"));
  EXPECT_TRUE(NaturalLess("n02", "n10"));
  EXPECT_TRUE(NaturalLess("a", "b"));
  EXPECT_TRUE(NaturalLess("node", "node1"));
  absl::StatusOr<Group> g =
      FormGroup(GroupShape{1, 3}, {Member{0, "n10"}, Member{1, "n2"}, Member{2, "n1"}}, 1);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_THAT(g->nodes, ElementsAre("n1", "n2", "n10"));
  EXPECT_EQ(g->at(0, 0).worker, 2);
  EXPECT_EQ(g->at(2, 0).worker, 0);
}

TEST(GroupExampleTest, NodeWithTooManyWorkersIsNamed) {
  absl::StatusOr<Group> g =
      FormGroup(GroupShape{2, 2}, {Member{0, "a"}, Member{1, "a"}, Member{2, "a"}, Member{3, "b"}}, 1);
  ASSERT_FALSE(g.ok());
  EXPECT_THAT(g.status().message(), HasSubstr("TP=2 needs 2 workers on every node; node a has 3"));
}

TEST(GroupExampleTest, BadShapeEpochOrDuplicateIsAnError) {
  EXPECT_THAT(FormGroup(GroupShape{0, 1}, {}, 1).status().message(), HasSubstr("TP=0 x PP=1"));
  EXPECT_THAT(FormGroup(GroupShape{1, 1}, {Member{0, "a"}}, 0).status().message(), HasSubstr("epochs start at 1"));
  EXPECT_THAT(FormGroup(GroupShape{2, 1}, {Member{7, "a"}, Member{7, "a"}}, 1).status().message(),
              HasSubstr("worker index 7 is registered twice"));
}

// ---- A replacement joining an existing group ------------------------------------------------------

// The same workers re-form the group (a failed step, no one lost): same slots, next epoch, every
// name new.
TEST(GroupReplaceTest, NextEpochKeepsEverySlotAndRenamesEveryGroup) {
  const std::vector<Member> members = {Member{0, "n0"}, Member{1, "n0"}, Member{2, "n1"}, Member{3, "n1"}};
  absl::StatusOr<Group> g = FormGroup(GroupShape{2, 2}, members, 3);
  ASSERT_TRUE(g.ok()) << g.status();
  const Group next = NextEpoch(*g);
  EXPECT_EQ(next.epoch, 4u);
  ASSERT_EQ(next.slots.size(), g->slots.size());
  for (const Slot& s : next.slots) {
    EXPECT_EQ(s.worker, g->slots[s.rank].worker);
    EXPECT_EQ(s.tp_group.rfind("e4/", 0), 0u) << s.tp_group;
  }
  for (const std::string& name : Names(next)) EXPECT_EQ(Names(*g).count(name), 0u) << name;
}

TEST(GroupReplaceTest, TP2_PP2_ReplaceStage1Tp0) {
  const std::vector<Member> members = {Member{0, "n0"}, Member{1, "n0"}, Member{2, "n1"}, Member{3, "n1"}};
  absl::StatusOr<Group> g = FormGroup(GroupShape{2, 2}, members, 1);
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_EQ(g->at(1, 0).worker, 2);

  absl::StatusOr<Group> next = Replace(*g, 1, 0, Member{4, "n1"});
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->epoch, 2u);
  EXPECT_EQ(next->nodes, g->nodes);
  // Same slots and ranks; the new worker in the lost slot, the survivors where they were.
  ASSERT_EQ(next->slots.size(), 4u);
  EXPECT_EQ(next->at(1, 0).worker, 4);
  EXPECT_EQ(next->at(1, 0).rank, 2);
  EXPECT_EQ(next->at(0, 0).worker, 0);
  EXPECT_EQ(next->at(0, 1).worker, 1);
  EXPECT_EQ(next->at(1, 1).worker, 3);
  for (const Slot& s : next->slots) {
    const Slot& before = g->slots[s.rank];
    EXPECT_EQ(s.stage, before.stage);
    EXPECT_EQ(s.tp_rank, before.tp_rank);
    EXPECT_EQ(s.node, before.node);
    EXPECT_EQ(s.tp_ranks, before.tp_ranks);
    EXPECT_EQ(s.pp_ranks, before.pp_ranks);
  }
  // Every group name is new: the old group's rendezvous keys are never met again.
  const std::set<std::string> old_names = Names(*g), new_names = Names(*next);
  EXPECT_EQ(new_names.size(), old_names.size());
  for (const std::string& name : new_names) {
    EXPECT_EQ(old_names.count(name), 0u) << name << " was a name of epoch 1";
    EXPECT_EQ(name.rfind("e2/", 0), 0u) << name;
  }
  EXPECT_EQ(next->at(1, 0).tp_group, "e2/tp/stage1");
  EXPECT_EQ(next->at(1, 0).recv_group, "e2/pp/tp0/stage0-1");

  // A second loss moves to epoch 3.
  absl::StatusOr<Group> third = Replace(*next, 0, 1, Member{5, "n0"});
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(third->epoch, 3u);
  EXPECT_EQ(third->at(1, 0).worker, 4);
  EXPECT_EQ(third->at(0, 1).worker, 5);
}

TEST(GroupReplaceTest, WrongSlotNodeOrWorkerIsAnError) {
  absl::StatusOr<Group> g =
      FormGroup(GroupShape{2, 2}, {Member{0, "n0"}, Member{1, "n0"}, Member{2, "n1"}, Member{3, "n1"}}, 1);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_THAT(Replace(*g, 2, 0, Member{4, "n1"}).status().message(),
              HasSubstr("slot (stage 2, tp rank 0) is outside TP=2 x PP=2"));
  EXPECT_THAT(Replace(*g, 1, 2, Member{4, "n1"}).status().message(), HasSubstr("outside"));
  EXPECT_THAT(Replace(*g, 1, 0, Member{4, "n0"}).status().message(),
              HasSubstr("stage 1 runs on node n1; a replacement from node n0 cannot join it"));
  EXPECT_THAT(Replace(*g, 1, 0, Member{3, "n1"}).status().message(),
              HasSubstr("worker index 3 already holds stage 1 tp rank 1"));
}

}  // namespace
}  // namespace shardserve
