#include "fusebox/core/plugin_registry.h"

#include <dlfcn.h>
#include <elf.h>
#include <sys/stat.h>
#include <torch/version.h>

#include <algorithm>
#include <boost/dll/runtime_symbol_info.hpp>
#include <boost/dll/shared_library.hpp>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <unordered_map>

#include "fusebox/core/messages.h"
#include "fusebox/core/suggest.h"

namespace fusebox {

namespace fs = std::filesystem;

namespace {

constexpr const char* kPluginSubdir = "lib/fusebox/plugins";

#if defined(__x86_64__)
constexpr uint16_t kHostMachine = EM_X86_64;
#elif defined(__aarch64__)
constexpr uint16_t kHostMachine = EM_AARCH64;
#elif defined(__powerpc64__)
constexpr uint16_t kHostMachine = EM_PPC64;
#else
constexpr uint16_t kHostMachine = 0;  // unknown host: let the dynamic loader decide
#endif

// The descriptor's size in each minor version of API 1 (fields are only ever appended). A field
// appended in minor N adds an entry here, and is read only from plugins of minor >= N.
// Each entry is fixed where its version ends, not sizeof(PluginDescriptor), which grows.
constexpr uint32_t kDescriptorSizes[] = {
    offsetof(PluginDescriptor, create) + sizeof(PluginDescriptor::create),  // 1.0
};
static_assert(std::size(kDescriptorSizes) == FUSEBOX_API_MINOR + 1 &&
                  kDescriptorSizes[FUSEBOX_API_MINOR] == sizeof(PluginDescriptor),
              "add the new minor version's descriptor size");
uint32_t descriptor_size(uint16_t api_minor) {
  return kDescriptorSizes[std::min<size_t>(api_minor, std::size(kDescriptorSizes) - 1)];
}

// "1.13.1" -> "1.13": plugins must match the host's LibTorch major.minor (its C++ ABI).
std::string major_minor(const std::string& v) {
  size_t first = v.find('.');
  if (first == std::string::npos) return v;
  size_t second = v.find('.', first + 1);
  return v.substr(0, second);
}

// Refuses a file, or its folder, that someone other than the owner could replace.
void check_permissions(const fs::path& path, bool allow_insecure) {
  if (allow_insecure) return;
  for (const fs::path& p : {path, path.parent_path()}) {
    struct stat st {};
    if (::stat(p.c_str(), &st) != 0) continue;
    if (st.st_mode & (S_IWGRP | S_IWOTH)) {
      // A sticky folder (like /tmp) still lets others replace only their own files.
      if (p != path && (st.st_mode & S_ISVTX)) continue;
      throw Error("refusing to load plugin " + path.string() + ": " + p.string() +
                  " is writable by group or others (fix with chmod go-w, or allow it: "
                  "LoaderOptions::allow_insecure, the trainer's --allow-insecure-plugins)");
    }
  }
}

// Refuses a file cut short (an interrupted copy or download) whose headers promise more than it
// holds: the dynamic loader maps such a file and dies of SIGBUS when it touches the missing pages,
// taking the whole program with it, where a clear error was due.
void check_elf_extent(const fs::path& path, const Elf64_Ehdr& eh, std::ifstream& in) {
  std::error_code ec;
  const uint64_t file_size = fs::file_size(path, ec);
  if (ec) return;
  const auto truncated = [&](const std::string& what, uint64_t needs) {
    return Error("plugin " + path.string() + " is truncated: its " + what + " needs " +
                 std::to_string(needs) + " bytes but the file has " + std::to_string(file_size) +
                 " (an interrupted copy?); copy or rebuild it again");
  };
  if (file_size < sizeof eh) throw truncated("ELF header", sizeof eh);
  if (eh.e_ident[EI_DATA] != ELFDATA2LSB) return;  // only this host's byte order is read here
  if (eh.e_phentsize != sizeof(Elf64_Phdr) || eh.e_phnum == 0 || eh.e_phnum == PN_XNUM)
    throw Error("plugin " + path.string() +
                " has no usable program headers: it is not a loadable shared library; "
                "rebuild it with the fusebox SDK");
  const uint64_t table_end = eh.e_phoff + uint64_t{eh.e_phnum} * sizeof(Elf64_Phdr);
  if (eh.e_phoff > file_size || table_end > file_size)
    throw truncated("program header table", table_end);
  std::vector<Elf64_Phdr> segments(eh.e_phnum);
  in.clear();
  in.seekg(static_cast<std::streamoff>(eh.e_phoff));
  if (!in.read(reinterpret_cast<char*>(segments.data()),
               static_cast<std::streamsize>(segments.size() * sizeof(Elf64_Phdr))))
    throw truncated("program header table", table_end);
  for (const Elf64_Phdr& seg : segments) {
    if (seg.p_type != PT_LOAD && seg.p_type != PT_DYNAMIC) continue;
    const uint64_t end = seg.p_offset + seg.p_filesz;
    if (end < seg.p_offset || end > file_size) throw truncated("loadable segment", end);
  }
}

// The libstdc++ string ABI of a plugin's dynamic symbols: 1 (C++11, std::__cxx11), 0 (the old
// one, -D_GLIBCXX_USE_CXX11_ABI=0), or -1 when they show neither. Read from the ELF file before
// it is loaded: a plugin of the other ABI passes std::string across the boundary with another
// layout and crashes in its first call, whatever its descriptor says.
int plugin_string_abi(const Elf64_Ehdr& eh, std::ifstream& in) {
  if (eh.e_ident[EI_DATA] != ELFDATA2LSB || eh.e_shentsize != sizeof(Elf64_Shdr) ||
      eh.e_shnum == 0 || eh.e_shnum > 65000)
    return -1;
  std::vector<Elf64_Shdr> sections(eh.e_shnum);
  in.clear();
  in.seekg(static_cast<std::streamoff>(eh.e_shoff));
  if (!in.read(reinterpret_cast<char*>(sections.data()),
               static_cast<std::streamsize>(sections.size() * sizeof(Elf64_Shdr))))
    return -1;
  for (const Elf64_Shdr& s : sections) {
    if (s.sh_type != SHT_DYNSYM || s.sh_link >= sections.size()) continue;
    const Elf64_Shdr& strings = sections[s.sh_link];
    if (strings.sh_size > (uint64_t{64} << 20)) return -1;
    std::string names(strings.sh_size, '\0');
    in.seekg(static_cast<std::streamoff>(strings.sh_offset));
    if (!in.read(names.data(), static_cast<std::streamsize>(names.size()))) return -1;
    if (names.find("St7__cxx11") != std::string::npos) return 1;
    // The old ABI's std::string is "Ss" in mangled names: its members are _ZNSs..., _ZNKSs...
    if (names.find("_ZNSs") != std::string::npos || names.find("_ZNKSs") != std::string::npos)
      return 0;
    return -1;
  }
  return -1;
}

void check_string_abi(const fs::path& path, const Elf64_Ehdr& eh, std::ifstream& in) {
#if defined(_GLIBCXX_USE_CXX11_ABI)
  const int host = _GLIBCXX_USE_CXX11_ABI ? 1 : 0;
  const int plugin = plugin_string_abi(eh, in);
  if (plugin >= 0 && plugin != host)
    throw Error("plugin " + path.string() +
                " is built with -D_GLIBCXX_USE_CXX11_ABI=" + std::to_string(plugin) +
                " but fusebox and its LibTorch use " + std::to_string(host) +
                " (std::string differs between the two): rebuild the plugin with LibTorch's "
                "flags (find_package(Fusebox) and fusebox_add_plugin set them)");
#else
  (void)path, (void)eh, (void)in;
#endif
}

// Checks a plugin file before the loader maps it, from one read of its ELF header: the loader's
// messages for a file that is not a library are cryptic, and some files crash it.
void check_elf(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("cannot read plugin " + path.string() + ": permission denied or unreadable");
  Elf64_Ehdr eh{};
  in.read(reinterpret_cast<char*>(&eh), sizeof eh);
  if (in.gcount() < static_cast<std::streamsize>(EI_NIDENT + 4) ||
      std::memcmp(eh.e_ident, ELFMAG, SELFMAG) != 0)
    throw Error("plugin " + path.string() +
                " is not a shared library (no ELF header); pass a .so built with the fusebox SDK");
  if (eh.e_ident[EI_CLASS] != ELFCLASS64)
    throw Error("plugin " + path.string() + " is a 32-bit ELF file; this host needs 64-bit");
  if (kHostMachine != 0 && eh.e_ident[EI_DATA] == ELFDATA2LSB && eh.e_machine != kHostMachine)
    throw Error("plugin " + path.string() + " is built for another architecture (ELF machine " +
                std::to_string(eh.e_machine) + ", this host is " + std::to_string(kHostMachine) +
                "); rebuild it on this machine");
  check_elf_extent(path, eh, in);
  check_string_abi(path, eh, in);
}

}  // namespace

std::string PluginInfo::capability_names() const {
  std::string out;
  if (capabilities & kSupportsStepParam) out += "supports_step_param";
  if (capabilities & kAutoLr) out += std::string(out.empty() ? "" : ",") + "auto_lr";
  return out.empty() ? "none" : out;
}

namespace {

// Which plugin made each live optimizer (LoadedPlugin::create adds, the deleter removes).
class MadeBy {
 public:
  void add(const Optimizer* o, const PluginInfo& info) {
    std::lock_guard<std::mutex> lock(mu_);
    makers_[o] = info;
  }
  void remove(const Optimizer* o) {
    std::lock_guard<std::mutex> lock(mu_);
    makers_.erase(o);
  }
  std::optional<PluginInfo> find(const Optimizer* o) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = makers_.find(o);
    return it == makers_.end() ? std::nullopt : std::optional<PluginInfo>(it->second);
  }

