// AutocastGuard and AutocastOffGuard on the CPU: what a matrix product computes in, and the state
// each guard leaves behind.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "fusebox/core/autocast.h"

namespace {

at::ScalarType product_dtype() {
  const at::Tensor a = at::ones({2, 2});
  return at::mm(a, a).scalar_type();
}

TEST(Autocast, AnOffGuardRunsItsScopeInTheInputsDtypeAndRestoresAutocast) {
  ASSERT_FALSE(fusebox::active_autocast_dtype(c10::kCPU).has_value());
  EXPECT_EQ(product_dtype(), at::kFloat);
  {
    fusebox::AutocastGuard on(true, c10::kCPU, at::kBFloat16);
    EXPECT_EQ(fusebox::active_autocast_dtype(c10::kCPU), at::kBFloat16);
    EXPECT_EQ(product_dtype(), at::kBFloat16);
    {
      fusebox::AutocastOffGuard off(c10::kCPU);
      EXPECT_FALSE(fusebox::active_autocast_dtype(c10::kCPU).has_value());
      EXPECT_EQ(product_dtype(), at::kFloat);
    }
    EXPECT_EQ(fusebox::active_autocast_dtype(c10::kCPU), at::kBFloat16);
    EXPECT_EQ(product_dtype(), at::kBFloat16);
  }
  EXPECT_FALSE(fusebox::active_autocast_dtype(c10::kCPU).has_value());
  {
    fusebox::AutocastOffGuard off(c10::kCPU);  // without autocast: nothing changes
    EXPECT_EQ(product_dtype(), at::kFloat);
  }
  EXPECT_FALSE(fusebox::active_autocast_dtype(c10::kCPU).has_value());
}

}  // namespace
