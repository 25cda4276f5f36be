// msl_sync.h: atomics, barriers and SIMD-group operations for the shim (see shim.h). Barriers and
// SIMD-group operations are rendezvous in the fiber runtime (runtime.cpp).
#pragma once

namespace metal {
// ---- atomics (fibers interleave only at barriers, so plain read-modify-write is atomic) ------
enum memory_order { memory_order_relaxed, memory_order_acquire, memory_order_release,
                    memory_order_acq_rel, memory_order_seq_cst };
template <class T> struct atomic {
  T __value;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;
typedef atomic<bool> atomic_bool;
typedef atomic<long> atomic_long;
typedef atomic<ulong> atomic_ulong;

#define RL_ATOMIC_RMW(name, expr)                                                          \
  template <class T>                                                                        \
  METAL_FUNC T atomic_fetch_##name##_explicit(volatile atomic<T>* o,                        \
                                               typename ::rl::identity<T>::type v,          \
                                               memory_order) {                              \
    T old = o->__value;                                                                     \
    o->__value = (expr);                                                                    \
    return old;                                                                             \
  }
RL_ATOMIC_RMW(add, old + v)
RL_ATOMIC_RMW(sub, old - v)
RL_ATOMIC_RMW(max, max(old, v))
RL_ATOMIC_RMW(min, min(old, v))
RL_ATOMIC_RMW(and, old & v)
RL_ATOMIC_RMW(or, old | v)
RL_ATOMIC_RMW(xor, old ^ v)
#undef RL_ATOMIC_RMW
template <class T> METAL_FUNC T atomic_load_explicit(volatile atomic<T>* o, memory_order) { return o->__value; }
template <class T>
METAL_FUNC void atomic_store_explicit(volatile atomic<T>* o, typename ::rl::identity<T>::type v, memory_order) {
  o->__value = v;
}
template <class T>
METAL_FUNC T atomic_exchange_explicit(volatile atomic<T>* o, typename ::rl::identity<T>::type v, memory_order) {
  T old = o->__value;
  o->__value = v;
  return old;
}
template <class T>
METAL_FUNC bool atomic_compare_exchange_weak_explicit(volatile atomic<T>* o, thread T* expected,
                                                      typename ::rl::identity<T>::type desired,
                                                      memory_order, memory_order) {
  if (o->__value == *expected) {
    o->__value = desired;
    return true;
  }
  *expected = o->__value;
  return false;
}

// ---- barriers --------------------------------------------------------------------------------
enum class mem_flags : int { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4,
                             mem_threadgroup_imageblock = 8, mem_object_data = 16 };
METAL_FUNC mem_flags operator|(mem_flags a, mem_flags b) { return (mem_flags)((int)a | (int)b); }
METAL_FUNC void threadgroup_barrier(mem_flags, int line = __builtin_LINE()) { rl_threadgroup_barrier(line); }
}  // namespace metal