 private:
  std::mutex mu_;
  std::unordered_map<const Optimizer*, PluginInfo> makers_;
};

MadeBy& made_by() {
  static MadeBy* m = new MadeBy();  // never destroyed: optimizers may outlive static destruction
  return *m;
}

}  // namespace

fs::path executable_dir() {
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  return ec ? fs::path() : exe.parent_path();
}

// The folder of libfusebox_core itself (this code), wherever the program using it lives.
fs::path core_library_dir() {
  boost::system::error_code ec;
  const boost::dll::fs::path lib = boost::dll::this_line_location(ec);
  return ec ? fs::path() : fs::path(lib.parent_path().string());
}

// ---------------------------------------------------------------------------------------------
LoadedPlugin::LoadedPlugin(std::shared_ptr<void> library, const PluginDescriptor* descriptor,
                           PluginInfo info)
    : library_(std::move(library)), descriptor_(descriptor), info_(std::move(info)) {
  try {
    descriptor_->declare_schema(schema_);
  } catch (const std::exception& e) {
    throw Error("plugin " + info_.path.string() +
                " failed to declare its schema: " + first_line(e.what()));
  } catch (...) {
    throw Error("plugin " + info_.path.string() +
                " failed to declare its schema: it threw something that is not a std::exception");
  }
}

