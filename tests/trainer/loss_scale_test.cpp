// Loss scaling in the trainer: a fixed power-of-two scale trains exactly as no scaling, a dynamic
// scale skips overflowed steps and is carried across a resume, gradients that are not finite at
// any scale end the run.
#include <gtest/gtest.h>
#include <torch/script.h>

#include <cmath>
#include <string>
#include <vector>

#include "fusebox/core/checkpoint.h"
#include "trainer_test_util.h"

using namespace fusebox::trainer::testing;

namespace {

// The "loss_scale" of every line of a metrics.jsonl file.
std::vector<double> loss_scales(const std::string& jsonl_path) {
  std::vector<double> out;
  std::istringstream in(read_text(jsonl_path));
  std::string line;
  while (std::getline(in, line)) {
    const size_t p = line.find("\"loss_scale\":");
    if (p != std::string::npos) out.push_back(std::stod(line.substr(p + 13)));
  }
  return out;
}

}  // namespace

TEST(TrainerLossScale, AFixedPowerOfTwoScaleTrainsExactlyAsNoScaling) {
  for (const std::string mode : {"", "--fused-backward-pass"}) {
    SCOPED_TRACE(mode.empty() ? "normal" : mode);
    TempDir tmp;
    const std::string args =
        "--optimizer adamw --learning-rate 0.01 --max-train-steps 8 "
        "--threads 1 --log-every 100 " +
        mode;
    auto plain = run_program(args + " --output-dir " + tmp.file("plain"), tmp.str());
    ASSERT_EQ(plain.code, 0) << plain.err;
    auto scaled = run_program(
        args + " --loss-scale fixed --loss-scale-value 1024 --output-dir " + tmp.file("scaled"),
        tmp.str());
    ASSERT_EQ(scaled.code, 0) << scaled.err;
    const std::vector<double> a = losses(tmp.file("plain/metrics.jsonl")),
                              b = losses(tmp.file("scaled/metrics.jsonl"));
    ASSERT_EQ(a.size(), 8u);
    EXPECT_EQ(a, b);
    EXPECT_EQ(loss_scales(tmp.file("scaled/metrics.jsonl")), std::vector<double>(8, 1024));
    EXPECT_TRUE(loss_scales(tmp.file("plain/metrics.jsonl")).empty());
    EXPECT_NE(read_text(tmp.file("scaled/metrics.csv")).find(",peak_phase,loss_scale\n"),
              std::string::npos);
  }
}

// Starting at 2^126 and doubling after every 5 good steps, the scale reaches 2^127, the largest
// power of two a float holds, and the gradients overflow now and then: those steps are skipped
// and the scale halves; it stays a power of two. A run resumed from step 10 goes on with the scale
// it had there, so it ends exactly as the whole run.
TEST(TrainerLossScale, ADynamicScaleSkipsOverflowedStepsAndIsCarriedAcrossAResume) {
  TempDir tmp;
  const std::string args =
      "--optimizer sgd --learning-rate 0.02 --max-train-steps 30 --threads 1 --log-every 100 "
      "--loss-scale dynamic --loss-scale-value 8.507059173023462e37 --loss-scale-growth-interval 5 "
      "--save-every-n-steps 10 ";
  auto whole = run_program(args + "--output-dir " + tmp.file("whole"), tmp.str());
  ASSERT_EQ(whole.code, 0) << whole.err;
  const std::vector<double> scale = loss_scales(tmp.file("whole/metrics.jsonl"));
  ASSERT_EQ(scale.size(), 30u);
  int overflows = 0;
  for (size_t i = 0; i + 1 < scale.size(); ++i) overflows += scale[i + 1] < scale[i];
  ASSERT_GT(overflows, 0) << "no overflow: the test shows nothing";
  EXPECT_EQ(count_lines(whole.err), overflows) << whole.err;
  EXPECT_NE(whole.err.find(": gradients overflowed at loss scale "), std::string::npos);
  EXPECT_NE(read_text(tmp.file("whole/summary.json"))
                .find("\"overflow_steps\":" + std::to_string(overflows)),
            std::string::npos);
  EXPECT_NE(whole.out.find("skipped on gradient overflow"), std::string::npos) << whole.out;
  ASSERT_NE(scale[10], scale[0]) << "the scale at the resume point must differ from the start";
  for (double v : scale) EXPECT_TRUE(v == std::ldexp(1.0, 126) || v == std::ldexp(1.0, 127)) << v;

  auto resumed = run_program(args + "--output-dir " + tmp.file("resumed") + " --resume " +
                                 tmp.file("whole/" + fusebox::checkpoint_name(10)),
                             tmp.str());
  ASSERT_EQ(resumed.code, 0) << resumed.err;
  std::vector<double> a = losses(tmp.file("whole/metrics.jsonl")),
                      b = losses(tmp.file("resumed/metrics.jsonl"));
  ASSERT_EQ(b.size(), 30u);  // steps 1..10 from the checkpoint's folder, then its own
  EXPECT_EQ(a, b);
  EXPECT_EQ(scale, loss_scales(tmp.file("resumed/metrics.jsonl")));
}