// ---- SIMD-group operations ---------------------------------------------------------------------
namespace rl {
enum SimdOp {
  OP_BARRIER = 1, OP_SUM, OP_PRODUCT, OP_MAX, OP_MIN, OP_AND, OP_OR, OP_XOR,
  OP_PREFIX_INCLUSIVE_SUM, OP_PREFIX_EXCLUSIVE_SUM, OP_PREFIX_INCLUSIVE_PRODUCT,
  OP_PREFIX_EXCLUSIVE_PRODUCT, OP_SHUFFLE, OP_SHUFFLE_XOR, OP_SHUFFLE_UP, OP_SHUFFLE_DOWN,
  OP_SHUFFLE_ROTATE_UP, OP_SHUFFLE_ROTATE_DOWN, OP_BROADCAST, OP_BROADCAST_FIRST, OP_ALL, OP_ANY,
  OP_BALLOT, OP_IS_FIRST, OP_QUAD_SUM, OP_QUAD_MAX, OP_QUAD_MIN, OP_QUAD_SHUFFLE,
  OP_QUAD_SHUFFLE_XOR, OP_QUAD_SHUFFLE_UP, OP_QUAD_SHUFFLE_DOWN, OP_QUAD_BROADCAST,
};

template <class T> inline T poison() {
  T r;
  __builtin_memset((void*)&r, 0xFF, sizeof(T));  // reading an inactive lane is undefined on Metal
  return r;
}

template <class T, int OP> inline T simd_apply(const T* in, const bool* act, int first, int l, uint32_t arg) {
  constexpr int W = RL_SIMD_WIDTH;
  using E = elem_t<T>;
  if constexpr (OP == OP_SUM || OP == OP_PREFIX_INCLUSIVE_SUM || OP == OP_PREFIX_EXCLUSIVE_SUM) {
    int end = OP == OP_SUM ? W : OP == OP_PREFIX_INCLUSIVE_SUM ? l + 1 : l;
    T r = (E)0;
    for (int i = 0; i < end; ++i)
      if (act[i]) r = r + in[i];
    return r;
  } else if constexpr (OP == OP_PRODUCT || OP == OP_PREFIX_INCLUSIVE_PRODUCT ||
                       OP == OP_PREFIX_EXCLUSIVE_PRODUCT) {
    int end = OP == OP_PRODUCT ? W : OP == OP_PREFIX_INCLUSIVE_PRODUCT ? l + 1 : l;
    T r = (E)1;
    for (int i = 0; i < end; ++i)
      if (act[i]) r = r * in[i];
    return r;
  } else if constexpr (OP == OP_MAX || OP == OP_MIN || OP == OP_AND || OP == OP_OR || OP == OP_XOR) {
    T r = in[first];
    for (int i = first + 1; i < W; ++i) {
      if (!act[i]) continue;
      if constexpr (OP == OP_MAX) r = ::metal::max(r, in[i]);
      if constexpr (OP == OP_MIN) r = ::metal::min(r, in[i]);
      if constexpr (OP == OP_AND) r = r & in[i];
      if constexpr (OP == OP_OR) r = r | in[i];
      if constexpr (OP == OP_XOR) r = r ^ in[i];
    }
    return r;
  } else if constexpr (OP == OP_QUAD_SUM || OP == OP_QUAD_MAX || OP == OP_QUAD_MIN) {
    int q = l & ~3;
    T r = in[l];
    bool have = false;
    for (int i = q; i < q + 4; ++i) {
      if (!act[i]) continue;
      if (!have) {
        r = in[i];
        have = true;
        continue;
      }
      if constexpr (OP == OP_QUAD_SUM) r = r + in[i];
      if constexpr (OP == OP_QUAD_MAX) r = ::metal::max(r, in[i]);
      if constexpr (OP == OP_QUAD_MIN) r = ::metal::min(r, in[i]);
    }
    return r;
  } else if constexpr (OP == OP_ALL || OP == OP_ANY) {
    for (int i = 0; i < W; ++i)
      if (act[i] && (OP == OP_ALL ? !in[i] : (bool)in[i])) return OP != OP_ALL;
    return OP == OP_ALL;
  } else if constexpr (OP == OP_BALLOT) {
    uint64_t m = 0;
    for (int i = 0; i < W; ++i)
      if (act[i] && in[i]) m |= 1ull << i;
    return (T)m;
  } else if constexpr (OP == OP_IS_FIRST) {
    return (T)(l == first);
  } else if constexpr (OP == OP_BROADCAST_FIRST) {
    return in[first];
  } else if constexpr (OP == OP_BARRIER) {
    return in[l];
  } else {
    int src = -1;  // shuffles: the lane to read; lanes that keep their own value use src = l
    if constexpr (OP == OP_SHUFFLE || OP == OP_BROADCAST) src = (int)arg;
    if constexpr (OP == OP_SHUFFLE_XOR) src = l ^ (int)arg;
    if constexpr (OP == OP_SHUFFLE_UP) src = l >= (int)arg ? l - (int)arg : l;
    if constexpr (OP == OP_SHUFFLE_DOWN) src = l + (int)arg < W ? l + (int)arg : l;
    if constexpr (OP == OP_SHUFFLE_ROTATE_UP) src = (l - (int)(arg % W) + W) % W;
    if constexpr (OP == OP_SHUFFLE_ROTATE_DOWN) src = (l + (int)arg) % W;
    if constexpr (OP == OP_QUAD_SHUFFLE || OP == OP_QUAD_BROADCAST) src = (l & ~3) + (int)(arg & 3);
    if constexpr (OP == OP_QUAD_SHUFFLE_XOR) src = (l & ~3) + ((l ^ (int)arg) & 3);
    if constexpr (OP == OP_QUAD_SHUFFLE_UP) src = (l & 3) >= (int)arg ? l - (int)arg : l;
    if constexpr (OP == OP_QUAD_SHUFFLE_DOWN) src = (l & 3) + (int)arg < 4 ? l + (int)arg : l;
    if (src < 0 || src >= W || !act[src]) return poison<T>();
    return in[src];
  }
}

template <class T, int OP> void simd_compute(rl_simd_group* g) {
  T in[RL_SIMD_WIDTH];
  bool act[RL_SIMD_WIDTH];
  int first = -1;
  for (int l = 0; l < RL_SIMD_WIDTH; ++l) {
    act[l] = g->waiting[l] != 0;
    if (act[l]) {
      __builtin_memcpy((void*)&in[l], g->slot[l].in, sizeof(T));
      if (first < 0) first = l;
    }
  }
  for (int l = 0; l < RL_SIMD_WIDTH; ++l) {
    if (!act[l]) continue;
    T r = simd_apply<T, OP>(in, act, first, l, g->slot[l].arg);
    __builtin_memcpy(g->slot[l].out, (const void*)&r, sizeof(T));
  }
}

template <class R, class T, int OP> inline R simd_call(T x, uint32_t arg, const char* name, int line) {
  static_assert(sizeof(T) <= RL_SLOT_BYTES && sizeof(R) <= RL_SLOT_BYTES, "SIMD operand too large");
  rl_simd_slot* s = rl_simd_exchange((const void*)&x, sizeof(T), arg, OP, name, line,
                                     (rl_simd_fn)&simd_compute<T, OP>);
  T r;
  __builtin_memcpy((void*)&r, s->out, sizeof(T));
  return (R)r;
}

inline void tg_register(void* p, size_t n, const char* name, int line) {
  rl_threadgroup_register(p, n, name, line);
}
}  // namespace rl

