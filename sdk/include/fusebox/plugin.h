// fusebox SDK: the plugin descriptor and the one entry point that exports it.
//
// Like LLVM's pass plugins, a plugin exports exactly one extern "C" function,
// `fusebox_plugin_entry`, returning a pointer to a static descriptor. The host reads
// `struct_size` and the API version first and refuses a plugin it cannot understand before it
// touches any other field.
//
// Versioning: FUSEBOX_API_MAJOR changes when a change breaks built plugins (a field or virtual
// function moved or removed); FUSEBOX_API_MINOR changes when fields are appended to the end of the
// descriptor. A host accepts the same major and a minor no newer than its own.
#pragma once

#include <torch/version.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "fusebox/hyperparams.h"
#include "fusebox/optimizer.h"

/// Major version of the plugin API: plugins must match it exactly.
#define FUSEBOX_API_MAJOR 2
/// Minor version of the plugin API: plugins may be older, not newer.
#define FUSEBOX_API_MINOR 0

namespace fusebox {

/// Capability bits a plugin declares; new bits never change the meaning of old ones.
enum Capability : uint64_t {
  kSupportsStepParam = 1u << 0,  ///< step_param() updates one parameter exactly as step() would
  kAutoLr = 1u << 1,             ///< estimates its step size from all parameters together
};

/// What a plugin tells the host; returned by `fusebox_plugin_entry`.
struct PluginDescriptor {
  uint32_t struct_size;       ///< sizeof(PluginDescriptor) the plugin was built with
  uint16_t api_major;         ///< FUSEBOX_API_MAJOR at build time
  uint16_t api_minor;         ///< FUSEBOX_API_MINOR at build time
  const char* torch_version;  ///< LibTorch version built against ("1.13.1")
  const char* name;           ///< unique plugin name, e.g. "adafactor"
  const char* version;        ///< the plugin's own version
  const char* description;    ///< one line
  uint64_t capabilities;      ///< bitwise OR of Capability
  /// Fills in the hyperparameter schema.
  void (*declare_schema)(Schema& schema);
  /// Builds an optimizer from groups and validated hyperparameters (defaults filled in).
  std::unique_ptr<Optimizer> (*create)(std::vector<ParamGroup> groups, const HyperParams& hp);
};

}  // namespace fusebox

/// Name of the exported entry point.
#define FUSEBOX_PLUGIN_ENTRY_NAME "fusebox_plugin_entry"

/// Exports a plugin. `OptimizerClass` needs a constructor (std::vector<ParamGroup>, const
/// HyperParams&) and a static `void declare_schema(fusebox::Schema&)`.
#define FUSEBOX_PLUGIN(OptimizerClass, NAME, VERSION, DESCRIPTION, CAPABILITIES)        \
  extern "C" __attribute__((visibility("default"))) const ::fusebox::PluginDescriptor*  \
  fusebox_plugin_entry() {                                                              \
    static const ::fusebox::PluginDescriptor descriptor{                                \
        sizeof(::fusebox::PluginDescriptor),                                            \
        FUSEBOX_API_MAJOR,                                                              \
        FUSEBOX_API_MINOR,                                                              \
        TORCH_VERSION,                                                                  \
        NAME,                                                                           \
        VERSION,                                                                        \
        DESCRIPTION,                                                                    \
        CAPABILITIES,                                                                   \
        &OptimizerClass::declare_schema,                                                \
        [](std::vector<::fusebox::ParamGroup> groups,                                   \
           const ::fusebox::HyperParams& hp) -> std::unique_ptr<::fusebox::Optimizer> { \
          return std::make_unique<OptimizerClass>(std::move(groups), hp);               \
        }};                                                                             \
    return &descriptor;                                                                 \
  }
