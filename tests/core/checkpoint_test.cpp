// Checkpoints: exact round trips, resume across step modes, and loud failure on bad files.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <unistd.h>

#include <fstream>

#include "../error_of.h"
#include "../peak_memory.h"
#include "../scratch_dir.h"
#include "fusebox/core/checkpoint.h"
#include "fusebox/core/hyperparam_validation.h"
#include "fusebox/core/lr_scheduler.h"
#include "fusebox/core/memory_tracker.h"
#include "fusebox/core/plugin_registry.h"
#include "fusebox/core/step_mode.h"
#include "plugin_args.h"
#include "tiny_lm.h"

using namespace fusebox;
using fusebox::testing::error_of;
using fusebox::testing::file_bytes;
using fusebox::testing::is_mapped;
using fusebox::testing::peak_growth_kib;
using fusebox::testing::ScratchDir;
using fusebox::testing::TinyLm;
namespace fs = std::filesystem;

namespace {

std::shared_ptr<LoadedPlugin> plugin_named(const std::string& file) {
  static PluginRegistry reg(fusebox::testing::only({FUSEBOX_PLUGIN_DIR}));
  return reg.load_file(file);
}

std::vector<std::pair<std::string, at::Tensor>> named(const TinyLm& m) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (size_t i = 0; i < m.params.size(); ++i) out.emplace_back(m.names[i], m.params[i]);
  return out;
}

struct Mode {
  std::string kind;
  int64_t groups = 1;
};

std::unique_ptr<StepMode> make_mode(const LoadedPlugin& p, TinyLm& m, const Mode& mode) {
  HyperParams hp = p.validate(fusebox::testing::args_for(p));
  if (mode.kind == "normal") return make_normal_step(p.create(m.groups(), hp));
  if (mode.kind == "fused") return make_fused_backward(p.create(m.groups(), hp));
  return make_optimizer_groups(m.groups(), mode.groups, SplitPolicy::Size,
                               [&](std::vector<ParamGroup> g) { return p.create(g, hp); });
}

SchedulerOptions cosine(int64_t total) {
  SchedulerOptions so;
  so.type = "cosine";
  so.total_steps = total;
  return so;
}

// Trains steps [from, to) of a run whose mode is `mode`, starting from `ckpt` when given; returns
// a checkpoint taken at `to`.
Checkpoint train(const LoadedPlugin& p, const TinyLm& init, const Mode& mode, int from, int to,
                 const Checkpoint* resume) {
  TinyLm m = init.clone();
  auto step_mode = make_mode(p, m, mode);
  LrScheduler sched(step_mode->optimizers(), cosine(6));
  if (resume) {
    restore_parameters(resume->model, named(m));
    load_merged_optimizer_state(step_mode->optimizers(), resume->optimizer);
    sched.set_step_count(resume->counters.at("scheduler_steps"));
  }
  for (int s = from; s < to; ++s) {
    step_mode->backward(m.loss(s));
    step_mode->step();
    sched.step();
  }
  Checkpoint c;
  for (auto& [n, t] : named(m)) c.model[n] = t.detach().clone();
  c.optimizer = merged_optimizer_state(step_mode->optimizers());
  c.counters["scheduler_steps"] = sched.step_count();
  c.meta["plugin"] = p.info().name;
  return c;
}

void expect_same_model(const Checkpoint& a, const Checkpoint& b, const std::string& what) {
  ASSERT_EQ(a.model.size(), b.model.size());
  for (const auto& [n, t] : a.model) EXPECT_TRUE(at::equal(t, b.model.at(n))) << what << ": " << n;
}

}  // namespace