// A resumed dynamic scale continues from the checkpoint only when this run asks for the same
// start as the checkpoint's: a new --loss-scale-value (to reset a scale that overflows drove
// down) or a checkpoint of a fixed-scale run starts at the configured value, with a warning.
TEST(TrainerLossScale, AResumedDynamicScaleStartsAnewWhenItsStartValueChanged) {
  TempDir tmp;
  const std::string args =
      "--optimizer sgd --learning-rate 0.02 --max-train-steps 12 --threads 1 --log-every 100 "
      "--save-every-n-steps 6 ";
  auto dyn = run_program(
      args + "--loss-scale dynamic --loss-scale-value 4096 --output-dir " + tmp.file("dyn"),
      tmp.str());
  ASSERT_EQ(dyn.code, 0) << dyn.err;
  const std::string ckpt6 = tmp.file("dyn/" + fusebox::checkpoint_name(6));

  auto same = run_program(args + "--loss-scale dynamic --loss-scale-value 4096 --output-dir " +
                              tmp.file("same") + " --resume " + ckpt6,
                          tmp.str());
  ASSERT_EQ(same.code, 0) << same.err;
  EXPECT_EQ(same.err.find("warning"), std::string::npos) << same.err;
  EXPECT_EQ(loss_scales(tmp.file("same/metrics.jsonl")),
            loss_scales(tmp.file("dyn/metrics.jsonl")));

  auto changed = run_program(args + "--loss-scale dynamic --loss-scale-value 1024 --output-dir " +
                                 tmp.file("changed") + " --resume " + ckpt6,
                             tmp.str());
  ASSERT_EQ(changed.code, 0) << changed.err;
  EXPECT_NE(changed.err.find("trainer: warning: --resume: --loss-scale-value 1024 differs from "
                             "the checkpoint's run: the dynamic scale starts at it, not at the "
                             "checkpoint's 4096"),
            std::string::npos)
      << changed.err;
  std::vector<double> scales = loss_scales(tmp.file("changed/metrics.jsonl"));
  ASSERT_EQ(scales.size(), 12u);
  EXPECT_EQ(scales[5], 4096);  // step 6, from the checkpoint's history
  EXPECT_EQ(scales[6], 1024);  // step 7, this run's first

  auto fixed = run_program(
      args + "--loss-scale fixed --loss-scale-value 8 --output-dir " + tmp.file("fixed"),
      tmp.str());
  ASSERT_EQ(fixed.code, 0) << fixed.err;
  auto from_fixed =
      run_program(args + "--loss-scale dynamic --output-dir " + tmp.file("from_fixed") +
                      " --resume " + tmp.file("fixed/" + fusebox::checkpoint_name(6)),
                  tmp.str());
  ASSERT_EQ(from_fixed.code, 0) << from_fixed.err;
  EXPECT_NE(from_fixed.err.find("the checkpoint's run had a fixed loss scale (8): the dynamic "
                                "scale starts at --loss-scale-value 65536"),
            std::string::npos)
      << from_fixed.err;
  scales = loss_scales(tmp.file("from_fixed/metrics.jsonl"));
  ASSERT_EQ(scales.size(), 12u);
  EXPECT_EQ(scales[5], 8);
  EXPECT_EQ(scales[6], 65536);
}

// sqrt(|0 * w|) has a finite value and a NaN gradient: no scale helps, and lowering it forever
// would end in a scale of zero that hides the NaN. The run stops at the minimum scale.
TEST(TrainerLossScale, GradientsNotFiniteAtAnyScaleEndTheRun) {
  TempDir tmp;
  torch::jit::Module m("Net");
  m.register_parameter("w", torch::ones({8, 1}), false);
  m.define(R"(
def forward(self, x):
    return ((x.matmul(self.w) - x.sum(1, keepdim=True)) ** 2).mean() + (self.w * 0.0).abs().sqrt().sum()
)");
  const std::string script = tmp.file("nan_grad.pt");
  m.save(script);
  const std::string args = "--model-script " + script +
                           " --model-width 8 --threads 1 --optimizer sgd --max-train-steps 60 "
                           "--log-every 100 --output-dir " +
                           tmp.file("out");
  auto r = run_program(args + " --loss-scale dynamic", tmp.str());
  EXPECT_EQ(r.code, 3) << r.err;
  // 65536 halves 32 times to the minimum 2^-16; the 33rd overflow ends the run.
  EXPECT_EQ(count_lines(r.err), 33) << r.err;
  EXPECT_NE(r.err.find("trainer: error: training failed at step 33: the gradient of parameter "
                       "'w' is not finite at any loss scale"),
            std::string::npos)
      << r.err;
  r = run_program(args + " --loss-scale fixed", tmp.str());
  EXPECT_EQ(r.code, 3) << r.err;
  EXPECT_NE(r.err.find("training failed at step 1: non-finite gradient in parameter 'w'"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("(the loss was scaled by 65536"), std::string::npos) << r.err;
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
}
