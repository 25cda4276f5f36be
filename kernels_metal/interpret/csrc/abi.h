// abi.h: the C interface between a compiled kernel (kernel TU: shim.h + MSL source) and the
// fiber runtime (runtime.cpp). Plain C types only; both TUs and kernel.py's ctypes mirror it.
#pragma once
#include <stddef.h>
#include <stdint.h>

#define RL_SIMD_WIDTH 32
#define RL_MAX_THREADS 1024
#define RL_SLOT_BYTES 64

extern "C" {

// One launch, filled by kernel.py (keep the field order in sync with LaunchArgs there).
struct rl_launch_args {
  void** buffers;         // kernel parameters in signature order (arrays, shapes, strides, ndims)
  int64_t grid[3];        // in threads, as MLX's dispatchThreads
  int64_t threadgroup[3];
  int64_t stack_size;     // bytes per fiber
  int64_t order;          // 0: alternate forward/reverse per threadgroup, 1: forward, 2: reverse
  int64_t poison_byte;    // fills threadgroup memory before each threadgroup
  char* err;              // message on failure
  int64_t err_len;
};

// Every attribute MLX can put in a signature, for the running thread.
struct rl_thread {
  uint32_t thread_position_in_grid[3];
  uint32_t threadgroup_position_in_grid[3];
  uint32_t thread_position_in_threadgroup[3];
  uint32_t threads_per_threadgroup[3];           // this group's size: edge groups are smaller
  uint32_t dispatch_threads_per_threadgroup[3];  // the size asked for at dispatch
  uint32_t threadgroups_per_grid[3];
  uint32_t threads_per_grid[3];
  uint32_t grid_origin[3];
  uint32_t thread_index_in_threadgroup;
  uint32_t thread_index_in_simdgroup;
  uint32_t simdgroup_index_in_threadgroup;
  uint32_t simdgroups_per_threadgroup;
  uint32_t dispatch_simdgroups_per_threadgroup;
  uint32_t thread_index_in_quadgroup;
  uint32_t quadgroup_index_in_threadgroup;
  uint32_t quadgroups_per_threadgroup;
  uint32_t dispatch_quadgroups_per_threadgroup;
  uint32_t threads_per_simdgroup;
  uint32_t thread_execution_width;
};

struct rl_simd_slot {
  alignas(16) unsigned char in[RL_SLOT_BYTES];
  alignas(16) unsigned char out[RL_SLOT_BYTES];
  uint32_t arg;
};

struct rl_simd_group;
typedef void (*rl_simd_fn)(struct rl_simd_group*);

// A SIMD-group operation is a rendezvous: each lane deposits `in` (and `arg`), the last live lane
// to arrive runs `fn`, which fills `out` for every lane in `waiting` (the active lanes).
struct rl_simd_group {
  int live;     // lanes that exist and have not returned
  int arrived;  // lanes waiting at the current operation
  int op;
  int line;
  const char* name;
  rl_simd_fn fn;
  unsigned char waiting[RL_SIMD_WIDTH];
  struct rl_simd_slot slot[RL_SIMD_WIDTH];
};

typedef void (*rl_entry_fn)(void** buffers);

int rl_run(struct rl_launch_args* args, rl_entry_fn entry);
int rl_run_isolated(struct rl_launch_args* args, rl_entry_fn entry, double timeout_s);

const struct rl_thread* rl_current(void);
void rl_threadgroup_barrier(int line);
// Blocks until the SIMD-group's live lanes arrived; returns this lane's slot (read `out`).
struct rl_simd_slot* rl_simd_exchange(const void* in, uint32_t size, uint32_t arg, int op,
                                      const char* name, int line, rl_simd_fn fn);
void rl_threadgroup_register(void* p, size_t n, const char* name, int line);
[[noreturn]] void rl_fail(const char* fmt, ...);
}
