// The trainer as a data-parallel job (--nproc-per-node): the real program, 2 ranks on 127.0.0.1,
// each run bounded by `timeout`.
#include <gtest/gtest.h>
#include <torch/script.h>

#include <chrono>
#include <cmath>

#include "fusebox/core/checkpoint.h"
#include "fusebox/core/distributed.h"
#include "fusebox/core/safetensors.h"
#include "trainer_test_util.h"

using namespace fusebox::trainer::testing;

namespace {

std::string common(const std::string& optimizer, int steps) {
  return "--plugin-dir " + std::string(FUSEBOX_PLUGIN_DIR) +
         " --model transformer --model-width 16 --model-depth 2 --seq-len 8"
         " --train-batch-size 4 --dtype float64 --threads 1 --optimizer " +
         optimizer + " --max-train-steps " + std::to_string(steps);
}

// Runs the trainer in `dir`/`name`; returns its result.
Result train(const TempDir& d, const std::string& name, const std::string& args) {
  const std::string out = d.file(name);
  std::filesystem::remove_all(out);
  return run_program(args + " --log-every 100 --output-dir " + out, d.str());
}

std::map<std::string, at::Tensor> weights(const TempDir& d, const std::string& name) {
  // The final checkpoint holds the trained parameters.
  return fusebox::load_checkpoint(fusebox::list_checkpoints(d.file(name)).back()).model;
}

double max_diff(const std::map<std::string, at::Tensor>& a,
                const std::map<std::string, at::Tensor>& b) {
  double m = 0;
  for (const auto& [k, t] : a) m = std::max(m, (t - b.at(k)).abs().max().item<double>());
  return m;
}

bool identical(const std::map<std::string, at::Tensor>& a,
               const std::map<std::string, at::Tensor>& b) {
  for (const auto& [k, t] : a)
    if (!at::equal(t, b.at(k))) return false;
  return a.size() == b.size();
}

TEST(TrainerDistributed, TwoRanksTrainLikeOneProcessInEveryMode) {
  if (!fusebox::distributed_available()) GTEST_SKIP() << "built without c10d";
  TempDir d;
  const std::string base = common("adamw", 6);
  Result one = train(d, "one", base);
  ASSERT_EQ(one.code, 0) << one.err;
  const auto ref = weights(d, "one");
  std::map<std::string, at::Tensor> first;
  for (const std::string mode :
       {"", "--fused-backward-pass --dist-bucket-mb 0.01", "--fused-optimizer-groups 3",
        "--shard-optimizer-state", "--fused-backward-pass --shard-optimizer-state",
        "--fused-backward-pass --dist-bucket-mb 0.01 --gradient-checkpointing"}) {
    Result two = train(d, "two", base + " --nproc-per-node 2 " + mode);
    ASSERT_EQ(two.code, 0) << mode << ": " << two.err;
    EXPECT_EQ(count_lines(two.out), count_lines(one.out)) << "only rank 0 prints: " << two.out;
    const auto w = weights(d, "two");
    // Two half-batch means averaged instead of one full-batch mean: float64 rounding only.
    EXPECT_LT(max_diff(w, ref), 1e-10) << mode;
    if (first.empty())
      first = w;
    else
      EXPECT_TRUE(identical(w, first)) << mode << " differs from 2-rank normal mode";
    // The logged loss is the global batch's.
    const auto l1 = losses(d.file("one") + "/metrics.jsonl"),
               l2 = losses(d.file("two") + "/metrics.jsonl");
    ASSERT_EQ(l1.size(), l2.size());
    for (size_t i = 0; i < l1.size(); ++i) EXPECT_NEAR(l1[i], l2[i], 1e-10) << mode;
  }
}

// A warning about the settings is printed once in a job, not by the launcher and every rank.
TEST(TrainerDistributed, ASettingsWarningIsPrintedOnce) {
  if (!fusebox::distributed_available()) GTEST_SKIP() << "built without c10d";
  TempDir d;
  const Result r = train(d, "warn",
                         common("sgd", 2) +
                             " --nproc-per-node 2 --lr-scheduler linear "
                             "--lr-warmup-steps 2 --mixed-precision fp16 --dtype float32");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(count_lines(r.err), 2) << r.err;
  EXPECT_NE(r.err.find("trainer: warning: --lr-warmup-steps 2 is not below --max-train-steps 2"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("trainer: warning: --mixed-precision fp16: fp16 autocast is CUDA only"),
            std::string::npos)
      << r.err;
}

TEST(TrainerDistributed, ThreeRanksWithShardedStateTrainLikeOneProcess) {
  if (!fusebox::distributed_available()) GTEST_SKIP() << "built without c10d";
  TempDir d;
  const std::string base = common("adamw", 4) + " --train-batch-size 6";
  Result one = train(d, "one", base);
  ASSERT_EQ(one.code, 0) << one.err;
  Result three =
      train(d, "three", base + " --nproc-per-node 3 --fused-backward-pass --shard-optimizer-state");
  ASSERT_EQ(three.code, 0) << three.err;
  EXPECT_LT(max_diff(weights(d, "three"), weights(d, "one")), 1e-10);
}

TEST(TrainerDistributed, ShardedCheckpointResumesWithAnotherWorldSize) {
  if (!fusebox::distributed_available()) GTEST_SKIP() << "built without c10d";
  TempDir d;
  const std::string base = common("adamw", 8) + " --save-every-n-steps 4";
  Result full = train(d, "full", base + " --nproc-per-node 2 --shard-optimizer-state");
  ASSERT_EQ(full.code, 0) << full.err;
  // The checkpoint holds every rank's share: one process can continue from it ...
  const std::string ckpt = d.file("full") + "/checkpoint-00000004.fbx";
  EXPECT_EQ(fusebox::load_checkpoint(ckpt).optimizer.size(),
            fusebox::load_checkpoint(d.file("full") + "/checkpoint-00000008.fbx").optimizer.size());
  Result one = train(d, "one", base + " --resume " + ckpt);
  ASSERT_EQ(one.code, 0) << one.err;
  EXPECT_LT(max_diff(weights(d, "one"), weights(d, "full")), 1e-10);
  // ... and so can two ranks in another mode, bit for bit like the uninterrupted job.
  Result two = train(d, "two",
                     base +
                         " --nproc-per-node 2 --shard-optimizer-state --fused-backward-pass "
                         "--resume " +
                         ckpt);
  ASSERT_EQ(two.code, 0) << two.err;
  EXPECT_TRUE(identical(weights(d, "two"), weights(d, "full")));
}

// A script model whose forward replaces a buffer with one computed from its rank's shard of the
// batch, and has a bool mask: the ranks use rank 0's buffers (broadcast before each forward), so
// a job resumed from a checkpoint (which holds rank 0's) continues bit for bit like the
// uninterrupted one.
TEST(TrainerDistributed, ScriptModelBuffersFollowRankZeroSoAResumeIsExact) {
  if (!fusebox::distributed_available()) GTEST_SKIP() << "built without c10d";
  TempDir d;
  torch::jit::Module m("Net");
  torch::manual_seed(0);
  m.register_parameter("w", torch::randn({8, 1}, torch::kFloat64), false);
  m.register_buffer("running", torch::zeros({8}, torch::kFloat64));
  m.register_buffer("mask", torch::ones({8}, torch::kBool));  // gloo has no bool type
  // The buffer is assigned a new tensor each forward, not updated in place.
  m.define(R"(
def forward(self, x):
    self.running = 0.5 * self.running + 0.5 * x.mean(0).detach()
    xm = torch.where(self.mask, x - self.running, torch.zeros_like(x))
    return ((xm.matmul(self.w) - x.sum(1, keepdim=True)) ** 2).mean()
)");
  const std::string script = d.file("net.pt");
  m.save(script);
  const std::string base = "--model-script " + script +
                           " --model-width 8 --dtype float64 --threads 1 --optimizer sgd "
                           "--learning-rate 0.01 --train-batch-size 4 --max-train-steps 6 "
                           "--nproc-per-node 2";
  Result whole = train(d, "whole", base + " --save-every-n-steps 3");
  ASSERT_EQ(whole.code, 0) << whole.err;
  Result resumed =
      train(d, "resumed", base + " --resume " + d.file("whole") + "/checkpoint-00000003.fbx");
  ASSERT_EQ(resumed.code, 0) << resumed.err;
  const auto a = fusebox::load_checkpoint(d.file("whole") + "/checkpoint-00000006.fbx");
  const auto b = fusebox::load_checkpoint(d.file("resumed") + "/checkpoint-00000006.fbx");
  EXPECT_TRUE(identical(a.model, b.model));
  EXPECT_TRUE(identical(a.buffers, b.buffers));
}

// --dataset tensors: with a script model taking them by name: each rank trains on its rows of
// every named tensor of the global batch, so two ranks train like one process over the whole
// batch (float64 rounding only), and a job resumed mid-epoch ends where the uninterrupted one
// does.
TEST(TrainerDistributed, TensorsDataShardEveryNamedArgumentAndResumeMidEpoch) {
  if (!fusebox::distributed_available()) GTEST_SKIP() << "built without c10d";
  TempDir d;
  torch::jit::Module m("Fit");
  m.register_parameter("w", torch::zeros({3, 1}, torch::kFloat64), false);
  m.register_buffer("rows", torch::zeros({1}, torch::kFloat64));  // rows seen (rank 0's is kept)
  m.define(R"(
def forward(self, y, x):
    assert x.size(0) == y.size(0)
    self.rows = self.rows + x.size(0)
    return ((x.matmul(self.w).squeeze(1) - y) ** 2).mean()
)");
  m.save(d.file("fit.pt"));
  torch::manual_seed(2);
  const at::Tensor x = torch::randn({13, 3}, torch::kFloat64);
  fusebox::save_safetensors(
      {{"x", x}, {"y", x.matmul(torch::tensor({1.0, -1.0, 2.0}, torch::kFloat64))}},
      d.file("xy.safetensors"));
  const std::string base = "--model-script " + d.file("fit.pt") +
                           " --dataset tensors:" + d.file("xy.safetensors") +
                           " --dtype float64 --threads 1 --optimizer adamw --learning-rate 0.05 "
                           "--train-batch-size 4 --max-train-steps 8";
  Result one = train(d, "one", base);
  ASSERT_EQ(one.code, 0) << one.err;
  Result two = train(d, "two", base + " --nproc-per-node 2 --save-every-n-steps 5");
  ASSERT_EQ(two.code, 0) << two.err;
  EXPECT_LT(max_diff(weights(d, "two"), weights(d, "one")), 1e-10);
  auto rows = [&](const std::string& name) {
    return fusebox::load_checkpoint(fusebox::list_checkpoints(d.file(name)).back())
        .buffers.at("rows")
        .item<double>();
  };
  EXPECT_EQ(rows("one"), 32.0);  // 8 steps of 4 rows
  EXPECT_EQ(rows("two"), 16.0);  // each rank its 2 rows of every batch
  Result resumed =
      train(d, "resumed",
            base + " --nproc-per-node 2 --resume " + d.file("two") + "/checkpoint-00000005.fbx");
  ASSERT_EQ(resumed.code, 0) << resumed.err;
  EXPECT_TRUE(identical(weights(d, "resumed"), weights(d, "two")));
}

// A script model whose rows choose the parameters they use: wa for rows with x0 > 0, wb (another
// shape) for rows with x1 > 1. A rank whose rows need neither leaves it out of its graph, so the
// ranks' gradients differ in which parameters they hold: over these 8 steps wa is used by both
// ranks or by one, wb by one rank only, and neither by any rank at step 2 after both were used at
// step 1 (AdamW would still move them if they were stepped); `unused` is never used. With the
// small buckets of the fused run wa and wb fall into different buckets. The loss is a mean over the
// rows: one process over the whole batch averages the rows' gradients, which is what the ranks'
// average (with zeros from a rank without a gradient) gives, and every rank must step what any
// rank had a gradient for. At each forward the model compares the weights it had at its previous
// forward with rank 0's (kept in a buffer, which the trainer broadcasts from rank 0 before every
// forward) and fails the run if they differ in any bit.
TEST(TrainerDistributed, ParametersUsedOnSomeRanksOnlyTrainLikeOneProcessInEveryMode) {
  if (!fusebox::distributed_available()) GTEST_SKIP() << "built without c10d";
  TempDir d;
  torch::jit::Module m("Net");
  torch::manual_seed(0);
  m.register_parameter("w0", torch::randn({8, 64}, torch::kFloat64) * 0.3, false);
  m.register_parameter("wa", torch::randn({64, 1}, torch::kFloat64) * 0.1, false);
  m.register_parameter("wb", torch::randn({64, 3}, torch::kFloat64) * 0.1, false);
  m.register_parameter("unused", torch::randn({8, 1}, torch::kFloat64) * 0.3, false);
  const int64_t n = 512 + 64 + 192 + 8;
  m.register_buffer("seen", torch::zeros({n}, torch::kFloat64));  // rank 0's weights
  m.register_attribute("mine", c10::TensorType::get(), torch::zeros({n}, torch::kFloat64));
  m.define(R"(
def forward(self, x):
    assert torch.equal(self.seen, self.mine), "this rank's weights differ from rank 0's"
    cur = torch.cat([self.w0.detach().flatten(), self.wa.detach().flatten(),
                     self.wb.detach().flatten(), self.unused.detach().flatten()])
    self.seen = cur
    self.mine = cur.clone()
    h = x.matmul(self.w0)
    t = x.sum(1, keepdim=True)
    loss = ((h.sum(1, keepdim=True) - t) ** 2).sum()
    a = x[:, 0] > 0.0
    if bool(a.any()):
        loss = loss + ((h[a].matmul(self.wa) - t[a]) ** 2).sum()
    b = x[:, 1] > 1.0
    if bool(b.any()):
        loss = loss + ((h[b].matmul(self.wb).sum(1, keepdim=True) - t[b]) ** 2).sum()
    return loss / x.size(0)
)");
  const std::string script = d.file("branchy.pt");
  m.save(script);
  const at::Tensor unused = m.attr("unused").toTensor();
  const std::string base = "--plugin-dir " + std::string(FUSEBOX_PLUGIN_DIR) + " --model-script " +
                           script +
                           " --model-width 8 --dtype float64 --threads 1 --optimizer adamw "
                           "--learning-rate 0.01 --train-batch-size 4 --max-train-steps 8";
  Result one = train(d, "one", base);
  ASSERT_EQ(one.code, 0) << one.err;
  const auto ref = weights(d, "one");
  EXPECT_TRUE(at::equal(ref.at("unused"), unused));
  EXPECT_GT((ref.at("wb") - m.attr("wb").toTensor()).abs().max().item<double>(), 1e-3);
  std::map<std::string, at::Tensor> first;
  for (const std::string mode :
       {"", "--fused-backward-pass --dist-bucket-mb 0.001", "--fused-optimizer-groups 3",
        "--fused-backward-pass --shard-optimizer-state"}) {
    SCOPED_TRACE(mode.empty() ? "normal" : mode);
    // Before, buckets of different sizes made Gloo abort (or same-sized ones mixed wa with wb).
    Result two = train(d, "two", base + " --nproc-per-node 2 " + mode);
    ASSERT_EQ(two.code, 0) << two.err;
    const auto w = weights(d, "two");
    EXPECT_LT(max_diff(w, ref), 1e-10);
    EXPECT_TRUE(at::equal(w.at("unused"), unused)) << "a parameter no rank used was stepped";
    if (mode.find("fused") != std::string::npos) {
      EXPECT_NE(two.err.find("parameter 'unused' received no gradient in this iteration on any "
                             "rank and was not updated"),
                std::string::npos)
          << two.err;
    }
    if (first.empty())
      first = w;
    else
      EXPECT_TRUE(identical(w, first)) << "differs from 2-rank normal mode";
  }
}

// A gradient that is NaN at step 3 (sqrt(|0 * w|) has a finite value and a NaN gradient): its
// average is NaN on every rank, so in every mode the job stops at that step with exit 3 at once
// rather than after --dist-timeout, the parameter named, and no checkpoint of step 3 is written.
// In normal mode every rank checks after all reductions and names it. In the hooked modes a rank
// may have launched the next bucket's all-reduce before it sees the NaN of an earlier one, while
// the first to see it stops launching: that rank then stops on the closed connection instead.
TEST(TrainerDistributed, ANonFiniteGradientStopsEveryRankAtTheSameStepInEveryMode) {
  if (!fusebox::distributed_available()) GTEST_SKIP() << "built without c10d";
  TempDir d;
  torch::jit::Module m("Net");
  torch::manual_seed(0);
  // Gradients arrive w2, w1, w0: with 1 KiB buckets w2's NaN is in the first bucket and w0's
  // bucket may be launched before it is seen.
  m.register_parameter("w0", torch::randn({8, 64}) * 0.3, false);
  m.register_parameter("w1", torch::randn({64, 64}) * 0.1, false);
  m.register_parameter("w2", torch::randn({64, 1}) * 0.1, false);
  m.register_buffer("calls", torch::zeros({1}));
  m.define(R"(
def forward(self, x):
    self.calls.add_(1.0)
    loss = ((x.matmul(self.w0).matmul(self.w1).matmul(self.w2) - x.sum(1, keepdim=True)) ** 2).mean()
    if int(self.calls.item()) == 3:
        loss = loss + (self.w2 * 0.0).abs().sqrt().sum()
    return loss
)");
  const std::string script = d.file("nan_grad_at_3.pt");
  m.save(script);
  const std::string base = "--model-script " + script +
                           " --model-width 8 --threads 1 --optimizer adamw --train-batch-size 4 "
                           "--max-train-steps 6 --save-every-n-steps 1 --dist-timeout 120 "
                           "--nproc-per-node 2 ";
  for (const std::string mode :
       {"", "--fused-backward-pass --dist-bucket-mb 0.001", "--fused-optimizer-groups 2"}) {
    SCOPED_TRACE(mode.empty() ? "normal" : mode);
    const auto start = std::chrono::steady_clock::now();
    Result r = train(d, "out", base + mode);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_EQ(r.code, 3) << r.err;
    EXPECT_LT(seconds, 60) << "a rank waited for the other instead of stopping";
    int named = 0;
    for (const std::string rank : {"rank 0", "rank 1"}) {
      const std::string line = "trainer: error: " + rank + ": training failed at step 3: ";
      const bool nan =
          r.err.find(line + "non-finite gradient in parameter 'w2'") != std::string::npos;
      named += nan;
      EXPECT_TRUE(nan || (!mode.empty() && r.err.find(line + "distributed") != std::string::npos &&
                          r.err.find("another rank probably exited") != std::string::npos))
          << r.err;
    }
    EXPECT_GE(named, mode.empty() ? 2 : 1) << r.err;
    EXPECT_TRUE(std::filesystem::exists(d.file("out/" + fusebox::checkpoint_name(2))));
    EXPECT_FALSE(std::filesystem::exists(d.file("out/" + fusebox::checkpoint_name(3))));
  }
}

// Settings the launcher can judge are refused once, before any rank starts.
TEST(TrainerDistributed, BadSettingsAreOneLineErrorsBeforeAnyRankStarts) {
  if (!fusebox::distributed_available()) GTEST_SKIP() << "built without c10d";
  TempDir d;
  Result r = run_program(common("adamw", 2) +
                             " --output-dir \"\" --train-batch-size 5 "
                             "--nproc-per-node 2",
                         d.str());
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(
      r.err.rfind("trainer: error: --train-batch-size 5 cannot be split evenly over 2 ranks", 0),
      0u)
      << r.err;
  EXPECT_EQ(count_lines(r.err), 1) << "one line, from the launcher: " << r.err;
  r = run_program(common("prodigy", 2) +
                      " --output-dir \"\" --shard-optimizer-state "
                      "--nproc-per-node 2",
                  d.str());
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--shard-optimizer-state cannot be used with prodigy"), std::string::npos)
      << r.err;
  r = run_program(common("adamw", 2) + " --output-dir \"\" --nproc-per-node 0", d.str());
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--nproc-per-node"), std::string::npos) << r.err;
  // The job's shape is set once: a [[runs]] table's own would be ignored.
  const std::string runs = d.write("runs.toml",
                                   "[[runs]]\nname = \"dp\"\nnproc_per_node = 2\n"
                                   "[[runs]]\nname = \"one\"\n");
  r = run_program(common("adamw", 2) + " --output-dir \"\" --config " + runs, d.str());
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("runs.toml:3:18: nproc_per_node: set for the whole job"), std::string::npos)
      << r.err;
  // WORLD_SIZE=1 left in the environment (a scheduler's) would make this one rank of one.
  ::setenv("WORLD_SIZE", "1", 1);
  r = run_program(common("adamw", 2) + " --output-dir \"\" --nproc-per-node 2", d.str());
  ::unsetenv("WORLD_SIZE");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--nproc-per-node 2: WORLD_SIZE=1 is set in the environment"),
            std::string::npos)
      << r.err;
}

}  // namespace