TEST(Checkpoint, RoundTripsEveryFieldExactly) {
  const ScratchDir scratch("ckpt-roundtrip");
  const fs::path& dir = scratch.path();
  Checkpoint c;
  c.model["a.weight"] = at::randn({3, 4}, at::kDouble);
  c.optimizer["a.weight/exp_avg"] = at::randn({3, 4});
  c.optimizer["@optimizer/d"] = at::scalar_tensor(1e-6, at::kDouble);
  c.meta["plugin"] = "adamw";
  c.counters["step"] = 42;
  c.rng = capture_rng_state();
  save_checkpoint(c, dir / checkpoint_name(42));
  Checkpoint r = load_checkpoint(dir / checkpoint_name(42));
  EXPECT_TRUE(at::equal(r.model.at("a.weight"), c.model.at("a.weight")));
  EXPECT_TRUE(at::equal(r.optimizer.at("a.weight/exp_avg"), c.optimizer.at("a.weight/exp_avg")));
  EXPECT_EQ(r.optimizer.at("@optimizer/d").item<double>(), 1e-6);
  EXPECT_EQ(r.meta.at("plugin"), "adamw");
  EXPECT_EQ(r.counters.at("step"), 42);
  // Restoring the RNG state replays the same random numbers.
  at::Tensor first = at::rand({4});
  restore_rng_state(r.rng);
  EXPECT_TRUE(at::equal(at::rand({4}), first));
  // No temporary file is left behind.
  for (const auto& e : fs::directory_iterator(dir))
    EXPECT_EQ(e.path().filename().string().rfind(".", 0), std::string::npos) << e.path();
}

// The format stays readable: a checkpoint fusebox 0.4.0's trainer wrote (adamw on a small mlp, one
// step) loads with its counters, metadata, weights and optimizer state. A change to the header or
// the checksum would make every checkpoint users hold read as corrupt.
TEST(Checkpoint, AFileWrittenByFusebox040StillLoads) {
  const Checkpoint ckpt = load_checkpoint(FUSEBOX_TEST_DATA "/checkpoint-fusebox-0.4.0.fbx");
  EXPECT_EQ(ckpt.counters.at("step"), 1);
  EXPECT_EQ(ckpt.meta.at("plugin"), "adamw");
  EXPECT_EQ(ckpt.meta.at("mode"), "normal");
  ASSERT_FALSE(ckpt.model.empty());
  ASSERT_FALSE(ckpt.optimizer.empty());
  for (const auto& [name, t] : ckpt.model) {
    EXPECT_EQ(t.scalar_type(), at::kFloat) << name;
    EXPECT_TRUE(at::isfinite(t).all().item<bool>()) << name;
  }
  EXPECT_EQ(ckpt.rng.count("data"), 1u);
}

