// The conformance kit itself: a check fails for a plugin that breaks its promise.
#include <fusebox/testing/conformance.h>
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

// The kit's FollowsGroupLr check catches a plugin that takes hyperparameter lr in its constructor
// (and so ignores every lr schedule), and passes one that reads lr(group).
TEST(ConformanceKit, FollowsGroupLrCatchesAnLrCopiedInTheConstructor) {
  const fusebox::conformance::Target bad = fusebox::conformance::plugin(
      (std::filesystem::path(FUSEBOX_TEST_PLUGIN_DIR) / "tp_lr_in_ctor.so").string(), {});
  ::testing::TestPartResultArray failures;
  {
    ::testing::ScopedFakeTestPartResultReporter record(
        ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &failures);
    fusebox::conformance::check_follows_group_lr(bad);
  }
  ASSERT_GT(failures.size(), 0) << "the check passed a plugin that ignores the group's lr";
  for (int i = 0; i < failures.size(); ++i)
    EXPECT_NE(std::string(failures.GetTestPartResult(i).message())
                  .find("must read lr(group) at each step"),
              std::string::npos)
        << failures.GetTestPartResult(i).message();
  fusebox::conformance::check_follows_group_lr(fusebox::conformance::plugin(
      (std::filesystem::path(FUSEBOX_PLUGIN_DIR) / "sgd.so").string(), {"momentum=0.9"}));
}