namespace {

// Two ranks started by hand (the multi-machine way); rank 1 is killed once training runs.
TEST(TrainerDistributed, ARankKilledMidRunStopsTheOtherWithOneLine) {
  if (!fusebox::distributed_available()) GTEST_SKIP() << "built without c10d";
  TempDir d;
  const std::string trainer = std::string(FUSEBOX_BIN_DIR) + "/trainer";
  const std::string args = common("adamw", 1000000) + " --output-dir out --log-every 1";
  // $1: the trainer command line. Rank 1 runs without a time limit only until it is killed.
  const std::string script = d.write("kill.sh", R"sh(cd "$(dirname "$0")"
export WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$((20000 + $$ % 20000))
RANK=1 $1 >r1.out 2>r1.err & p1=$!
RANK=0 timeout -k 5 120 $1 >r0.out 2>r0.err & p0=$!
for i in $(seq 600); do grep -q "step 3/" r0.out 2>/dev/null && break; sleep 0.1; done
kill -9 $p1
start=$(date +%s)
wait $p0
echo $? >code0
echo $(( $(date +%s) - start )) >seconds
kill -9 $p0 2>/dev/null
true
)sh");
  ASSERT_EQ(std::system(("bash " + script + " '" + trainer + " " + args + "'").c_str()), 0);
  EXPECT_EQ(read_text(d.file("code0")), "3\n") << read_text(d.file("r0.err"));
  EXPECT_LT(std::stoi(read_text(d.file("seconds"))), 60);
  const std::string err = read_text(d.file("r0.err"));
  EXPECT_EQ(count_lines(err), 1) << err;
  EXPECT_NE(err.find("trainer: error: rank 0: training failed at step"), std::string::npos) << err;
  EXPECT_NE(err.find("another rank probably exited or hung"), std::string::npos) << err;
}

}  // namespace