HyperParams LoadedPlugin::validate(const UserArgs& args) const {
  return validate_hyperparams(schema_, info_.name, args);
}

std::shared_ptr<Optimizer> LoadedPlugin::create(std::vector<ParamGroup> groups,
                                                const HyperParams& hp) const {
  std::unique_ptr<Optimizer> made;
  try {
    made = descriptor_->create(std::move(groups), hp);
  } catch (const std::exception& e) {
    throw Error("plugin '" + info_.name + "' (" + info_.path.string() +
                ") failed to create its optimizer: " + first_line(e.what()));
  } catch (...) {
    throw Error("plugin '" + info_.name + "' (" + info_.path.string() +
                ") failed to create its optimizer: it threw something that is not a "
                "std::exception");
  }
  if (!made)
    throw Error("plugin '" + info_.name + "' (" + info_.path.string() +
                ") returned no optimizer from its factory");
  // The SDK's constructor refuses two parameters of one name; checked again on what the plugin
  // made, since a plugin built with an older SDK header, or one renaming its parameters, skips it.
  std::map<std::string, std::pair<size_t, size_t>> seen;
  for (size_t g = 0; g < made->num_groups(); ++g)
    for (size_t i = 0; i < made->group(g).names.size(); ++i) {
      const auto [it, fresh] = seen.emplace(made->group(g).names[i], std::make_pair(g, i));
      if (!fresh)
        throw Error("plugin '" + info_.name + "' (" + info_.path.string() +
                    ") failed to create its optimizer: parameter name '" + it->first +
                    "' is given to two parameters (group " + std::to_string(it->second.first) +
                    " #" + std::to_string(it->second.second) + " and group " + std::to_string(g) +
                    " #" + std::to_string(i) +
                    "): optimizer state and checkpoints are keyed by name, so each parameter "
                    "needs its own");
    }
  // The deleter holds the library: the object's code stays mapped until it is destroyed.
  std::shared_ptr<void> lib = library_;
  made_by().add(made.get(), info_);
  return std::shared_ptr<Optimizer>(made.release(), [lib](Optimizer* p) {
    made_by().remove(p);
    delete p;
  });
}

