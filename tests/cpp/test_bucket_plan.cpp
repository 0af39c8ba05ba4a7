#include <gtest/gtest.h>

#include <numeric>
#include <set>
#include <stdexcept>

#include "bucket_plan.h"

using pgd::core::BucketPlan;
using pgd::core::ParamSpec;
using pgd::core::plan_buckets;

namespace {

ParamSpec f32(int64_t numel, int device = 0) {
  return ParamSpec{numel, 4, /*dtype=*/6, device, true};
}

}  // namespace

TEST(BucketPlan, ReverseOrderAndCap) {
  // Four 100-element fp32 params (400 B each); cap 1000 B, first cap 1000 B.
  std::vector<ParamSpec> params(4, f32(100));
  BucketPlan plan = plan_buckets(params, 1000, 1000);
  ASSERT_EQ(plan.buckets.size(), 2u);
  // Reverse order: params 3, 2 fill the first bucket (800 B; 1200 would exceed).
  EXPECT_EQ(plan.buckets[0].params, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(plan.buckets[1].params, (std::vector<int64_t>{1, 0}));
  // Slots start at multiples of 16 elements: 100 is padded to 112.
  EXPECT_EQ(plan.buckets[0].offsets, (std::vector<int64_t>{0, 112}));
  EXPECT_EQ(plan.buckets[0].numel, 212);
  EXPECT_EQ(plan.buckets[0].bytes, 800);  // the cap counts the gradients, not the padding
  EXPECT_EQ(plan.bucket_of_param[0], 1);
  EXPECT_EQ(plan.offset_of_param[0], 112);
  // Without alignment, DDP's packing.
  BucketPlan packed = plan_buckets(params, 1000, 1000, 1);
  EXPECT_EQ(packed.buckets[0].offsets, (std::vector<int64_t>{0, 100}));
  EXPECT_EQ(packed.buckets[0].numel, 200);
}

TEST(BucketPlan, SlotsAreAlignedForEveryElementSize) {
  // A 10-element bias (a 10-class head) before 256-element slots: without
  // padding every later fp32 slot would sit 40 bytes off a 16-byte boundary.
  for (int64_t elem : {1, 2, 4, 8}) {
    std::vector<ParamSpec> params = {{256, elem, 6, 0, true}, {2560, elem, 6, 0, true},
                                     {3, elem, 6, 0, true}, {10, elem, 6, 0, true}};
    BucketPlan plan = plan_buckets(params, 1 << 20, 1 << 20);
    ASSERT_EQ(plan.buckets.size(), 1u);
    const auto& b = plan.buckets[0];
    EXPECT_EQ(b.params, (std::vector<int64_t>{3, 2, 1, 0}));
    EXPECT_EQ(b.offsets, (std::vector<int64_t>{0, 16, 32, 2592}));
    EXPECT_EQ(b.numel, 2592 + 256);
    EXPECT_EQ(b.bytes, (10 + 3 + 2560 + 256) * elem);
    for (int64_t off : b.offsets) {
      EXPECT_EQ(off * elem % 16, 0) << "element size " << elem;
    }
  }
  EXPECT_THROW(plan_buckets({f32(1)}, 100, 100, 0), std::invalid_argument);
}

TEST(BucketPlan, FirstBucketIsSmall) {
  std::vector<ParamSpec> params(6, f32(100));  // 400 B each
  BucketPlan plan = plan_buckets(params, 2000, 400);
  ASSERT_GE(plan.buckets.size(), 2u);
  EXPECT_EQ(plan.buckets[0].params, (std::vector<int64_t>{5}));
  // The rest fit in one 2000 B bucket.
  EXPECT_EQ(plan.buckets[1].params, (std::vector<int64_t>{4, 3, 2, 1, 0}));
}

TEST(BucketPlan, IsolatedParamAloneAndOpenBucketStaysOpen) {
  // Params 0..3, 400 B each; param 2 is isolated (a sparse embedding).
  std::vector<ParamSpec> params(4, f32(100));
  params[2].isolated = true;
  BucketPlan plan = plan_buckets(params, 2000, 2000);
  ASSERT_EQ(plan.buckets.size(), 2u);
  // Walk: 3 opens bucket 0; 2 gets bucket 1 alone; 1 and 0 join bucket 0.
  EXPECT_EQ(plan.buckets[0].params, (std::vector<int64_t>{3, 1, 0}));
  EXPECT_FALSE(plan.buckets[0].isolated);
  EXPECT_EQ(plan.buckets[1].params, (std::vector<int64_t>{2}));
  EXPECT_TRUE(plan.buckets[1].isolated);
  EXPECT_EQ(plan.bucket_of_param[2], 1);
  EXPECT_EQ(plan.offset_of_param[2], 0);
  EXPECT_EQ(plan.offset_of_param[1], 112);  // 100 rounded up to 16 elements
  // A tiny isolated parameter still never shares.
  std::vector<ParamSpec> two = {f32(1), f32(1)};
  two[0].isolated = true;
  EXPECT_EQ(plan_buckets(two, 2000, 2000).buckets.size(), 2u);
}

TEST(BucketPlan, OversizedParamGetsOwnBucket) {
  std::vector<ParamSpec> params = {f32(10), f32(10000), f32(10)};
  BucketPlan plan = plan_buckets(params, 1000, 1000);
  ASSERT_EQ(plan.buckets.size(), 3u);
  EXPECT_EQ(plan.buckets[1].params, (std::vector<int64_t>{1}));
  EXPECT_EQ(plan.buckets[1].bytes, 40000);
}

TEST(BucketPlan, DtypesAndDevicesNeverMix) {
  std::vector<ParamSpec> params = {
      {10, 4, 6, 0, true}, {10, 2, 15, 0, true}, {10, 4, 6, 1, true},
      {10, 4, 6, 0, true}};
  BucketPlan plan = plan_buckets(params, 1 << 20, 1 << 20);
  for (const auto& b : plan.buckets) {
    for (int64_t p : b.params) {
      EXPECT_EQ(params[p].dtype, b.dtype);
      EXPECT_EQ(params[p].device, b.device);
    }
  }
  EXPECT_EQ(plan.buckets.size(), 3u);
  // Params 3 and 0 share a bucket even though others are interleaved.
  EXPECT_EQ(plan.bucket_of_param[0], plan.bucket_of_param[3]);
}

TEST(BucketPlan, FrozenParamsAreSkippedAndEveryOtherParamPlacedOnce) {
  std::vector<ParamSpec> params;
  for (int i = 0; i < 50; ++i) {
    params.push_back({i + 1, 4, 6, 0, i % 7 != 0});
  }
  BucketPlan plan = plan_buckets(params, 256, 64);
  std::multiset<int64_t> seen;
  for (const auto& b : plan.buckets) {
    int64_t expect_offset = 0;
    for (size_t k = 0; k < b.params.size(); ++k) {
      seen.insert(b.params[k]);
      expect_offset = (expect_offset + 15) / 16 * 16;  // each slot 16-element aligned
      EXPECT_EQ(b.offsets[k], expect_offset);
      expect_offset += params[b.params[k]].numel;
    }
    EXPECT_EQ(b.numel, expect_offset);
  }
  for (int i = 0; i < 50; ++i) {
    EXPECT_EQ(seen.count(i), params[i].requires_grad ? 1u : 0u) << i;
    if (!params[i].requires_grad) {
      EXPECT_EQ(plan.bucket_of_param[i], -1);
    }
  }
}

TEST(BucketPlan, RejectsBadInput) {
  std::vector<ParamSpec> params = {f32(10)};
  EXPECT_THROW(plan_buckets(params, 0, 10), std::invalid_argument);
  EXPECT_THROW(plan_buckets(params, 10, -1), std::invalid_argument);
  params[0].numel = -1;
  EXPECT_THROW(plan_buckets(params, 10, 10), std::invalid_argument);
}

TEST(BucketPlan, EmptyModel) {
  BucketPlan plan = plan_buckets({}, 100, 100);
  EXPECT_TRUE(plan.buckets.empty());
  EXPECT_EQ(plan.describe(), "");
}