namespace {

// bf16 parameters (--full-bf16) travel in the start-up broadcast, and with ZeRO-1 in the owners'
// broadcasts, though Gloo has no bfloat16 type: every mode trains, and the ranks end alike.
TEST(TrainerDistributed, FullBf16TrainsInEveryMode) {
  if (!fusebox::distributed_available()) GTEST_SKIP() << "built without c10d";
  TempDir d;
  const std::string base =
      "--plugin-dir " + std::string(FUSEBOX_PLUGIN_DIR) +
      " --model transformer --model-width 16 --model-depth 2 --seq-len 8 --train-batch-size 4 "
      "--threads 1 --optimizer adamw --max-train-steps 3 --full-bf16 --nproc-per-node 2 ";
  for (const std::string mode :
       {"", "--fused-backward-pass", "--fused-optimizer-groups 2", "--shard-optimizer-state"}) {
    SCOPED_TRACE(mode.empty() ? "normal" : mode);
    Result r = train(d, "bf16", base + mode);
    ASSERT_EQ(r.code, 0) << r.err;
    for (const auto& [name, t] : weights(d, "bf16"))
      EXPECT_EQ(t.scalar_type(), at::kBFloat16) << name;
  }
}

// Ranks started by hand with different settings are refused at once, naming the difference,
// instead of training different things or stopping in a collective of another size.
TEST(TrainerDistributed, RanksStartedWithDifferentSettingsAreRefused) {
  if (!fusebox::distributed_available()) GTEST_SKIP() << "built without c10d";
  TempDir d;
  const std::string trainer = std::string(FUSEBOX_BIN_DIR) + "/trainer";
  const std::string args = common("adamw", 3) + " --output-dir out --dist-timeout 60";
  const std::string script =
      d.write("two.sh",
              "cd \"$(dirname \"$0\")\"\n"
              "export WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$((20000 + $$ % 20000))\n"
              "RANK=1 timeout -k 5 120 " +
                  trainer + " " + args +
                  " --learning-rate 0.002 >r1.out 2>r1.err & p1=$!\n"
                  "RANK=0 timeout -k 5 120 " +
                  trainer + " " + args +
                  " --learning-rate 0.001 >r0.out 2>r0.err\n"
                  "echo $? >code0\nwait $p1\necho $? >code1\n");
  ASSERT_EQ(std::system(("bash " + script).c_str()), 0);
  for (int r = 0; r < 2; ++r) {
    const std::string err = read_text(d.file("r" + std::to_string(r) + ".err"));
    EXPECT_EQ(read_text(d.file("code" + std::to_string(r))), "2\n") << err;
    EXPECT_NE(err.find("rank 1 was started with other settings than rank 0 (learning_rate = "
                       "0.002 against learning_rate = 0.001)"),
              std::string::npos)
        << err;
    EXPECT_EQ(count_lines(err), 1) << err;
  }
}

}  // namespace

