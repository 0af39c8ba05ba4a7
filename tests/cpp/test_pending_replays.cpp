#include <gtest/gtest.h>

#include <stdexcept>

#include "pending_replays.h"

using pgd::core::decode_heartbeat;
using pgd::core::describe_timeout;
using pgd::core::encode_heartbeat;
using pgd::core::Heartbeat;
using pgd::core::PendingReplays;
using pgd::core::RankLiveness;
using pgd::core::WaitKind;

TEST(PendingReplays, RejectsNonPositiveTimeout) {
  EXPECT_THROW(PendingReplays(0.0), std::invalid_argument);
  EXPECT_THROW(PendingReplays(-1.0), std::invalid_argument);
}

TEST(PendingReplays, NothingPendingNeverTimesOut) {
  PendingReplays p(10.0);
  EXPECT_FALSE(p.check(1e6).timed_out());
  EXPECT_FALSE(p.oldest().has_value());
}

TEST(PendingReplays, OldestTimesOutAfterTimeoutSinceArming) {
  PendingReplays p(10.0);
  const uint64_t a = p.arm("[x] at iteration 5", "all_reduce float32 x 100", 100.0);
  EXPECT_EQ(a, 1u);
  EXPECT_FALSE(p.check(109.9).timed_out());
  auto v = p.check(110.5);
  ASSERT_TRUE(v.timed_out());
  EXPECT_EQ(v.kind, WaitKind::kReplay);
  EXPECT_EQ(v.replay.seq, 1u);
  EXPECT_EQ(v.replay.label, "[x] at iteration 5");
  EXPECT_EQ(v.replay.collectives, "all_reduce float32 x 100");
  EXPECT_NEAR(v.waited_s, 10.5, 1e-9);
  EXPECT_EQ(v.pending, 1u);
}

TEST(PendingReplays, CompletionsPopInOrderAndStaleSeqIsIgnored) {
  PendingReplays p(10.0);
  p.arm("a", "", 0.0);
  p.arm("b", "", 1.0);
  EXPECT_EQ(p.oldest()->label, "a");
  p.complete_oldest(2, 2.0);  // not the oldest: ignored
  EXPECT_EQ(p.pending(), 2u);
  p.complete_oldest(1, 2.0);
  EXPECT_EQ(p.oldest()->label, "b");
  EXPECT_EQ(p.completed(), 1u);
  p.complete_oldest(2, 3.0);
  EXPECT_FALSE(p.oldest().has_value());
  EXPECT_EQ(p.completed(), 2u);
  EXPECT_EQ(p.armed(), 2u);
}

TEST(PendingReplays, DeepQueueCountsFromLastProgressNotFromArming) {
  // The host armed 5 replays at t=0..0.4 and the GPU completes one every 4 s:
  // each waits up to 20 s since arming, but the GPU is never idle for 10 s.
  PendingReplays p(10.0);
  for (int i = 0; i < 5; ++i) {
    p.arm("r", "", 0.1 * i);
  }
  double t = 0.0;
  for (uint64_t seq = 1; seq <= 5; ++seq) {
    t += 4.0;
    EXPECT_FALSE(p.check(t).timed_out()) << "at t=" << t;
    p.complete_oldest(seq, t);
  }
  EXPECT_EQ(p.pending(), 0u);
}

TEST(PendingReplays, StallAfterProgressTimesOutFromTheLastCompletion) {
  PendingReplays p(10.0);
  p.arm("r1", "", 0.0);
  p.arm("r2", "", 0.0);
  p.complete_oldest(1, 3.0);
  EXPECT_FALSE(p.check(12.9).timed_out());
  auto v = p.check(13.5);
  ASSERT_TRUE(v.timed_out());
  EXPECT_EQ(v.replay.label, "r2");
  EXPECT_NEAR(v.waited_s, 10.5, 1e-9);
}

TEST(PendingReplays, ArmedLongAfterLastProgressCountsFromArming) {
  PendingReplays p(10.0);
  p.arm("r1", "", 0.0);
  p.complete_oldest(1, 1.0);
  p.arm("r2", "", 50.0);  // an idle host (evaluation, checkpointing) is not a hang
  EXPECT_FALSE(p.check(59.0).timed_out());
  EXPECT_TRUE(p.check(60.5).timed_out());
}

