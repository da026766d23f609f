// Cores and memory this process may use: affinity, cgroup v1/v2 quotas and limits.
#include "fusebox/core/host_resources.h"

#include <dlfcn.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

namespace fusebox::host {

namespace {

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  if (!in) return "";
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Mount points in mountinfo escape space, tab, newline and backslash as \ooo.
std::string unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size() && std::isdigit(static_cast<unsigned char>(s[i + 1]))) {
      out += static_cast<char>(std::strtol(s.substr(i + 1, 3).c_str(), nullptr, 8));
      i += 3;
    } else {
      out += s[i];
    }
  }
  return out;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  std::string part;
  std::istringstream in(s);
  while (std::getline(in, part, sep)) parts.push_back(part);
  return parts;
}

bool contains(const std::vector<std::string>& items, const std::string& item) {
  return std::find(items.begin(), items.end(), item) != items.end();
}

// The folders of this process's cgroup that hold `controller`'s files, innermost first up to
// the mount point: for cgroup v1 the hierarchy that has the controller, for v2 the unified one.
// A limit set on any ancestor applies too, so callers read every folder.
std::vector<std::string> cgroup_folders(const CgroupSources& src, const std::string& controller,
                                        bool v2) {
  // /proc/self/cgroup: "ID:CONTROLLERS:PATH"; v2's line is "0::PATH".
  std::string path;
  bool found = false;
  for (const std::string& line : split(read_text(src.cgroup), '\n')) {
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1);
    if (v2 ? (line.substr(0, a) == "0" && controllers.empty())
           : contains(split(controllers, ','), controller)) {
      path = line.substr(b + 1), found = true;
      break;
    }
  }
  // Only an absolute path without ".." names a place in the hierarchy.
  if (!found || path.empty() || path[0] != '/' || path.find("/..") != std::string::npos) return {};
  // /proc/self/mountinfo: "ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - TYPE SOURCE
  // SUPEROPTIONS"; a v1 hierarchy names its controllers among the super options. A mount shows
  // the subtree at its ROOT: the one whose root is the longest prefix of the path shows the
  // cgroup; where none contains it, no folder of this process's cgroup is visible.
  std::string best_mount, best_rel;
  size_t best_root = 0;
  bool any = false;
  for (const std::string& line : split(read_text(src.mountinfo), '\n')) {
    std::vector<std::string> f;
    std::istringstream in(line);
    for (std::string w; in >> w;) f.push_back(w);
    const auto dash = std::find(f.begin(), f.end(), "-");
    if (f.size() < 5 || dash == f.end() || f.end() - dash < 4) continue;
    const std::string type = *(dash + 1);
    if (v2 ? type != "cgroup2" : type != "cgroup" || !contains(split(*(dash + 3), ','), controller))
      continue;
    std::string root = unescape(f[3]);
    if (root.size() > 1 && root.back() == '/') root.pop_back();
    const bool inside = root == "/" || (path.compare(0, root.size(), root) == 0 &&
                                        (path.size() == root.size() || path[root.size()] == '/'));
    if (!inside || (any && root.size() <= best_root)) continue;
    any = true, best_root = root.size();
    best_mount = src.root + unescape(f[4]);
    best_rel = root == "/" ? path : path.substr(root.size());
  }
  if (!any) return {};
  std::vector<std::string> folders;
  for (std::string rel = best_rel; !rel.empty() && rel != "/";) {
    folders.push_back(best_mount + rel);
    rel.erase(rel.find_last_of('/'));  // rel starts with '/': there is always one
  }
  folders.push_back(best_mount);
  return folders;
}

// A whole number from a cgroup file, or nullopt-like false for "max", "-1" or nothing.
bool read_number(const std::string& file, int64_t& out) {
  std::istringstream in(read_text(file));
  std::string word;
  if (!(in >> word)) return false;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(word.c_str(), &end, 10);
  if (errno != 0 || end == word.c_str() || *end != '\0' || v <= 0) return false;
  out = v;
  return true;
}

// v1 writes "no limit" as the largest page-aligned long (9223372036854771712).
constexpr int64_t kNoLimit = int64_t{1} << 62;

}  // namespace

MemoryLimit cgroup_memory_limit(const CgroupSources& sources) {
  MemoryLimit lowest;
  const auto consider = [&](const std::string& file) {
    int64_t v = 0;
    if (read_number(file, v) && v < kNoLimit && (lowest.bytes == 0 || v < lowest.bytes))
      lowest.bytes = v, lowest.cgroup_file = file;
  };
  for (const std::string& d : cgroup_folders(sources, "memory", true)) consider(d + "/memory.max");
  for (const std::string& d : cgroup_folders(sources, "memory", false))
    consider(d + "/memory.limit_in_bytes");
  return lowest;
}

MemoryLimit usable_memory() {
  MemoryLimit m;
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) m.bytes = static_cast<int64_t>(pages) * page;
  const MemoryLimit cgroup = cgroup_memory_limit();
  if (cgroup.bytes > 0 && (m.bytes == 0 || cgroup.bytes < m.bytes)) m = cgroup;
  return m;
}

