// Loader and registry: every failure mode gives one line naming the file and the cause.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fstream>

#include "../error_of.h"
#include "../scratch_dir.h"
#include "fusebox/core/plugin_registry.h"
#include "fusebox/core/step_mode.h"
#include "plugin_args.h"

namespace fs = std::filesystem;
using fusebox::Error;
using fusebox::LoaderOptions;
using fusebox::PluginRegistry;
using fusebox::testing::error_of;
using fusebox::testing::only;
using fusebox::testing::ScratchDir;

namespace {

// The loader refuses a plugin in a folder that others may write to; a umask of 002 would make one.
const fs::path& private_dir(const ScratchDir& scratch) {
  fs::permissions(scratch.path(), fs::perms::owner_all | fs::perms::group_read |
                                      fs::perms::group_exec | fs::perms::others_read |
                                      fs::perms::others_exec);
  return scratch.path();
}

const fs::path kPlugins = FUSEBOX_PLUGIN_DIR;
const fs::path kTestPlugins = FUSEBOX_TEST_PLUGIN_DIR;

}  // namespace

TEST(PluginRegistry, LoadsByPathFileNameAndName) {
  PluginRegistry reg(only({kPlugins}));
  auto by_path = reg.load_file((kPlugins / "sgd.so").string());
  EXPECT_EQ(by_path->info().name, "sgd");
  EXPECT_TRUE(by_path->has(fusebox::kSupportsStepParam));
  EXPECT_FALSE(by_path->has(fusebox::kAutoLr));
  auto by_file = reg.load_file("sgd.so");
  EXPECT_EQ(by_file->info().path, by_path->info().path);
  auto by_name = reg.load_by_name("sgd");
  EXPECT_EQ(by_name->info().path, by_path->info().path);
  EXPECT_EQ(by_path->info().capability_names(), "supports_step_param");
}

TEST(PluginRegistry, DefaultDirIsBesideTheProgramAndCwdIsNotSearched) {
  LoaderOptions o;
  o.use_environment = false;
  PluginRegistry reg(o);
  auto path = reg.search_path();
  ASSERT_EQ(path.size(), 1u);
  EXPECT_EQ(fs::canonical(path[0]), fs::canonical(kPlugins));
  // A plugin copied into the current directory is not found by file name.
  const ScratchDir scratch("registry-cwd");
  const fs::path& dir = private_dir(scratch);
  fs::copy_file(kPlugins / "sgd.so", dir / "cwd_only.so");
  fs::path old = fs::current_path();
  fs::current_path(dir);
  std::string msg = error_of([&] { reg.load_file("cwd_only.so"); });
  fs::current_path(old);
  EXPECT_NE(msg.find("not found in the plugin search path"), std::string::npos) << msg;
}

TEST(PluginRegistry, EnvironmentPathIsSearchedAfterPluginDirs) {
  ::setenv("FUSEBOX_PLUGIN_PATH", (kTestPlugins / "duplicate").c_str(), 1);
  LoaderOptions o;
  o.plugin_dirs = {kTestPlugins};
  PluginRegistry reg(o);
  auto path = reg.search_path();
  ::unsetenv("FUSEBOX_PLUGIN_PATH");
  ASSERT_EQ(path.size(), 3u);
  EXPECT_EQ(path[0], kTestPlugins);
  EXPECT_EQ(path[1], kTestPlugins / "duplicate");
}

TEST(PluginRegistry, MissingFile) {
  PluginRegistry reg(only({kPlugins}));
  std::string msg = error_of([&] { reg.load_file("/nonexistent/dir/x.so"); });
  EXPECT_NE(msg.find("/nonexistent/dir/x.so does not exist"), std::string::npos) << msg;
  msg = error_of([&] { reg.load_file("sdg.so"); });
  EXPECT_NE(msg.find("did you mean 'sgd.so'"), std::string::npos) << msg;
}