TEST(Checkpoint, BadFilesGiveOneLineErrors) {
  const ScratchDir scratch("ckpt-bad");
  const fs::path& dir = scratch.path();
  Checkpoint c;
  c.model["w"] = at::randn({64});
  save_checkpoint(c, dir / "good.fbx");
  std::string bytes;
  {
    std::ifstream in(dir / "good.fbx", std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  std::ofstream(dir / "truncated.fbx", std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  std::string flipped = bytes;
  flipped[flipped.size() - 10] ^= 0x5a;
  std::ofstream(dir / "corrupt.fbx", std::ios::binary) << flipped;
  std::ofstream(dir / "foreign.fbx") << "hello, I am a text file\n";

  auto msg = [&](const std::string& f) { return error_of([&] { load_checkpoint(dir / f); }); };
  EXPECT_NE(msg("missing.fbx").find("does not exist"), std::string::npos);
  EXPECT_NE(msg("truncated.fbx").find("is truncated"), std::string::npos) << msg("truncated.fbx");
  EXPECT_NE(msg("corrupt.fbx").find("is corrupt (checksum mismatch)"), std::string::npos);
  EXPECT_NE(msg("foreign.fbx").find("is not a fusebox checkpoint"), std::string::npos);
  for (const std::string f : {"truncated.fbx", "corrupt.fbx", "foreign.fbx"})
    EXPECT_EQ(msg(f).find('\n'), std::string::npos) << "one line: " << msg(f);
}

TEST(Checkpoint, AFailedWriteLeavesTheOldFileAndNoTemporary) {
  const ScratchDir scratch("ckpt-failed-write");
  const fs::path& dir = scratch.path();
  Checkpoint c;
  c.model["w"] = at::ones({4});
  save_checkpoint(c, dir / "ckpt.fbx");
  // A folder in the way of the rename makes the write fail after the temporary was written.
  fs::create_directories(dir / "blocked.fbx" / "inner");
  std::string m = error_of([&] { save_checkpoint(c, dir / "blocked.fbx"); });
  EXPECT_NE(m.find("cannot write"), std::string::npos) << m;
  EXPECT_TRUE(at::equal(load_checkpoint(dir / "ckpt.fbx").model.at("w"), at::ones({4})));
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(dir)) files += e.is_regular_file();
  EXPECT_EQ(files, 1u);
  m = error_of([&] { save_checkpoint(c, dir / "no" / "such" / "dir" / "x.fbx"); });
  EXPECT_NE(m.find("cannot write"), std::string::npos) << m;
}

// A file size limit (as a full disk would) stops an append part-way: the file is cut back to
// what it held, so it never ends in half a record.
TEST(Checkpoint, AFailedAppendLeavesTheFileAsItWas) {
  const ScratchDir scratch("ckpt-failed-append");
  const fs::path& dir = scratch.path();
  const fs::path file = dir / "log.txt";
  append_to_file(file, "first line\n");
  append_to_file(file, "second line\n");
  auto text = [&] {
    std::ifstream in(file, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  };
  ASSERT_EQ(text(), "first line\nsecond line\n");

  struct rlimit old {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  struct rlimit small = old;
  small.rlim_cur = 64;  // room for part of the next append
  auto* previous = ::signal(SIGXFSZ, SIG_IGN);
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const std::string m = error_of([&] { append_to_file(file, std::string(100, 'x') + "\n"); });
  ::setrlimit(RLIMIT_FSIZE, &old);
  ::signal(SIGXFSZ, previous);
  EXPECT_NE(m.find("cannot write " + file.string()), std::string::npos) << m;
  EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  EXPECT_EQ(text(), "first line\nsecond line\n");
  append_to_file(file, "third line\n");  // and it goes on from there
  EXPECT_EQ(text(), "first line\nsecond line\nthird line\n");
}

TEST(Checkpoint, ResumeEqualsAnUninterruptedRunAcrossModesAndGroupings) {
  auto sgd = plugin_named("sgd.so");
  TinyLm init;
  const ScratchDir scratch("ckpt-resume");
  const fs::path& dir = scratch.path();
  const std::vector<Mode> modes{{"normal"}, {"fused"}, {"groups", 3}, {"groups", 2}};
  for (const Mode& before : modes) {
    Checkpoint straight = train(*sgd, init, before, 0, 6, nullptr);
    Checkpoint half = train(*sgd, init, before, 0, 3, nullptr);
    save_checkpoint(half, dir / "half.fbx");
    Checkpoint loaded = load_checkpoint(dir / "half.fbx");
    for (const Mode& after : modes) {
      Checkpoint resumed = train(*sgd, init, after, 3, 6, &loaded);
      expect_same_model(straight, resumed,
                        before.kind + std::to_string(before.groups) + " -> " + after.kind +
                            std::to_string(after.groups));
    }
  }
}

TEST(Checkpoint, StatefulPluginsResumeExactly) {
  // Every shipped plugin with optimizer state: per-parameter ones across modes, auto-LR ones
  // in normal mode.
  PluginRegistry reg(fusebox::testing::only({FUSEBOX_PLUGIN_DIR}));
  TinyLm init;
  for (const auto& p : reg.list()) {
    SCOPED_TRACE(p->info().name);
    Checkpoint straight = train(*p, init, {"normal"}, 0, 6, nullptr);
    Checkpoint half = train(*p, init, {"normal"}, 0, 3, nullptr);
    expect_same_model(straight, train(*p, init, {"normal"}, 3, 6, &half), "normal -> normal");
    if (p->has(kSupportsStepParam))
      expect_same_model(straight, train(*p, init, {"groups", 4}, 3, 6, &half), "normal -> groups");
  }
}

TEST(Checkpoint, ResumingAnotherModelIsRefused) {
  TinyLm m;
  std::map<std::string, at::Tensor> saved;
  for (auto& [n, t] : named(m)) saved[n] = t.detach().clone();
  saved["fc1.weight"] = at::zeros({2, 2}, at::kDouble);
  std::string msg = error_of([&] { restore_parameters(saved, named(m)); });
  EXPECT_NE(msg.find("'fc1.weight' has shape [2, 2]"), std::string::npos) << msg;
  StateDict state{{"other.weight/step", at::scalar_tensor(1.0, at::kDouble)}};
  auto sgd = plugin_named("sgd.so");
  auto opt = sgd->create(m.groups(), sgd->validate({}));
  msg = error_of([&] { load_merged_optimizer_state({opt}, state); });
  EXPECT_NE(msg.find("parameter 'other.weight'"), std::string::npos) << msg;
}

// Optimizer groups load one dict group by group: when a later group refuses it, the groups
// loaded before it get their own state back, so a failed resume changes no optimizer.
TEST(Checkpoint, AStateDictOneGroupRefusesChangesNoGroup) {
  TinyLm m;
  auto adamw = plugin_named("adamw.so");
  const ParamGroup all = m.groups()[0];
  std::vector<std::shared_ptr<Optimizer>> opts;
  for (size_t half = 0; half < 2; ++half) {
    ParamGroup g;
    for (size_t i = half; i < all.params.size(); i += 2) {
      g.params.push_back(all.params[i]);
      g.names.push_back(all.names[i]);
    }
    opts.push_back(adamw->create({g}, adamw->validate({})));
  }
  auto step_all = [&] {
    for (auto& p : m.params) p.mutable_grad() = at::ones_like(p);
    for (auto& o : opts) o->step();
  };
  step_all();
  StateDict earlier = merged_optimizer_state(opts);
  step_all();
  const StateDict now = merged_optimizer_state(opts);
  // A bad step count of a parameter of the second optimizer: the first one loads its part first.
  earlier[all.names[1] + "/step"] = at::scalar_tensor(-1.0, at::kDouble);
  const std::string msg = error_of([&] { load_merged_optimizer_state(opts, earlier); });
  EXPECT_NE(msg.find("optimizer state '" + all.names[1] + "/step' is -1"), std::string::npos)
      << msg;
  const StateDict after = merged_optimizer_state(opts);
  ASSERT_EQ(after.size(), now.size());
  for (const auto& [key, value] : now)
    EXPECT_TRUE(at::equal(after.at(key), value)) << key << " changed by a refused load";
}

// A float64 checkpoint into a float32 model (or back) would meet float64 optimizer state with
// float32 parameters at the first step; bf16 <-> float32 is a storage change a resume may make.
TEST(Checkpoint, ResumingAnotherFloatWidthIsRefusedButBFloat16IsNot) {
  TinyLm f64(at::kDouble), f32(at::kFloat), bf16(at::kBFloat16);
  auto saved_from = [](const TinyLm& m) {
    std::map<std::string, at::Tensor> out;
    for (size_t i = 0; i < m.params.size(); ++i) out[m.names[i]] = m.params[i].detach().clone();
    return out;
  };
  std::string msg = error_of([&] { restore_parameters(saved_from(f64), named(f32)); });
  EXPECT_NE(msg.find("is Double, this model's is Float: resume with --dtype float64"),
            std::string::npos)
      << msg;
  msg = error_of([&] { restore_parameters(saved_from(f32), named(f64)); });
  EXPECT_NE(msg.find("resume with --dtype float32"), std::string::npos) << msg;
  EXPECT_NO_THROW(restore_parameters(saved_from(bf16), named(f32)));
  EXPECT_NO_THROW(restore_parameters(saved_from(f32), named(bf16)));
}

TEST(Checkpoint, ModelWeightsUseTorchPickleFormat) {
  const ScratchDir scratch("ckpt-weights");
  const fs::path& dir = scratch.path();
  TinyLm m(at::kFloat);
  save_model_weights(named(m), dir / "model.pt");
  // torch.save's zip container: Python's torch.load reads it.
  std::ifstream in(dir / "model.pt", std::ios::binary);
  char magic[2];
  in.read(magic, 2);
  EXPECT_EQ(std::string(magic, 2), "PK");
  auto back = load_model_weights(dir / "model.pt");
  ASSERT_EQ(back.size(), m.params.size());
  for (size_t i = 0; i < m.params.size(); ++i)
    EXPECT_TRUE(at::equal(back.at(m.names[i]), m.params[i].detach()));
}

TEST(Checkpoint, KeepsOnlyTheNewestN) {
  const ScratchDir scratch("ckpt-prune");
  const fs::path& dir = scratch.path();
  Checkpoint c;
  c.model["w"] = at::ones({1});
  for (int64_t s : {10, 20, 30, 40}) save_checkpoint(c, dir / checkpoint_name(s));
  prune_checkpoints(dir, 2);
  auto left = list_checkpoints(dir);
  ASSERT_EQ(left.size(), 2u);
  EXPECT_EQ(left[0].filename(), checkpoint_name(30));
  EXPECT_EQ(left[1].filename(), checkpoint_name(40));
}

// Only fusebox's own temporaries of dead writers are removed; odd names never throw.
TEST(Checkpoint, RemovesOnlyItsOwnStaleTemporaries) {
  const ScratchDir scratch("ckpt-stale");
  const fs::path& dir = scratch.path();
  const std::string dead = "999999999";  // above any pid_max: no such process
  const std::string alive = std::to_string(::getpid());
  auto touch = [&](const std::string& name) { std::ofstream(dir / name) << "x"; };
  for (const std::string& n : std::vector<std::string>{
           ".checkpoint-00000004.fbx.tmp." + dead, ".metrics.jsonl.tmp." + dead,
           ".summary.json.tmp." + alive, "draft.md.tmp." + dead, ".notes.tmp." + dead,
           ".metrics.csv.tmp.99999999999999999999", "checkpoint-99999999999999999999.fbx",
           "checkpoint-00000007.fbx"})
    touch(n);
  EXPECT_NO_THROW(remove_stale_temporaries(dir));
  for (const std::string& n : std::vector<std::string>{".checkpoint-00000004.fbx.tmp." + dead,
                                                       ".metrics.jsonl.tmp." + dead})
    EXPECT_FALSE(fs::exists(dir / n)) << n;
  for (const std::string& n : std::vector<std::string>{
           ".summary.json.tmp." + alive, "draft.md.tmp." + dead, ".notes.tmp." + dead,
           ".metrics.csv.tmp.99999999999999999999", "checkpoint-99999999999999999999.fbx"})
    EXPECT_TRUE(fs::exists(dir / n)) << n;
  auto listed = list_checkpoints(dir);
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].filename(), "checkpoint-00000007.fbx");
  EXPECT_EQ(checkpoint_step("checkpoint-00000120.fbx"), 120);
  EXPECT_FALSE(checkpoint_step("checkpoint-1.fbx.bak").has_value());
  EXPECT_NO_THROW(prune_checkpoints(dir, 1));
}

// A writer in another PID namespace has a pid that is dead here: the lock it holds on its
// temporary (as write_file_atomically does while it writes) keeps the file.
TEST(Checkpoint, ALockedTemporaryOfAnUnknownPidIsKept) {
  const ScratchDir scratch("ckpt-locked");
  const fs::path& dir = scratch.path();
  const fs::path tmp = dir / ".checkpoint-00000004.fbx.tmp.999999999";
  std::ofstream(tmp) << "x";
  const int fd = ::open(tmp.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX), 0);
  remove_stale_temporaries(dir);
  EXPECT_TRUE(fs::exists(tmp)) << "a locked temporary was removed";
  ::close(fd);  // the writer is gone
  remove_stale_temporaries(dir);
  EXPECT_FALSE(fs::exists(tmp));
}

// "latest" follows the pointer written after each save (it survives copies that reset
// modification times), and is the highest step in a folder without one.
TEST(Checkpoint, LatestFollowsThePointerElseTheHighestStep) {
  const ScratchDir scratch("ckpt-latest");
  const fs::path& dir = scratch.path();
  EXPECT_FALSE(latest_checkpoint(dir).has_value());
  Checkpoint c;
  c.model["w"] = at::ones({1});
  for (int64_t s : {10, 4, 20}) save_checkpoint(c, dir / checkpoint_name(s));
  EXPECT_EQ(latest_checkpoint(dir)->filename(), checkpoint_name(20));
  mark_latest_checkpoint(dir / checkpoint_name(4));
  EXPECT_EQ(latest_checkpoint(dir)->filename(), checkpoint_name(4));
  fs::remove(dir / checkpoint_name(4));  // a pointer to a missing file is ignored
  EXPECT_EQ(latest_checkpoint(dir)->filename(), checkpoint_name(20));
  std::ofstream(dir / "latest-checkpoint") << "../elsewhere/checkpoint-00000010.fbx\n";
  EXPECT_EQ(latest_checkpoint(dir)->filename(), checkpoint_name(20));
}

namespace {
// Keeps a state tensor under the key "step", as a port of torch.optim code would.
class StepKeyOptimizer final : public fusebox::Optimizer {
 public:
  using Optimizer::Optimizer;

 protected:
  void update_param(const at::Tensor& param, fusebox::ParamState& state, size_t g) override {
    ++state.step;
    state.tensors["step"] = at::full({}, static_cast<double>(state.step));
    param.add_(param.grad(), -lr(g));
  }
};
}  // namespace

// "<param>/step" holds the step count: a state tensor of that key would be lost in a save, so it
// is refused at the first step, with the parameter and the key named.
TEST(Checkpoint, AStateTensorNamedStepIsRefusedAtTheFirstStep) {
  at::Tensor w = at::ones({3}).requires_grad_(true);
  fusebox::ParamGroup g;
  g.params = {w};
  g.names = {"w"};
  fusebox::Schema schema;
  schema.real("lr", 0.1, "learning rate");
  StepKeyOptimizer opt({g}, fusebox::validate_hyperparams(schema, "stepkey", {}));
  (w * w).sum().backward();
  const std::string m = error_of([&] { opt.step(); });
  EXPECT_NE(m.find("optimizer state of parameter 'w': the tensor key 'step' is reserved"),
            std::string::npos)
      << m;
}

// Saving streams the checkpoint into its file: the process's peak memory does not grow by the
// checkpoint's size (an encoded copy of it), and the file loads back exactly.
// Loading maps the file and its tensors view it (format version 2 aligns their data): no tensor
// memory is allocated for them, a write in place stays in this process, and the file is unmapped
// with the last tensor. The file written by fusebox 0.4.0 (version 1) is still read, copied.
TEST(Checkpoint, LoadingAllocatesNoMemoryForItsTensors) {
  const ScratchDir scratch("ckpt-map");
  Checkpoint c;
  c.model["w"] = at::rand({1024, 1024});                                // 4 MiB
  c.model["b"] = at::rand({3});                                         // unaligned sizes between
  c.optimizer["w/exp_avg"] = at::rand({1024, 1024}).to(at::kBFloat16);  // 2 MiB
  c.optimizer["w/step"] = at::tensor(3.0, at::kDouble);
  c.buffers["empty"] = at::empty({0, 4});
  c.meta["odd"] = "x";  // odd lengths before the next tensors
  const fs::path file = scratch.path() / checkpoint_name(1);
  save_checkpoint(c, file);

  memory::install_cpu_tracking();
  const int64_t base = memory::current_bytes();
  memory::reset_peak();
  Checkpoint back = load_checkpoint(file);
  EXPECT_LT(memory::peak_bytes() - base, 64 * 1024);  // copied, it would be 6 MiB
  for (const auto& [name, t] : c.model) EXPECT_TRUE(at::equal(back.model.at(name), t)) << name;
  for (const auto& [name, t] : c.optimizer)
    EXPECT_TRUE(at::equal(back.optimizer.at(name), t)) << name;
  EXPECT_EQ(back.buffers.at("empty").sizes(), (std::vector<int64_t>{0, 4}));
  EXPECT_TRUE(is_mapped(file));
  back.model.at("w").fill_(7.0);  // copy-on-write: the file keeps its values
  EXPECT_TRUE(at::equal(load_checkpoint(file).model.at("w"), c.model.at("w")));
  back = Checkpoint();
  EXPECT_FALSE(is_mapped(file));

  // Version 1 (fusebox 0.6 and earlier): unaligned tensors, copied out.
  const fs::path old = FUSEBOX_TEST_DATA "/checkpoint-fusebox-0.4.0.fbx";
  const Checkpoint v1 = load_checkpoint(old);
  EXPECT_FALSE(v1.model.empty());
  EXPECT_FALSE(is_mapped(old));
}

TEST(Checkpoint, SavingHoldsNoCopyOfTheCheckpoint) {
  const ScratchDir scratch("ckpt-stream");
  Checkpoint c;
  c.model["w"] = at::rand({16, 1024, 1024});              // 64 MiB
  c.optimizer["w/exp_avg"] = at::rand({16, 1024, 1024});  // 64 MiB
  c.meta["note"] = "streamed";
  c.counters["step"] = 7;
  const fs::path file = scratch.path() / checkpoint_name(7);
  const std::optional<long long> grew = peak_growth_kib([&] { save_checkpoint(c, file); });
  EXPECT_LT(grew.value_or(0), 16 * 1024) << "KiB";  // an encoded copy would be 128 MiB
  const Checkpoint back = load_checkpoint(file);
  EXPECT_TRUE(at::equal(back.model.at("w"), c.model.at("w")));
  EXPECT_TRUE(at::equal(back.optimizer.at("w/exp_avg"), c.optimizer.at("w/exp_avg")));
  EXPECT_EQ(back.meta.at("note"), "streamed");
  EXPECT_EQ(back.counters.at("step"), 7);
  // encode_checkpoint() gives the bytes save_checkpoint() wrote.
  EXPECT_TRUE(file_bytes(file) == encode_checkpoint(c));
}
