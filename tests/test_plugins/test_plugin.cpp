// Deliberately misbehaving plugins for the loader and hook tests; which fault is chosen by a
// compile definition (see CMakeLists.txt here).
#ifdef FAULT_OTHER_STRING_ABI
// Before any standard header: the libstdc++ string ABI that LibTorch's flags did not choose.
#undef _GLIBCXX_USE_CXX11_ABI
#define _GLIBCXX_USE_CXX11_ABI 0
#endif
#include <fusebox/sdk.h>

namespace {

// A plain SGD-like optimizer whose faults are switched on by FAULT_*.
class TestOptimizer final : public fusebox::Optimizer {
 public:
  static void declare_schema(fusebox::Schema& s) { s.real("lr", 0.1, "learning rate").above(0); }
  TestOptimizer(std::vector<fusebox::ParamGroup> groups, const fusebox::HyperParams& hp)
      : Optimizer(std::move(groups), hp), lr_at_start_(hp.real("lr")) {
#ifdef FAULT_FACTORY_THROWS
    throw fusebox::Error("test plugin: factory refuses to build");
#endif
#ifdef FAULT_RENAMES_PARAMS
    // After the base's check, as an optimizer built with an older SDK header would get past it.
    for (auto& group : Optimizer::groups()) group.names.assign(group.names.size(), "renamed");
#endif
  }
#ifdef FAULT_STEP_THROWS
  void step() override { throw fusebox::Error("test plugin: step exploded"); }
#endif

 protected:
  void update_param(const at::Tensor& param, fusebox::ParamState& state, size_t g) override {
#ifdef FAULT_STEP_PARAM_THROWS
    throw fusebox::Error("test plugin: step_param exploded on purpose");
#endif
#ifdef FAULT_THROWS_INT
    throw 42;  // not a std::exception
#endif
    ++state.step;
#ifdef FAULT_LR_IN_CTOR
    (void)g;
    param.add_(param.grad(), -lr_at_start_);  // ignores the scheduler's lr
#else
    param.add_(param.grad(), -lr(g));
#endif
  }

 private:
  double lr_at_start_;
};

}  // namespace

#ifndef FAULT_NO_ENTRY
#ifndef PLUGIN_NAME
#define PLUGIN_NAME "testplugin"
#endif
#ifndef PLUGIN_CAPS
#define PLUGIN_CAPS fusebox::kSupportsStepParam
#endif
#if defined(FAULT_API_MAJOR) || defined(FAULT_API_MINOR) || defined(FAULT_TORCH)
// Hand-written descriptor with a wrong version field.
extern "C" __attribute__((visibility("default"))) const fusebox::PluginDescriptor*
fusebox_plugin_entry() {
  static const fusebox::PluginDescriptor d{
      sizeof(fusebox::PluginDescriptor),
#ifdef FAULT_API_MAJOR
      FUSEBOX_API_MAJOR + 1,
#else
      FUSEBOX_API_MAJOR,
#endif
#ifdef FAULT_API_MINOR
      FUSEBOX_API_MINOR + 1,
#else
      FUSEBOX_API_MINOR,
#endif
#ifdef FAULT_TORCH
      "0.4.1",
#else
      TORCH_VERSION,
#endif
      PLUGIN_NAME,
      "0.0.1",
      "broken on purpose",
      PLUGIN_CAPS,
      &TestOptimizer::declare_schema,
      [](std::vector<fusebox::ParamGroup> g,
         const fusebox::HyperParams& h) -> std::unique_ptr<fusebox::Optimizer> {
        return std::make_unique<TestOptimizer>(std::move(g), h);
      }};
  return &d;
}
#else
FUSEBOX_PLUGIN(TestOptimizer, PLUGIN_NAME, "0.0.1", "test plugin", PLUGIN_CAPS)
#endif
#else
extern "C" __attribute__((visibility("default"))) int not_the_entry_point() { return 42; }
#endif