namespace metal {
struct simd_vote {
  typedef uint64_t vote_t;
  vote_t v;
  explicit constexpr simd_vote(vote_t x = 0) : v(x) {}
  explicit constexpr operator vote_t() const { return v; }
  constexpr bool all() const { return v == ~0ull; }
  constexpr bool any() const { return v != 0; }
};

#define RL_LINE int rl_line = __builtin_LINE()
#define RL_SIMD1(name, OP) \
  template <class T> METAL_FUNC T name(T x, RL_LINE) { return ::rl::simd_call<T, T, ::rl::OP>(x, 0, #name, rl_line); }
#define RL_SIMD2(name, OP)                                                               \
  template <class T> METAL_FUNC T name(T x, ushort a, RL_LINE) {                         \
    return ::rl::simd_call<T, T, ::rl::OP>(x, a, #name, rl_line);                        \
  }
RL_SIMD1(simd_sum, OP_SUM)
RL_SIMD1(simd_product, OP_PRODUCT)
RL_SIMD1(simd_max, OP_MAX)
RL_SIMD1(simd_min, OP_MIN)
RL_SIMD1(simd_and, OP_AND)
RL_SIMD1(simd_or, OP_OR)
RL_SIMD1(simd_xor, OP_XOR)
RL_SIMD1(simd_prefix_inclusive_sum, OP_PREFIX_INCLUSIVE_SUM)
RL_SIMD1(simd_prefix_exclusive_sum, OP_PREFIX_EXCLUSIVE_SUM)
RL_SIMD1(simd_prefix_inclusive_product, OP_PREFIX_INCLUSIVE_PRODUCT)
RL_SIMD1(simd_prefix_exclusive_product, OP_PREFIX_EXCLUSIVE_PRODUCT)
RL_SIMD1(simd_broadcast_first, OP_BROADCAST_FIRST)
RL_SIMD2(simd_shuffle, OP_SHUFFLE)
RL_SIMD2(simd_shuffle_xor, OP_SHUFFLE_XOR)
RL_SIMD2(simd_shuffle_up, OP_SHUFFLE_UP)
RL_SIMD2(simd_shuffle_down, OP_SHUFFLE_DOWN)
RL_SIMD2(simd_shuffle_rotate_up, OP_SHUFFLE_ROTATE_UP)
RL_SIMD2(simd_shuffle_rotate_down, OP_SHUFFLE_ROTATE_DOWN)
RL_SIMD2(simd_broadcast, OP_BROADCAST)
RL_SIMD1(quad_sum, OP_QUAD_SUM)
RL_SIMD1(quad_max, OP_QUAD_MAX)
RL_SIMD1(quad_min, OP_QUAD_MIN)
RL_SIMD2(quad_shuffle, OP_QUAD_SHUFFLE)
RL_SIMD2(quad_shuffle_xor, OP_QUAD_SHUFFLE_XOR)
RL_SIMD2(quad_shuffle_up, OP_QUAD_SHUFFLE_UP)
RL_SIMD2(quad_shuffle_down, OP_QUAD_SHUFFLE_DOWN)
RL_SIMD2(quad_broadcast, OP_QUAD_BROADCAST)
#undef RL_SIMD1
#undef RL_SIMD2
METAL_FUNC bool simd_all(bool x, RL_LINE) { return ::rl::simd_call<bool, bool, ::rl::OP_ALL>(x, 0, "simd_all", rl_line); }
METAL_FUNC bool simd_any(bool x, RL_LINE) { return ::rl::simd_call<bool, bool, ::rl::OP_ANY>(x, 0, "simd_any", rl_line); }
METAL_FUNC simd_vote simd_ballot(bool x, RL_LINE) {
  return simd_vote(::rl::simd_call<uint64_t, uint64_t, ::rl::OP_BALLOT>((uint64_t)x, 0, "simd_ballot", rl_line));
}
METAL_FUNC simd_vote simd_active_threads_mask(RL_LINE) {
  return simd_vote(::rl::simd_call<uint64_t, uint64_t, ::rl::OP_BALLOT>(1ull, 0, "simd_active_threads_mask", rl_line));
}
METAL_FUNC bool simd_is_first(RL_LINE) { return ::rl::simd_call<bool, bool, ::rl::OP_IS_FIRST>(true, 0, "simd_is_first", rl_line); }
METAL_FUNC void simdgroup_barrier(mem_flags, RL_LINE) {
  ::rl::simd_call<int, int, ::rl::OP_BARRIER>(0, 0, "simdgroup_barrier", rl_line);
}
#undef RL_LINE
}  // namespace metal