std::optional<PluginInfo> plugin_of(const Optimizer& optimizer) {
  return made_by().find(&optimizer);
}

// ---------------------------------------------------------------------------------------------
PluginRegistry::PluginRegistry(LoaderOptions options) : options_(std::move(options)) {}

std::vector<fs::path> PluginRegistry::search_path() const {
  std::vector<fs::path> out = options_.plugin_dirs;
  if (options_.use_environment) {
    if (const char* env = std::getenv("FUSEBOX_PLUGIN_PATH")) {
      std::stringstream ss(env);
      std::string item;
      while (std::getline(ss, item, ':'))
        if (!item.empty()) out.emplace_back(item);
    }
  }
  if (options_.use_default_dir) {
    std::vector<fs::path> defaults;
    if (fs::path exe = executable_dir(); !exe.empty())
      defaults.push_back(exe / ".." / kPluginSubdir);
    // Programs other than the trainer: the plugins installed (or built) with this library.
    if (fs::path lib = core_library_dir(); !lib.empty()) {
      defaults.push_back(lib / FUSEBOX_PLUGIN_DIR_FROM_LIBDIR);
      defaults.push_back(lib / "fusebox" / "plugins");
    }
    for (const fs::path& d : defaults) {
      const fs::path dir = d.lexically_normal();
      if (std::find(out.begin(), out.end(), dir) == out.end()) out.push_back(dir);
    }
  }
  return out;
}