TEST(PluginRegistry, TextFileNamedSo) {
  const ScratchDir scratch("registry-text");
  const fs::path& dir = private_dir(scratch);
  std::ofstream(dir / "fake.so") << "this is not a library\n";
  PluginRegistry reg(only({}));
  std::string msg = error_of([&] { reg.load_file((dir / "fake.so").string()); });
  EXPECT_NE(msg.find("fake.so is not a shared library"), std::string::npos) << msg;
}

TEST(PluginRegistry, ElfForAnotherArchitecture) {
  const ScratchDir scratch("registry-arch");
  const fs::path& dir = private_dir(scratch);
  // A 64-bit little-endian ELF header claiming to be for a different machine than this one.
  unsigned char h[64] = {0x7f, 'E', 'L', 'F', 2, 1, 1};
  h[16] = 3;                       // ET_DYN
  h[18] = 0xb7 == 62 ? 62 : 0xb7;  // EM_AARCH64 (183) on x86-64 hosts
#if defined(__aarch64__)
  h[18] = 62;  // EM_X86_64 on arm hosts
#endif
  std::ofstream(dir / "foreign.so", std::ios::binary).write(reinterpret_cast<char*>(h), sizeof(h));
  PluginRegistry reg(only({}));
  std::string msg = error_of([&] { reg.load_file((dir / "foreign.so").string()); });
  EXPECT_NE(msg.find("built for another architecture"), std::string::npos) << msg;
}

TEST(PluginRegistry, NoEntryPoint) {
  PluginRegistry reg(only({}));
  std::string msg = error_of([&] { reg.load_file((kTestPlugins / "tp_no_entry.so").string()); });
  EXPECT_NE(msg.find("tp_no_entry.so has no fusebox_plugin_entry"), std::string::npos) << msg;
}