// Parameter groups, frozen parameters and the parameter average in a data-parallel job: the
// ranks train and average like one process (float64 rounding only), the frozen parameters stay
// where they started, and every mode of the job averages into the same bits.
TEST(TrainerDistributed, GroupsFrozenParametersAndTheAverageTrainLikeOneProcess) {
  if (!fusebox::distributed_available()) GTEST_SKIP() << "built without c10d";
  TempDir d;
  const std::string base = common("adamw", 4) +
                           " --freeze 'tok.*' --no-weight-decay '*.bias' '*ln*' pos --lr-scale "
                           "'blocks.0.*=0.5' --ema-decay 0.8";
  Result one = train(d, "one", base);
  ASSERT_EQ(one.code, 0) << one.err;
  const fusebox::Checkpoint ref =
      fusebox::load_checkpoint(fusebox::list_checkpoints(d.file("one")).back());
  Result still = train(d, "still", common("adamw", 1) + " --lr-scale '*=0'");
  ASSERT_EQ(still.code, 0) << still.err;
  const auto start = weights(d, "still");
  std::map<std::string, at::Tensor> first;
  for (const std::string mode :
       {"", "--fused-backward-pass", "--fused-optimizer-groups 2", "--shard-optimizer-state"}) {
    Result two = train(d, "two", base + " --nproc-per-node 2 " + mode);
    ASSERT_EQ(two.code, 0) << mode << ": " << two.err;
    const fusebox::Checkpoint c =
        fusebox::load_checkpoint(fusebox::list_checkpoints(d.file("two")).back());
    EXPECT_LT(max_diff(c.model, ref.model), 1e-10) << mode;
    EXPECT_LT(max_diff(c.ema, ref.ema), 1e-10) << mode;
    EXPECT_TRUE(at::equal(c.model.at("tok.weight"), start.at("tok.weight"))) << mode;
    EXPECT_EQ(c.ema.count("tok.weight"), 0u) << "a frozen parameter is not averaged";
    if (first.empty())
      first = c.ema;
    else
      EXPECT_TRUE(identical(c.ema, first)) << mode << " averaged otherwise than normal mode";
  }
}
