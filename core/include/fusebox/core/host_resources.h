// What this process may use of the machine: cores and memory.
//
// Containers and batch schedulers give a process less than the machine has: a CPU affinity mask
// (taskset, cpusets), a cgroup CPU quota (docker --cpus, Kubernetes limits) and a cgroup memory
// limit. Thread pools sized by the machine's core count then oversubscribe the cores they may
// run on, and a model sized by the machine's memory is killed by the OOM killer instead of being
// refused with a message. Both cgroup versions are read (v1 and v2, also side by side), on the
// process's own cgroup and every ancestor, since a limit anywhere above applies too.
#pragma once

#include <cstdint>
#include <string>

namespace fusebox::host {

/// Where the cgroup description is read from. Tests point these at a made-up tree: `root` is
/// put before every cgroup folder named by the mount table.
struct CgroupSources {
  std::string mountinfo = "/proc/self/mountinfo";
  std::string cgroup = "/proc/self/cgroup";
  std::string root;
};

/// A memory limit and where it comes from.
struct MemoryLimit {
  int64_t bytes = 0;        ///< 0: unknown
  std::string cgroup_file;  ///< the cgroup file that sets it; empty: the machine's memory
};

/// The lowest cgroup memory limit on this process (v2 memory.max, v1 memory.limit_in_bytes), or
/// bytes = 0 when no cgroup limits it.
MemoryLimit cgroup_memory_limit(const CgroupSources& sources = {});

/// The machine's physical memory, or a lower cgroup memory limit.
MemoryLimit usable_memory();

/// The memory this process could still take now without the kernel's out-of-memory killer: the
/// machine's MemAvailable plus free swap (`meminfo`), lowered to the headroom of every cgroup with
/// a memory limit above this process (limit - usage + its page cache, which is reclaimable; v2
/// memory.max/current/stat, v1 memory.limit_in_bytes/usage_in_bytes/stat). -1 when unknown.
int64_t available_memory(const CgroupSources& sources = {},
                         const std::string& meminfo = "/proc/meminfo");

/// The lowest cgroup CPU quota on this process in cores (v2 cpu.max, v1 cpu.cfs_quota_us over
/// cpu.cfs_period_us; 1.5 = one and a half cores), or 0 when no quota applies.
double cgroup_cpu_quota(const CgroupSources& sources = {});

/// The cores this process may run on (the affinity mask it started with, as OpenMP counts it
/// where OpenMP is loaded), lowered to a cgroup CPU quota rounded up; at least 1.
int usable_cores();

}  // namespace fusebox::host
