// --gradient-checkpointing: the built-in models compute the same loss and gradients with it as
// without, and keep less activation memory.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "model.h"
#include "trainer_test_util.h"

using fusebox::trainer::Batch;
using fusebox::trainer::make_builtin_model;
using fusebox::trainer::ModelOptions;

namespace {

Batch batch_for(const ModelOptions& o, int64_t size) {
  at::manual_seed(3);
  Batch b;
  if (o.kind == "mlp") {
    b.input = at::randn({size, o.width});
    b.target = at::randn({size, 1});
  } else if (o.kind == "transformer") {
    b.input = at::randint(o.vocab_size, {size, o.seq_len});
    b.target = at::randint(o.vocab_size, {size, o.seq_len});
  } else {
    b.input =
        at::rand({size, fusebox::trainer::kImageChannels, o.image_size, o.image_size}) * 2 - 1;
    b.noise = at::randn_like(b.input);
    b.timesteps = at::randint(fusebox::trainer::kDiffusionSteps, {size});
  }
  return b;
}

struct Grads {
  at::Tensor loss;
  std::vector<std::pair<std::string, at::Tensor>> grads;
};

Grads loss_and_grads(ModelOptions o, bool checkpointing, const Batch& b) {
  o.gradient_checkpointing = checkpointing;
  at::manual_seed(1);
  auto model = make_builtin_model(o);
  Grads g;
  g.loss = model->loss(b);
  g.loss.backward();
  for (auto& [name, p] : model->parameters()) g.grads.emplace_back(name, p.grad());
  return g;
}

}  // namespace

TEST(GradientCheckpointing, TheBuiltInModelsGiveTheSameLossAndGradients) {
  std::vector<ModelOptions> cases(3);
  cases[0].kind = "mlp", cases[0].depth = 3;
  cases[1].kind = "transformer", cases[1].width = 32, cases[1].depth = 2, cases[1].seq_len = 16;
  cases[2].kind = "denoiser", cases[2].width = 8, cases[2].depth = 2, cases[2].image_size = 8;
  for (const ModelOptions& o : cases) {
    SCOPED_TRACE(o.kind);
    const Batch b = batch_for(o, 4);
    const Grads plain = loss_and_grads(o, false, b), ckpt = loss_and_grads(o, true, b);
    EXPECT_TRUE(at::equal(plain.loss, ckpt.loss));
    ASSERT_EQ(plain.grads.size(), ckpt.grads.size());
    for (size_t i = 0; i < plain.grads.size(); ++i) {
      const auto& [name, g] = plain.grads[i];
      ASSERT_TRUE(g.defined()) << name;
      ASSERT_TRUE(ckpt.grads[i].second.defined()) << name;
      EXPECT_TRUE(at::equal(g, ckpt.grads[i].second))
          << name << " differs by " << (g - ckpt.grads[i].second).abs().max().item<double>();
    }
  }
}

// The trainer with --gradient-checkpointing: the same losses in every step mode, less memory.
TEST(GradientCheckpointing, TheTrainerGivesTheSameLossesWithLessMemory) {
  using namespace fusebox::trainer::testing;
  auto peak_of = [](const TempDir& dir) {
    const std::string s = read_text(dir.file("summary.json"));
    return std::stoll(s.substr(s.find("\"peak_bytes\":") + 13));
  };
  for (const std::string model : {"transformer", "denoiser"}) {
    const std::vector<std::string> common = {"--model",     model, "--max-train-steps", "3",
                                             "--log-every", "0",   "--threads",         "2"};
    for (const std::string mode : {"", "--fused-backward-pass", "--fused-optimizer-groups=3"}) {
      SCOPED_TRACE(model + " " + mode);
      TempDir plain, ckpt;
      std::vector<std::string> args = join(plugin_args("adamw.so"), common);
      if (!mode.empty()) args.push_back(mode);
      const Result a = run_trainer(join(args, {"--output-dir", plain.str()}));
      const Result b =
          run_trainer(join(args, {"--output-dir", ckpt.str(), "--gradient-checkpointing"}));
      ASSERT_EQ(a.code, 0) << a.err;
      ASSERT_EQ(b.code, 0) << b.err;
      EXPECT_EQ(losses(plain.file("metrics.jsonl")), losses(ckpt.file("metrics.jsonl")));
      EXPECT_NE(b.out.find(", blocks recomputed in backward; data: "), std::string::npos) << b.out;
      EXPECT_EQ(a.out.find("recomputed"), std::string::npos) << a.out;
      EXPECT_LT(peak_of(ckpt), peak_of(plain));
    }
  }
}