TEST(PendingReplays, BlockedLaunchTimesOut) {
  PendingReplays p(10.0);
  p.launch_started("[x] at iteration 9", "all_reduce", 5.0);
  EXPECT_TRUE(p.launching());
  EXPECT_FALSE(p.check(14.0).timed_out());
  auto v = p.check(15.5);
  ASSERT_TRUE(v.timed_out());
  EXPECT_EQ(v.kind, WaitKind::kLaunch);
  EXPECT_EQ(v.replay.label, "[x] at iteration 9");
  p.launch_finished(15.6);
  EXPECT_FALSE(p.check(100.0).timed_out());
}

TEST(PendingReplays, StuckReplayIsReportedBeforeABlockedLaunch) {
  PendingReplays p(10.0);
  p.arm("stuck", "", 0.0);
  p.launch_started("blocked", "", 1.0);
  auto v = p.check(20.0);
  EXPECT_EQ(v.kind, WaitKind::kReplay);
  EXPECT_EQ(v.replay.label, "stuck");
}

TEST(PendingReplays, ClearForgetsPendingWork) {
  PendingReplays p(10.0);
  p.arm("r1", "", 0.0);
  p.launch_started("l", "", 0.0);
  p.clear(1.0);
  EXPECT_EQ(p.pending(), 0u);
  EXPECT_FALSE(p.launching());
  EXPECT_FALSE(p.check(100.0).timed_out());
  p.complete_oldest(1, 2.0);  // the poller's answer for a cleared replay: ignored
  EXPECT_EQ(p.completed(), 0u);
}

TEST(Heartbeat, RoundTripsAndRejectsGarbage) {
  Heartbeat hb{1700000000.25, 207, 206};
  auto back = decode_heartbeat(encode_heartbeat(hb));
  ASSERT_TRUE(back.has_value());
  EXPECT_NEAR(back->wall_s, hb.wall_s, 1e-3);
  EXPECT_EQ(back->armed, 207u);
  EXPECT_EQ(back->completed, 206u);
  EXPECT_FALSE(decode_heartbeat("").has_value());
  EXPECT_FALSE(decode_heartbeat("12.5 3").has_value());
  EXPECT_FALSE(decode_heartbeat("12.5 3 4 extra").has_value());
  EXPECT_FALSE(decode_heartbeat("abc 1 2").has_value());
  EXPECT_FALSE(decode_heartbeat("12500 -3 4").has_value());
  EXPECT_FALSE(decode_heartbeat("12500 3 4 closed extra").has_value());
  EXPECT_FALSE(decode_heartbeat("12.5 3 4").has_value());  // milliseconds are integers
  EXPECT_FALSE(decode_heartbeat("nan 3 4").has_value());
  auto spaced = decode_heartbeat("  12500  3 4 \r\n");
  ASSERT_TRUE(spaced.has_value());
  EXPECT_DOUBLE_EQ(spaced->wall_s, 12.5);
  EXPECT_EQ(spaced->completed, 4u);
  EXPECT_EQ(encode_heartbeat(Heartbeat{12.5, 3, 4}), "12500 3 4");
  EXPECT_FALSE(back->closed);
  hb.closed = true;
  auto closed = decode_heartbeat(encode_heartbeat(hb));
  ASSERT_TRUE(closed.has_value());
  EXPECT_TRUE(closed->closed);
  EXPECT_FALSE(decode_heartbeat("12.5 3 4 closed more").has_value());
}

TEST(RankLiveness, ClosedRankIsNotReplaying) {
  RankLiveness l(2, 0, 8.0);
  Heartbeat hb{99.0, 180, 180};
  hb.closed = true;
  l.observe(1, hb, 100.0);
  EXPECT_EQ(l.stale(100.0), (std::vector<int>{1}));
  EXPECT_NE(l.describe(100.0).find("rank 1: closed its watchdog 1.0 s ago (it left training"),
            std::string::npos) << l.describe(100.0);
}

TEST(RankLiveness, DepartedAfterThreeClosedReadsInARow) {
  RankLiveness l(3, 0, 8.0);
  Heartbeat closed{99.0, 180, 180};
  closed.closed = true;
  for (int read = 1; read < RankLiveness::kDepartedReads; ++read) {
    l.observe(1, closed, 100.0 + read);
    EXPECT_TRUE(l.departed().empty()) << "after " << read << " read(s)";
  }
  l.observe(1, closed, 104.0);
  l.observe(2, Heartbeat{103.0, 5, 5}, 104.0);
  EXPECT_EQ(l.departed(), (std::vector<int>{1}));
  // Another model of that rank beats again (engines share the key): not departed.
  l.observe(1, Heartbeat{105.0, 181, 181}, 106.0);
  EXPECT_TRUE(l.departed().empty());
  l.observe(1, std::nullopt, 107.0);  // a read that found nothing changes nothing
  EXPECT_TRUE(l.departed().empty());
}

