// mlx_utils.h: the part of MLX's kernels/utils.h (prepended to every custom kernel on Metal) that
// custom kernels commonly use.
#pragma once

// ---- the subset of MLX's kernels/utils.h that custom kernels commonly use ---------------------
template <typename U> struct Limits;
#define RL_LIMITS_INT(T)                                                  \
  template <> struct Limits<T> {                                          \
    static constexpr constant T max = metal::numeric_limits<T>::max();    \
    static constexpr constant T min = metal::numeric_limits<T>::min();    \
    static constexpr constant T finite_max = metal::numeric_limits<T>::max(); \
    static constexpr constant T finite_min = metal::numeric_limits<T>::min(); \
  };
RL_LIMITS_INT(uint8_t)
RL_LIMITS_INT(uint16_t)
RL_LIMITS_INT(uint32_t)
RL_LIMITS_INT(uint64_t)
RL_LIMITS_INT(int8_t)
RL_LIMITS_INT(int16_t)
RL_LIMITS_INT(int32_t)
RL_LIMITS_INT(int64_t)
#undef RL_LIMITS_INT
#define RL_LIMITS_FLOAT(T)                                                  \
  template <> struct Limits<T> {                                            \
    static constexpr constant T max = metal::numeric_limits<T>::infinity(); \
    static constexpr constant T min = -metal::numeric_limits<T>::infinity(); \
    static constexpr constant T finite_max = metal::numeric_limits<T>::max(); \
    static constexpr constant T finite_min = -metal::numeric_limits<T>::max(); \
  };
RL_LIMITS_FLOAT(half)
RL_LIMITS_FLOAT(float)
RL_LIMITS_FLOAT(bfloat16_t)
#undef RL_LIMITS_FLOAT
template <> struct Limits<bool> {
  static constexpr constant bool max = true;
  static constexpr constant bool min = false;
};

template <typename IdxT = int64_t>
METAL_FUNC IdxT elem_to_loc(IdxT elem, constant const int* shape, constant const int64_t* strides, int ndim) {
  IdxT loc = 0;
  for (int i = ndim - 1; i >= 0 && elem > 0; --i) {
    loc += (elem % shape[i]) * IdxT(strides[i]);
    elem /= shape[i];
  }
  return loc;
}
template <typename IdxT = int64_t>
METAL_FUNC IdxT elem_to_loc(uint3 elem, constant const int* shape, constant const int64_t* strides, int ndim) {
  IdxT loc = elem.x * IdxT(strides[ndim - 1]) + elem.y * IdxT(strides[ndim - 2]);
  for (int d = ndim - 3; d >= 0; --d) {
    loc += (elem.z % shape[d]) * IdxT(strides[d]);
    elem.z /= shape[d];
  }
  return loc;
}
inline size_t ceildiv(size_t n, size_t m) { return (n + m - 1) / m; }
inline float log1p(float x) {
  float xp1 = 1.0f + x;
  return (xp1 == 1.0f) ? x : x * (metal::log(xp1) / (xp1 - 1.0f));
}
inline bfloat16_t log1p(bfloat16_t x) { return (bfloat16_t)log1p((float)x); }