std::shared_ptr<LoadedPlugin> PluginRegistry::load_path(const fs::path& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) throw Error("plugin file " + path.string() + does_not_exist(ec));
  if (!fs::is_regular_file(path, ec))
    throw Error("plugin " + path.string() + " is not a regular file");
  const fs::path canonical = fs::canonical(path, ec);
  const std::string key = (ec ? path : canonical).string();
  if (auto it = cache_.find(key); it != cache_.end()) return it->second;

  check_permissions(canonical, options_.allow_insecure);
  check_elf(canonical);

  auto library = std::make_shared<boost::dll::shared_library>();
  try {
    // rtld_now: a missing symbol fails here, with the dynamic loader's text, not mid-training.
    // RTLD_NODELETE: a plugin, once loaded, stays mapped until the program ends (as LLVM's pass
    // plugins do). Its code outlives every handle: an exception it threw, whose destructor and
    // vtable live in the plugin, may be still in flight when the last optimizer and registry
    // holding the library are destroyed during unwinding.
    library->load(canonical.string(), boost::dll::load_mode::rtld_now |
                                          boost::dll::load_mode::rtld_local |
                                          static_cast<boost::dll::load_mode::type>(RTLD_NODELETE));
  } catch (const std::exception& e) {
    // Boost appends the errno left behind by dlopen ("...: Bad file descriptor"), which means
    // nothing here: the loader's own text is what says why.
    std::string why = first_line(e.what());
    for (const char* noise : {": Bad file descriptor", ": Success"})
      if (why.size() > std::strlen(noise) &&
          why.compare(why.size() - std::strlen(noise), std::string::npos, noise) == 0)
        why.resize(why.size() - std::strlen(noise));
    throw Error("cannot load plugin " + path.string() + ": " + why +
                " (an undefined symbol means it was built against another fusebox or LibTorch: "
                "rebuild it against this one)");
  }
  if (!library->has(FUSEBOX_PLUGIN_ENTRY_NAME))
    throw Error("plugin " + path.string() +
                " has no " FUSEBOX_PLUGIN_ENTRY_NAME
                " entry point: it is not a fusebox plugin (export one with FUSEBOX_PLUGIN)");
  using Entry = const PluginDescriptor*();
  const PluginDescriptor* d = nullptr;
  try {
    d = library->get<Entry>(FUSEBOX_PLUGIN_ENTRY_NAME)();
  } catch (const std::exception& e) {
    throw Error("plugin " + path.string() + ": its entry point threw: " + first_line(e.what()));
  } catch (...) {
    throw Error("plugin " + path.string() + ": its entry point threw");
  }
  if (!d) throw Error("plugin " + path.string() + ": its entry point returned no descriptor");

  // Version first: nothing past api_minor may be read before the layout is known to match.
  const std::string host_api =
      std::to_string(FUSEBOX_API_MAJOR) + "." + std::to_string(FUSEBOX_API_MINOR);
  const std::string plugin_api = std::to_string(d->api_major) + "." + std::to_string(d->api_minor);
  if (d->api_major != FUSEBOX_API_MAJOR)
    throw Error("plugin " + path.string() + " uses plugin API " + plugin_api +
                " but this fusebox implements API " + host_api +
                ": rebuild the plugin against this fusebox SDK");
  if (d->api_minor > FUSEBOX_API_MINOR)
    throw Error("plugin " + path.string() + " needs plugin API " + plugin_api +
                ", newer than this fusebox's " + host_api + ": upgrade fusebox");
  // A plugin of an older minor version has a shorter descriptor: require the size of its own
  // version's layout, and read no field appended after it.
  if (d->struct_size < descriptor_size(d->api_minor))
    throw Error("plugin " + path.string() + " has a truncated descriptor (" +
                std::to_string(d->struct_size) + " bytes, API " + plugin_api + " has " +
                std::to_string(descriptor_size(d->api_minor)) + "): rebuild it against this SDK");
  const std::string torch_version = d->torch_version ? d->torch_version : "";
  if (major_minor(torch_version) != major_minor(TORCH_VERSION))
    throw Error("plugin " + path.string() + " was built against LibTorch " +
                (torch_version.empty() ? "(unknown)" : torch_version) +
                " but fusebox runs LibTorch " TORCH_VERSION
                ": rebuild the plugin against the same LibTorch");
  if (!d->name || !*d->name || !d->create || !d->declare_schema)
    throw Error("plugin " + path.string() +
                " has an incomplete descriptor (name, schema or factory"
                " missing)");

  PluginInfo info;
  info.name = d->name;
  info.version = d->version ? d->version : "";
  info.description = d->description ? d->description : "";
  info.torch_version = torch_version;
  info.path = canonical;
  info.capabilities = d->capabilities;
  info.api_major = d->api_major;
  info.api_minor = d->api_minor;
  auto plugin = std::make_shared<LoadedPlugin>(std::shared_ptr<void>(library), d, std::move(info));
  cache_[key] = plugin;
  return plugin;
}