TEST(RankLiveness, StaleAndNeverSeenRanks) {
  RankLiveness l(4, 0, 8.0);
  EXPECT_FALSE(l.any_read());
  EXPECT_NE(l.describe(100.0).find("no heartbeat has been read"), std::string::npos);
  l.observe(1, Heartbeat{95.0, 10, 10}, 100.0);   // 5 s old: alive
  l.observe(2, Heartbeat{80.0, 7, 6}, 100.0);     // 20 s old: stale
  l.observe(3, std::nullopt, 100.0);              // never written
  EXPECT_EQ(l.stale(100.0), (std::vector<int>{2, 3}));
  const std::string d = l.describe(100.0);
  EXPECT_NE(d.find("rank 2: last heartbeat 20.0 s ago (NOT ALIVE), had armed 7 replays, 6 completed"),
            std::string::npos) << d;
  EXPECT_NE(d.find("rank 3: no heartbeat seen"), std::string::npos) << d;
  EXPECT_NE(d.find("rank 1: last heartbeat 5.0 s ago (alive)"), std::string::npos) << d;
  EXPECT_LT(d.find("rank 2:"), d.find("rank 1:")) << "stale ranks come first: " << d;
  EXPECT_EQ(d.find("rank 0:"), std::string::npos) << "self is not listed: " << d;
}

TEST(RankLiveness, OlderReadDoesNotReplaceNewerHeartbeat) {
  RankLiveness l(2, 1, 8.0);
  l.observe(0, Heartbeat{50.0, 5, 5}, 51.0);
  l.observe(0, Heartbeat{40.0, 4, 4}, 52.0);
  EXPECT_TRUE(l.stale(55.0).empty());
}

TEST(RankLiveness, AllAliveSaysARankIsNotReplaying) {
  RankLiveness l(2, 0, 8.0);
  l.observe(1, Heartbeat{99.0, 3, 3}, 100.0);
  EXPECT_NE(l.describe(100.0).find("running but not replaying"), std::string::npos);
}

TEST(RankLiveness, StoreErrorsAreReported) {
  RankLiveness l(2, 0, 8.0);
  l.observe(1, Heartbeat{90.0, 3, 3}, 91.0);
  l.store_unreachable("connection reset", 95.0);
  EXPECT_NE(l.describe(100.0).find("the store has not answered for 5.0 s (connection reset)"),
            std::string::npos);
  l.store_reachable();
  EXPECT_EQ(l.describe(100.0).find("has not answered"), std::string::npos);
}

TEST(RankLiveness, ManyRanksAreCapped) {
  RankLiveness l(100, 0, 8.0);
  for (int r = 1; r < 100; ++r) {
    l.observe(r, Heartbeat{99.0, 1, 1}, 100.0);
  }
  const std::string d = l.describe(100.0, 4);
  EXPECT_NE(d.find("... and 95 more ranks"), std::string::npos) << d;
}