namespace {

// The number after `key` in a "key value" listing (memory.stat, /proc/meminfo's "Key: N kB").
bool read_field(const std::string& text, const std::string& key, int64_t& out) {
  std::istringstream in(text);
  std::string k;
  long long v = 0;
  for (std::string line; std::getline(in, line);) {
    std::istringstream fields(line);
    if (fields >> k >> v && k == key && v >= 0) {
      out = v;
      return true;
    }
  }
  return false;
}

}  // namespace

int64_t available_memory(const CgroupSources& sources, const std::string& meminfo) {
  int64_t lowest = -1;
  const std::string info = read_text(meminfo);
  int64_t avail_kib = 0, swap_kib = 0;
  if (read_field(info, "MemAvailable:", avail_kib)) {
    read_field(info, "SwapFree:", swap_kib);
    lowest = (avail_kib + swap_kib) * 1024;
  }
  // The page cache charged to a cgroup (active and inactive file pages) is given back under
  // pressure before the cgroup's out-of-memory killer acts.
  const auto consider = [&](const std::string& dir, const char* limit_file, const char* usage_file,
                            const char* active_key, const char* inactive_key) {
    int64_t limit = 0, usage = 0, active = 0, inactive = 0;
    if (!read_number(dir + limit_file, limit) || limit >= kNoLimit) return;
    if (!read_number(dir + usage_file, usage)) usage = 0;  // 0 reads as "none" too
    const std::string stat = read_text(dir + "/memory.stat");
    read_field(stat, active_key, active);
    read_field(stat, inactive_key, inactive);
    const int64_t headroom =
        std::max<int64_t>(0, limit - usage + std::min(active + inactive, usage));
    if (lowest < 0 || headroom < lowest) lowest = headroom;
  };
  for (const std::string& d : cgroup_folders(sources, "memory", true))
    consider(d, "/memory.max", "/memory.current", "active_file", "inactive_file");
  for (const std::string& d : cgroup_folders(sources, "memory", false))
    consider(d, "/memory.limit_in_bytes", "/memory.usage_in_bytes", "total_active_file",
             "total_inactive_file");
  return lowest;
}

double cgroup_cpu_quota(const CgroupSources& sources) {
  double lowest = 0;
  const auto consider = [&](int64_t quota, int64_t period) {
    const double cores = static_cast<double>(quota) / static_cast<double>(period);
    if (lowest == 0 || cores < lowest) lowest = cores;
  };
  // v2: cpu.max is "QUOTA PERIOD" or "max PERIOD".
  for (const std::string& d : cgroup_folders(sources, "cpu", true)) {
    std::istringstream in(read_text(d + "/cpu.max"));
    std::string quota, period;
    if (!(in >> quota >> period) || quota == "max") continue;
    char *qe = nullptr, *pe = nullptr;
    const long long q = std::strtoll(quota.c_str(), &qe, 10),
                    p = std::strtoll(period.c_str(), &pe, 10);
    if (*qe == '\0' && *pe == '\0' && q > 0 && p > 0) consider(q, p);
  }
  // v1: cpu.cfs_quota_us (-1: none) over cpu.cfs_period_us.
  for (const std::string& d : cgroup_folders(sources, "cpu", false)) {
    int64_t q = 0, p = 0;
    if (read_number(d + "/cpu.cfs_quota_us", q) && read_number(d + "/cpu.cfs_period_us", p))
      consider(q, p);
  }
  return lowest;
}

int usable_cores() {
  int cores = 0;
  // LibTorch's OpenMP (libgomp) pins the thread that loads it to one core when OMP_PROC_BIND or
  // OMP_PLACES is set, so this thread's mask may be one core; libgomp's own count is of the mask
  // the process started with (taskset, a cpuset), read before it pinned anything.
  using NumProcs = int (*)();
  if (const auto omp_procs = reinterpret_cast<NumProcs>(::dlsym(RTLD_DEFAULT, "omp_get_num_procs")))
    cores = omp_procs();
  // Without OpenMP: this thread's affinity mask, in a set large enough for any machine.
  const int configured = std::max<int>(static_cast<int>(::sysconf(_SC_NPROCESSORS_CONF)),
                                       static_cast<int>(std::thread::hardware_concurrency()));
  for (int size = std::max(configured, 1024); size <= (1 << 20) && cores <= 0; size *= 2) {
    cpu_set_t* set = CPU_ALLOC(size);
    if (!set) break;
    const size_t bytes = CPU_ALLOC_SIZE(size);
    CPU_ZERO_S(bytes, set);
    const bool ok = ::sched_getaffinity(0, bytes, set) == 0;
    const int error = errno;  // before free() may change it
    if (ok) cores = CPU_COUNT_S(bytes, set);
    CPU_FREE(set);
    if (ok || error != EINVAL) break;
  }
  if (cores <= 0) cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (const double quota = cgroup_cpu_quota(); quota > 0)
    cores = std::min(cores, std::max(1, static_cast<int>(std::ceil(quota - 1e-9))));
  return std::max(1, cores);
}

}  // namespace fusebox::host
