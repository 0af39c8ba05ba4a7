#include <gtest/gtest.h>

#include <stdexcept>

#include "capture_policy.h"

using pgd::core::CapturePolicy;
using pgd::core::Phase;
using pgd::core::PolicyConfig;

namespace {

PolicyConfig config(int probe, int warmup, int attempts = 2, int recaptures = 2) {
  PolicyConfig c;
  c.probe_iters = probe;
  c.warmup_iters = warmup;
  c.max_capture_attempts = attempts;
  c.max_recaptures = recaptures;
  return c;
}

}  // namespace

TEST(CapturePolicy, HappyPath) {
  CapturePolicy p(config(1, 2));
  EXPECT_EQ(p.begin_iteration(), Phase::kProbe);
  EXPECT_EQ(p.begin_iteration(), Phase::kWarmup);
  EXPECT_EQ(p.begin_iteration(), Phase::kWarmup);
  EXPECT_EQ(p.begin_iteration(), Phase::kCapture);
  p.capture_succeeded();
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(p.begin_iteration(), Phase::kReplay);
  }
  EXPECT_EQ(p.replays(), 5);
  EXPECT_EQ(p.eager_iterations(), 4);
  EXPECT_EQ(p.iterations(), 9);
}

TEST(CapturePolicy, NoProbeNoWarmupCapturesFirst) {
  CapturePolicy p(config(0, 0));
  EXPECT_EQ(p.begin_iteration(), Phase::kCapture);
}

TEST(CapturePolicy, RetryableFailureRetriesThenGivesUp) {
  CapturePolicy p(config(0, 1, /*attempts=*/2));
  EXPECT_EQ(p.begin_iteration(), Phase::kWarmup);
  EXPECT_EQ(p.begin_iteration(), Phase::kCapture);
  p.capture_failed("rank 1: operation not permitted", /*retryable=*/true);
  EXPECT_EQ(p.phase(), Phase::kWarmup);
  EXPECT_EQ(p.begin_iteration(), Phase::kWarmup);
  EXPECT_EQ(p.begin_iteration(), Phase::kCapture);
  p.capture_failed("rank 1: operation not permitted", true);
  EXPECT_EQ(p.phase(), Phase::kEager);
  EXPECT_NE(p.reason().find("after 2 capture attempts"), std::string::npos);
  EXPECT_EQ(p.begin_iteration(), Phase::kEager);
}

TEST(CapturePolicy, NonRetryableFailureIsFinal) {
  CapturePolicy p(config(0, 0, 5));
  p.begin_iteration();
  p.capture_failed("host sync in forward", false);
  EXPECT_EQ(p.phase(), Phase::kEager);
  EXPECT_EQ(p.reason(), "host sync in forward");
}

TEST(CapturePolicy, ConformanceFailureDuringProbe) {
  CapturePolicy p(config(2, 3));
  EXPECT_EQ(p.begin_iteration(), Phase::kProbe);
  p.conformance_failed("clip_grad_norm_ between backward() and step()");
  EXPECT_EQ(p.begin_iteration(), Phase::kEager);
  EXPECT_EQ(p.reason(), "clip_grad_norm_ between backward() and step()");
}

TEST(CapturePolicy, InvalidateRecapturesUntilLimit) {
  CapturePolicy p(config(0, 1, 2, /*recaptures=*/1));
  p.begin_iteration();
  p.begin_iteration();
  p.capture_succeeded();
  EXPECT_EQ(p.begin_iteration(), Phase::kReplay);
  p.invalidate("betas changed");
  EXPECT_EQ(p.begin_iteration(), Phase::kWarmup);
  EXPECT_EQ(p.begin_iteration(), Phase::kCapture);
  p.capture_succeeded();
  p.invalidate("betas changed again");
  EXPECT_EQ(p.phase(), Phase::kEager);
  EXPECT_NE(p.reason().find("max_recaptures=1"), std::string::npos) << p.reason();
}

TEST(CapturePolicy, InvalidateBeforeCaptureIsANoop) {
  CapturePolicy p(config(0, 2));
  p.begin_iteration();
  p.invalidate("lr changed");
  EXPECT_EQ(p.recaptures(), 0);
  EXPECT_EQ(p.begin_iteration(), Phase::kWarmup);
}

TEST(CapturePolicy, RejectAndDisable) {
  CapturePolicy a(config(0, 0));
  a.begin_iteration();
  a.capture_succeeded();
  a.reject("replay 1.02x of eager, below the 1.05x margin");
  EXPECT_EQ(a.begin_iteration(), Phase::kEager);
  CapturePolicy b(config(1, 1));
  b.disable("CUDA is not available");
  EXPECT_EQ(b.begin_iteration(), Phase::kEager);
}

TEST(CapturePolicy, MisuseThrows) {
  CapturePolicy p(config(1, 1));
  EXPECT_THROW(p.capture_succeeded(), std::logic_error);
  EXPECT_THROW(p.capture_failed("x", true), std::logic_error);
  EXPECT_THROW(CapturePolicy(config(-1, 0)), std::invalid_argument);
  EXPECT_THROW(CapturePolicy(config(0, 0, 0)), std::invalid_argument);
}

TEST(CapturePolicy, CapWarmup) {
  CapturePolicy p(config(0, 3));
  EXPECT_EQ(p.begin_iteration(), Phase::kWarmup);  // 2 left
  p.cap_warmup(5);                                  // larger cap: no change
  EXPECT_EQ(p.begin_iteration(), Phase::kWarmup);  // 1 left
  p.cap_warmup(0);
  EXPECT_EQ(p.phase(), Phase::kCapture);
  EXPECT_EQ(p.begin_iteration(), Phase::kCapture);
  p.capture_succeeded();
  p.cap_warmup(0);  // outside warm-up: no-op
  EXPECT_EQ(p.phase(), Phase::kReplay);
  CapturePolicy q(config(1, 4));
  q.cap_warmup(0);  // still probing: no-op
  EXPECT_EQ(q.begin_iteration(), Phase::kProbe);
}