TEST(PluginRegistry, ApiMajorMismatch) {
  PluginRegistry reg(only({}));
  std::string msg = error_of([&] { reg.load_file((kTestPlugins / "tp_api_major.so").string()); });
  EXPECT_NE(msg.find("uses plugin API " + std::to_string(FUSEBOX_API_MAJOR + 1) + ".0"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("rebuild the plugin"), std::string::npos) << msg;
}

TEST(PluginRegistry, ApiMinorNewerThanHost) {
  PluginRegistry reg(only({}));
  std::string msg = error_of([&] { reg.load_file((kTestPlugins / "tp_api_minor.so").string()); });
  EXPECT_NE(msg.find("needs plugin API " + std::to_string(FUSEBOX_API_MAJOR) + "." +
                     std::to_string(FUSEBOX_API_MINOR + 1)),
            std::string::npos)
      << msg;
}

TEST(PluginRegistry, TorchVersionMismatch) {
  PluginRegistry reg(only({}));
  std::string msg =
      error_of([&] { reg.load_file((kTestPlugins / "tp_torch_mismatch.so").string()); });
  EXPECT_NE(msg.find("built against LibTorch 0.4.1"), std::string::npos) << msg;
}

TEST(PluginRegistry, DuplicateNamesAreRefusedNamingBothPaths) {
  PluginRegistry reg(only({kPlugins, kTestPlugins / "duplicate"}));
  std::string msg = error_of([&] { reg.load_by_name("sgd"); });
  EXPECT_NE(msg.find("two plugins are named 'sgd'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("sgd.so"), std::string::npos) << msg;
  EXPECT_NE(msg.find("tp_duplicate_sgd.so"), std::string::npos) << msg;
  // Another plugin of that folder is still found by name, and the listing names the clash
  // instead of failing as a whole.
  EXPECT_EQ(reg.load_by_name("adamw")->info().name, "adamw");
  std::vector<fusebox::BrokenPlugin> broken;
  bool has_adamw = false, has_sgd = false;
  for (const auto& p : reg.list(&broken)) {
    has_adamw = has_adamw || p->info().name == "adamw";
    has_sgd = has_sgd || p->info().name == "sgd";
  }
  EXPECT_TRUE(has_adamw);
  EXPECT_FALSE(has_sgd) << "a name two files share selects neither";
  bool reported = false;
  for (const auto& b : broken)
    reported = reported || b.error.find("two plugins are named 'sgd'") != std::string::npos;
  EXPECT_TRUE(reported);
}

TEST(PluginRegistry, FactoryThrows) {
  PluginRegistry reg(only({}));
  auto plugin = reg.load_file((kTestPlugins / "tp_factory_throws.so").string());
  auto hp = plugin->validate({});
  std::string msg = error_of([&] { plugin->create({}, hp); });
  EXPECT_NE(msg.find("plugin 'factory_throws'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("factory refuses to build"), std::string::npos) << msg;
}

TEST(PluginRegistry, ListReportsBrokenFilesSeparately) {
  PluginRegistry reg(only({kTestPlugins}));
  std::vector<fusebox::BrokenPlugin> broken;
  auto plugins = reg.list(&broken);
  EXPECT_GE(broken.size(), 4u);  // no entry, api major/minor, torch version
  bool found = false;
  for (auto& p : plugins) found = found || p->info().name == "lion_custom";
  EXPECT_TRUE(found);
}

TEST(PluginRegistry, WritableByOthersIsRefusedUnlessAllowed) {
  const ScratchDir scratch("registry-insecure");
  const fs::path& dir = private_dir(scratch);
  fs::copy_file(kPlugins / "sgd.so", dir / "sgd.so");
  fs::permissions(dir / "sgd.so", fs::perms::others_write, fs::perm_options::add);
  PluginRegistry strict(only({}));
  std::string msg = error_of([&] { strict.load_file((dir / "sgd.so").string()); });
  EXPECT_NE(msg.find("writable by group or others"), std::string::npos) << msg;
  LoaderOptions lax = only({});
  lax.allow_insecure = true;
  PluginRegistry relaxed(lax);
  EXPECT_EQ(relaxed.load_file((dir / "sgd.so").string())->info().name, "sgd");
}

TEST(PluginRegistry, OptimizerKeepsLibraryAliveAfterRegistryAndPluginAreGone) {
  std::shared_ptr<fusebox::Optimizer> opt;
  at::Tensor w = at::ones({3}).set_requires_grad(true);
  {
    PluginRegistry reg(only({kPlugins}));
    auto plugin = reg.load_file("sgd.so");
    fusebox::ParamGroup g;
    g.params = {w};
    opt = plugin->create({g}, plugin->validate({}));
  }
  w.mutable_grad() = at::ones({3});
  opt->step();  // virtual call into the plugin: its code must still be mapped
  EXPECT_NEAR(w[0].item<float>(), 1.0f - 1e-3f, 1e-7);
}

// Optimizer state is keyed by parameter name: two parameters of one name (given, or a given one
// equal to a made-up "g0.p0") are refused when the optimizer is made, not merged in its state.
TEST(PluginRegistry, TwoParametersOfOneNameAreRefused) {
  PluginRegistry reg(only({kPlugins}));
  auto plugin = reg.load_file("adamw.so");
  fusebox::ParamGroup a, b;
  a.params = {at::ones({2}).set_requires_grad(true), at::ones({3}).set_requires_grad(true)};
  a.names = {"same", "same"};
  EXPECT_NE(error_of([&] { plugin->create({a}, plugin->validate({})); })
                .find("failed to create its optimizer: parameter name 'same' is given to two "
                      "parameters (group 0 #0 and group 0 #1): optimizer state and checkpoints "
                      "are keyed by name, so each parameter needs its own"),
            std::string::npos);
  a.names.clear();  // made up: g0.p0, g0.p1
  b.params = {at::ones({4}).set_requires_grad(true)};
  b.names = {"g0.p1"};
  EXPECT_NE(error_of([&] {
              plugin->create({a, b}, plugin->validate({}));
            })
                .find("parameter name 'g0.p1' is given to two parameters (group 0 #1 and group 1 "
                      "#0)"),
            std::string::npos);
  b.names = {"fc.weight"};
  EXPECT_EQ(plugin->create({a, b}, plugin->validate({}))->num_groups(), 2u);
}

// The names are checked again on the optimizer the plugin made: one built with an older SDK
// header, whose constructor did not check them, or one renaming its parameters is refused too.
TEST(PluginRegistry, APluginThatGivesTwoParametersOneNameIsRefused) {
  PluginRegistry reg(only({kTestPlugins}));
  auto plugin = reg.load_file((kTestPlugins / "tp_renames_params.so").string());
  fusebox::ParamGroup a;
  a.params = {at::ones({2}).set_requires_grad(true), at::ones({3}).set_requires_grad(true)};
  a.names = {"w", "b"};
  EXPECT_NE(error_of([&] { plugin->create({a}, plugin->validate({})); })
                .find("failed to create its optimizer: parameter name 'renamed' is given to two "
                      "parameters (group 0 #0 and group 0 #1)"),
            std::string::npos);
  a.params.pop_back();
  a.names.pop_back();
  EXPECT_EQ(plugin->create({a}, plugin->validate({}))->group(0).names[0], "renamed");
}

// A plugin built with the other libstdc++ string ABI would crash in its first call (std::string
// is laid out differently): it is refused from its ELF symbols before it is loaded.
TEST(PluginRegistry, APluginOfTheOtherStringAbiIsRefusedBeforeItRuns) {
  PluginRegistry reg(only({}));
  const std::string msg =
      error_of([&] { reg.load_file((kTestPlugins / "tp_other_string_abi.so").string()); });
  EXPECT_NE(msg.find("tp_other_string_abi.so is built with -D_GLIBCXX_USE_CXX11_ABI=0 but fusebox "
                     "and its LibTorch use 1"),
            std::string::npos)
      << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  EXPECT_NO_THROW(reg.load_file((kPlugins / "sgd.so").string()));  // this ABI: loads
}

// Values that are not std::exceptions (throw 42) from a plugin inside a hook would end the
// process in autograd's engine; they come out as one fusebox::Error, and the iteration is
// abandoned cleanly.
TEST(PluginRegistry, APluginThrowingANonStandardValueInAHookGivesAnError) {
  PluginRegistry reg(only({}));
  auto plugin = reg.load_file((kTestPlugins / "tp_throws_int.so").string());
  const fusebox::HyperParams hp = plugin->validate({});
  for (const std::string mode : {"fused", "groups"}) {
    SCOPED_TRACE(mode);
    at::Tensor w = at::randn({4, 3}).requires_grad_(true);
    fusebox::ParamGroup g;
    g.params = {w};
    g.names = {"w"};
    fusebox::StepOptions o;
    o.warn = [](const std::string&) {};
    std::unique_ptr<fusebox::StepMode> m =
        mode == "fused"
            ? fusebox::make_fused_backward(plugin->create({g}, hp), o)
            : fusebox::make_optimizer_groups(
                  {g}, 1, fusebox::SplitPolicy::Size,
                  [&](std::vector<fusebox::ParamGroup> gs) { return plugin->create(gs, hp); }, o);
    const std::string msg = error_of([&] { m->backward((w * w).sum()); });
    EXPECT_NE(msg.find("threw a value that is not a std::exception"), std::string::npos) << msg;
    EXPECT_FALSE(w.grad().defined()) << "the gradient is freed";
  }
}

// A program of the user's own, in a folder with no plugins beside it, finds the plugins built or
// installed with libfusebox_core by name: this test runs a copy of its own executable from a
// temporary folder (the copy still links the build tree's libfusebox_core).
TEST(PluginRegistry, ProgramsElsewhereFindThePluginsBesideTheCoreLibrary) {
  if (std::getenv("FUSEBOX_TEST_AS_OTHER_PROGRAM")) {
    LoaderOptions o;
    o.use_environment = false;
    PluginRegistry registry(o);
    EXPECT_EQ(registry.load_file("adamw.so")->info().name, "adamw");
    EXPECT_EQ(registry.load_by_name("sgd")->info().name, "sgd");
    return;
  }
  const ScratchDir scratch("registry-other-program");
  const fs::path& dir = private_dir(scratch);
  struct Remove {  // also when an assertion ends the test early: the copy is a whole test binary
    fs::path d;
    ~Remove() {
      std::error_code ignored;
      fs::remove_all(d, ignored);
    }
  } remove{dir};
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  ASSERT_FALSE(ec);
  fs::create_directories(dir / "bin");
  fs::copy_file(self, dir / "bin" / "user_program");
  ASSERT_FALSE(fs::exists(dir / "lib"));
  const std::string cmd = "FUSEBOX_TEST_AS_OTHER_PROGRAM=1 FUSEBOX_PLUGIN_PATH= " +
                          (dir / "bin" / "user_program").string() +
                          " --gtest_filter=PluginRegistry.ProgramsElsewhere* >" +
                          (dir / "out.txt").string() + " 2>&1";
  const int status = std::system(cmd.c_str());
  std::ifstream in(dir / "out.txt");
  const std::string out((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  EXPECT_NE(out.find("[  PASSED  ] 1 test."), std::string::npos) << out;  // the copy ran it
}

// A plugin file cut short (an interrupted copy) is refused from its headers: the dynamic loader
// would map it and die of SIGBUS on the missing pages, taking the program, or a --list-plugins
// scan of its folder, with it.
TEST(PluginRegistry, ATruncatedPluginIsRefusedBeforeTheLoaderMapsIt) {
  const ScratchDir scratch("registry-truncated");
  const fs::path& dir = private_dir(scratch);
  {
    std::ifstream in(kPlugins / "sgd.so", std::ios::binary);
    std::string head(5000, '\0');
    in.read(head.data(), static_cast<std::streamsize>(head.size()));
    std::ofstream(dir / "cut.so", std::ios::binary) << head;
  }
  PluginRegistry reg(only({dir}));
  std::string msg = error_of([&] { reg.load_file("cut.so"); });
  EXPECT_NE(msg.find("cut.so is truncated"), std::string::npos) << msg;
  EXPECT_NE(msg.find("the file has 5000"), std::string::npos) << msg;

  fs::copy_file(kPlugins / "sgd.so", dir / "sgd.so");
  std::vector<fusebox::BrokenPlugin> broken;
  auto plugins = reg.list(&broken);
  ASSERT_EQ(plugins.size(), 1u);
  EXPECT_EQ(plugins[0]->info().name, "sgd");
  ASSERT_EQ(broken.size(), 1u);
  EXPECT_EQ(broken[0].path.filename(), "cut.so");
}

// An exception thrown inside a plugin is an object whose destructor and vtable are the plugin's
// code. Caught after the optimizer and registry holding the library are gone (destroyed while
// it unwound), it must still be readable and destructible: plugins are never unmapped.
TEST(PluginRegistry, AnExceptionFromAPluginOutlivesEveryHandleOnIt) {
  std::vector<at::Tensor> params;
  std::string caught;
  try {
    std::shared_ptr<fusebox::Optimizer> opt;
    {
      PluginRegistry reg(only({kPlugins}));
      auto plugin = reg.load_file("dadaptation.so");
      params = {at::ones({2}).requires_grad_(), at::ones({2}).requires_grad_()};
      fusebox::ParamGroup a, b;
      a.params = {params[0]};
      a.names = {"a"};
      a.lr = 1.0;
      b.params = {params[1]};
      b.names = {"b"};
      b.lr = 0.5;  // D-Adaptation refuses groups of different lr in its step
      opt = plugin->create({a, b}, plugin->validate({}));
    }
    for (auto& p : params) p.mutable_grad() = at::ones({2});
    opt->step();
  } catch (const std::exception& e) {
    caught = e.what();
  }
  EXPECT_NE(caught.find("lr"), std::string::npos) << caught;
}