std::shared_ptr<LoadedPlugin> PluginRegistry::load_file(const std::string& spec) {
  if (spec.find('/') != std::string::npos) return load_path(spec);
  std::vector<std::string> seen;
  for (const fs::path& dir : search_path()) {
    fs::path candidate = dir / spec;
    std::error_code ec;
    if (fs::exists(candidate, ec)) return load_path(candidate);
    for (const auto& entry : fs::directory_iterator(dir, ec))
      if (entry.path().extension() == ".so") seen.push_back(entry.path().filename().string());
  }
  std::string dirs;
  for (const fs::path& d : search_path()) dirs += (dirs.empty() ? "" : ", ") + d.string();
  throw Error("plugin file " + spec + " not found in the plugin search path (" + dirs + ")" +
              did_you_mean(spec, seen) +
              "; pass a path, or add its folder to the search path (LoaderOptions::plugin_dirs, "
              "FUSEBOX_PLUGIN_PATH, the trainer's --plugin-dir)");
}

std::vector<std::shared_ptr<LoadedPlugin>> PluginRegistry::list(std::vector<BrokenPlugin>* broken) {
  return scan(broken, nullptr);
}

std::vector<std::shared_ptr<LoadedPlugin>> PluginRegistry::scan(
    std::vector<BrokenPlugin>* broken, std::map<std::string, std::string>* clashes) {
  std::map<std::string, std::shared_ptr<LoadedPlugin>> by_name;
  std::map<std::string, std::string> clash;  // name -> the error naming both files
  std::set<fs::path> visited_dirs;
  for (const fs::path& dir : search_path()) {
    std::error_code ec;
    fs::path canon_dir = fs::weakly_canonical(dir, ec);
    if (!visited_dirs.insert(ec ? dir : canon_dir).second) continue;  // same folder twice
    std::vector<fs::path> files;
    for (const auto& entry : fs::directory_iterator(dir, ec))
      if (entry.path().extension() == ".so") files.push_back(entry.path());
    std::sort(files.begin(), files.end());
    for (const fs::path& file : files) {
      std::shared_ptr<LoadedPlugin> p;
      try {
        p = load_path(file);
      } catch (const Error& e) {
        if (broken) broken->push_back({file, e.what()});
        continue;
      }
      auto [it, inserted] = by_name.emplace(p->info().name, p);
      if (!inserted && it->second->info().path != p->info().path) {
        const std::string error =
            "two plugins are named '" + p->info().name + "': " + it->second->info().path.string() +
            " and " + p->info().path.string() +
            "; remove one or load it by path (the trainer's --optimizer-plugin PATH)";
        clash.emplace(p->info().name, error);
        if (broken) broken->push_back({file, error});
      }
    }
  }
  // A name two files share selects neither; other plugins stay usable by name.
  std::vector<std::shared_ptr<LoadedPlugin>> out;
  for (auto& kv : by_name)
    if (!clash.count(kv.first)) out.push_back(kv.second);
  if (clashes) *clashes = std::move(clash);
  return out;
}

std::shared_ptr<LoadedPlugin> PluginRegistry::load_by_name(const std::string& name) {
  std::vector<BrokenPlugin> broken;
  std::map<std::string, std::string> clashes;
  std::vector<std::string> names;
  const auto plugins = scan(&broken, &clashes);
  if (auto it = clashes.find(name); it != clashes.end()) throw Error(it->second);
  for (const auto& p : plugins) {
    if (p->info().name == name) return p;
    names.push_back(p->info().name);
  }
  std::string msg = "no plugin named '" + name + "' in the plugin search path" +
                    did_you_mean(name, names) + "; see trainer --list-plugins";
  if (!broken.empty())
    msg += " (" + std::to_string(broken.size()) + " file(s) could not be loaded, e.g. " +
           broken.front().error + ")";
  throw Error(msg);
}

}  // namespace fusebox
