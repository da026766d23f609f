// Finding, checking and loading optimizer plugins.
//
// A plugin is loaded by explicit path, by file name (resolved in the search path) or by plugin
// name (every plugin in the search path is inspected). The search path is: the folders given by
// the caller (--plugin-dir), then FUSEBOX_PLUGIN_PATH, then lib/fusebox/plugins beside the running
// program's bin/ folder. The current directory is never searched implicitly.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fusebox/core/hyperparam_validation.h"
#include "fusebox/plugin.h"

namespace fusebox {

/// What a plugin says about itself, plus where it was found.
struct PluginInfo {
  std::string name, version, description, torch_version;
  std::filesystem::path path;
  uint64_t capabilities = 0;
  unsigned api_major = 0, api_minor = 0;
  /// Capabilities as words, e.g. "supports_step_param,auto_lr" ("none" when empty).
  std::string capability_names() const;
};

/// A loaded plugin. The shared library stays mapped while this object, or any optimizer it
/// created, is alive.
class LoadedPlugin {
 public:
  LoadedPlugin(std::shared_ptr<void> library, const PluginDescriptor* descriptor, PluginInfo info);
  const PluginInfo& info() const { return info_; }
  const Schema& schema() const { return schema_; }
  bool has(Capability c) const { return (info_.capabilities & c) != 0; }
  /// Validates user arguments against the schema and fills defaults (throws Error).
  HyperParams validate(const UserArgs& args) const;
  /// Builds an optimizer; errors from the plugin's factory are rethrown naming the plugin.
  std::shared_ptr<Optimizer> create(std::vector<ParamGroup> groups, const HyperParams& hp) const;

 private:
  std::shared_ptr<void> library_;  // declared first: destroyed last
  const PluginDescriptor* descriptor_;
  PluginInfo info_;
  Schema schema_;
};

/// Where to look and how strict to be.
struct LoaderOptions {
  std::vector<std::filesystem::path> plugin_dirs;  ///< searched first, in order
  bool use_environment = true;                     ///< also search FUSEBOX_PLUGIN_PATH
  /// Also search <exe>/../lib/fusebox/plugins (the trainer's, in the build and install trees)
  /// and the plugin folder installed or built with libfusebox_core (any program linking it).
  bool use_default_dir = true;
  bool allow_insecure = false;  ///< load files/folders writable by group or others
};

/// A plugin file that could not be loaded while scanning the search path.
struct BrokenPlugin {
  std::filesystem::path path;
  std::string error;
};

/// The plugin that made `optimizer` through LoadedPlugin::create, or nothing for an optimizer made
/// otherwise (a subclass in the program itself). The step modes check its capabilities with it:
/// fused stepping needs supports_step_param; optimizer groups and sharded state refuse auto_lr.
std::optional<PluginInfo> plugin_of(const Optimizer& optimizer);

class PluginRegistry {
 public:
  explicit PluginRegistry(LoaderOptions options = {});
  /// The folders searched, in order.
  std::vector<std::filesystem::path> search_path() const;
  /// Loads `spec`: a path when it contains '/', else a file name looked up in the search path.
  std::shared_ptr<LoadedPlugin> load_file(const std::string& spec);
  /// Loads the plugin whose descriptor name is `name`; refuses duplicates naming both paths.
  std::shared_ptr<LoadedPlugin> load_by_name(const std::string& name);
  /// Every loadable plugin in the search path (sorted by name); unloadable files go to `broken`,
  /// and so do plugins sharing a name with another file (left out: neither is the one by name).
  std::vector<std::shared_ptr<LoadedPlugin>> list(std::vector<BrokenPlugin>* broken = nullptr);

 private:
  std::shared_ptr<LoadedPlugin> load_path(const std::filesystem::path& path);
  /// list(), plus the error of each name that two files share.
  std::vector<std::shared_ptr<LoadedPlugin>> scan(std::vector<BrokenPlugin>* broken,
                                                  std::map<std::string, std::string>* clashes);
  LoaderOptions options_;
  std::map<std::string, std::shared_ptr<LoadedPlugin>> cache_;  // by canonical path
};

/// The folder the running executable lives in.
std::filesystem::path executable_dir();

}  // namespace fusebox