TEST(DescribeTimeout, SaysWhatWhyAndTheExitCode) {
  PendingReplays p(10.0);
  p.arm("[(64, 32) float32] at iteration 212", "2 collectives: all_reduce float32 x 1000", 0.0);
  auto v = p.check(12.0);
  const std::string msg = describe_timeout(v, 10.0, "rank 0 of 2", "rank 1: gone\n", 70);
  EXPECT_NE(msg.find("rank 0 of 2: graph replay #1 [(64, 32) float32] at iteration 212 has not completed"),
            std::string::npos) << msg;
  EXPECT_NE(msg.find("no progress for 12.0 s (replay timeout 10 s)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("collectives in the graph: 2 collectives: all_reduce"), std::string::npos) << msg;
  EXPECT_NE(msg.find("    rank 1: gone"), std::string::npos) << msg;
  EXPECT_NE(msg.find("exit code 70"), std::string::npos) << msg;
  // Every line carries the prefix, so interleaved output of several ranks stays readable.
  size_t pos = 0;
  while ((pos = msg.find('\n', pos)) != std::string::npos && pos + 1 < msg.size()) {
    EXPECT_EQ(msg.compare(pos + 1, 24, "[pygraph_dist watchdog] "), 0) << msg;
    ++pos;
  }
}

TEST(DescribeTimeout, DepartedRanksAreTheReason) {
  PendingReplays p(600.0);
  p.arm("[x] at iteration 40", "all_reduce float32 x 10", 0.0);
  EXPECT_FALSE(p.check(12.0).timed_out());
  EXPECT_FALSE(p.check(12.0, 15.0).timed_out());
  const std::string msg = describe_timeout(p.check(12.0, 10.0), 600.0, "rank 0 of 3", "", 70, {1, 2});
  EXPECT_NE(msg.find("rank 0 of 3: graph replay #1 [x] at iteration 40 has waited 12.0 s, and rank(s) 1, 2 "
                     "left training"),
            std::string::npos) << msg;
  EXPECT_NE(msg.find("does not wait out the replay timeout (600 s)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("exit code 70"), std::string::npos) << msg;
}

TEST(DescribeTimeout, BlockedLaunch) {
  PendingReplays p(5.0);
  p.launch_started("[x] at iteration 3", "", 0.0);
  const std::string msg = describe_timeout(p.check(6.0), 5.0, "rank 1 of 2", "", 70);
  EXPECT_NE(msg.find("launching graph replay [x] at iteration 3 has not returned after 6.0 s"),
            std::string::npos) << msg;
}

TEST(PendingReplays, InterruptGivesUpOnAReplayThatWaitedThroughIt) {
  // Steps of 0.5 s complete; replay 3 is armed at 1.0 and never completes;
  // the interrupt comes at 1.2: given up 2 s later (grace 2 > 3 x 0.5).
  PendingReplays p(600.0);
  p.arm("a", "", 0.0);
  p.arm("b", "", 0.1);
  p.complete_oldest(1, 0.5);
  p.complete_oldest(2, 1.0);
  EXPECT_NEAR(p.longest_wait_s(), 0.5, 1e-9);
  p.arm("c", "", 1.0);
  EXPECT_FALSE(p.check_interrupted(3.1, 1.2, 2.0).timed_out());
  auto v = p.check_interrupted(3.3, 1.2, 2.0);
  ASSERT_TRUE(v.timed_out());
  EXPECT_EQ(v.replay.label, "c");
  EXPECT_NEAR(v.waited_s, 2.3, 1e-9);
  EXPECT_FALSE(p.check_interrupted(3.3, 0.0, 2.0).timed_out());  // no interrupt
}

TEST(PendingReplays, InterruptIgnoresReplaysArmedOrProgressingAfterIt) {
  PendingReplays p(600.0);
  p.arm("a", "", 0.0);
  // The script handled the interrupt at 0.2 and trains on: "a" completes
  // after it, "b" is armed after it -- a slow step then is not given up on.
  p.complete_oldest(1, 0.4);
  p.arm("b", "", 0.5);
  EXPECT_FALSE(p.check_interrupted(100.0, 0.2, 2.0).timed_out());
}

TEST(PendingReplays, InterruptWaitsThreeTimesTheLongestStep) {
  PendingReplays p(600.0);
  p.arm("a", "", 0.0);
  p.complete_oldest(1, 4.0);  // a 4 s step
  p.arm("b", "", 4.0);
  EXPECT_FALSE(p.check_interrupted(16.5, 4.5, 2.0).timed_out());  // 12 s after it: not yet
  EXPECT_TRUE(p.check_interrupted(16.6, 4.5, 2.0).timed_out());
}

TEST(PendingReplays, InterruptCountsFromACompletionSeenLateByThePoller) {
  // The step before the stuck one completed before the interrupt (1.2), but
  // the poller saw it at 1.5: still given up, 2 s after that.
  PendingReplays p(600.0);
  p.arm("a", "", 0.9);
  p.arm("b", "", 1.0);  // the stuck one, launched before the interrupt
  p.complete_oldest(1, 1.5);
  EXPECT_FALSE(p.check_interrupted(3.4, 1.2, 2.0).timed_out());
  auto v = p.check_interrupted(3.6, 1.2, 2.0);
  ASSERT_TRUE(v.timed_out());
  EXPECT_EQ(v.replay.label, "b");
}
