// msl_math.h: metal_stdlib's math, limits and conversions for the shim (see shim.h).
#pragma once

// ---- metal_stdlib ----------------------------------------------------------------------------
namespace metal {
template <class T, int N> using vec = T __attribute__((ext_vector_type(N)));

template <class T> struct numeric_limits;
#define RL_INT_LIMITS(T, lo, hi)                                     \
  template <> struct numeric_limits<T> {                             \
    static constexpr bool is_specialized = true;                     \
    static constexpr T min() { return (T)(lo); }                     \
    static constexpr T max() { return (T)(hi); }                     \
    static constexpr T lowest() { return (T)(lo); }                  \
  };
RL_INT_LIMITS(bool, 0, 1)
RL_INT_LIMITS(char, -128, 127)
RL_INT_LIMITS(signed char, -128, 127)
RL_INT_LIMITS(uchar, 0, 255)
RL_INT_LIMITS(short, -32768, 32767)
RL_INT_LIMITS(ushort, 0, 65535)
RL_INT_LIMITS(int, -2147483647 - 1, 2147483647)
RL_INT_LIMITS(uint, 0, 4294967295u)
RL_INT_LIMITS(long, -9223372036854775807l - 1, 9223372036854775807l)
RL_INT_LIMITS(ulong, 0, 18446744073709551615ul)
RL_INT_LIMITS(long long, -9223372036854775807ll - 1, 9223372036854775807ll)
RL_INT_LIMITS(unsigned long long, 0, 18446744073709551615ull)
#undef RL_INT_LIMITS
#define RL_FLOAT_LIMITS(T, bits_t, minb, maxb, epsb)                                  \
  template <> struct numeric_limits<T> {                                              \
    static constexpr bool is_specialized = true;                                      \
    static constexpr T min() { return __builtin_bit_cast(T, (bits_t)(minb)); }        \
    static constexpr T max() { return __builtin_bit_cast(T, (bits_t)(maxb)); }        \
    static constexpr T lowest() { return -max(); }                                    \
    static constexpr T epsilon() { return __builtin_bit_cast(T, (bits_t)(epsb)); }    \
    static constexpr T infinity() { return (T)__builtin_inff(); }                     \
    static constexpr T quiet_NaN() { return (T)__builtin_nanf(""); }                  \
    static constexpr T signaling_NaN() { return (T)__builtin_nansf(""); }             \
  };
RL_FLOAT_LIMITS(float, uint32_t, 0x00800000u, 0x7f7fffffu, 0x34000000u)
RL_FLOAT_LIMITS(half, uint16_t, 0x0400u, 0x7bffu, 0x1400u)
RL_FLOAT_LIMITS(bfloat, uint16_t, 0x0080u, 0x7f7fu, 0x3c00u)
#undef RL_FLOAT_LIMITS

template <class T, class U> METAL_FUNC T as_type(U x) {
  static_assert(sizeof(T) == sizeof(U), "as_type: sizes differ");
  return __builtin_bit_cast(T, x);
}

// Elementwise helpers: every function is defined for float, computed through float for
// half/bfloat (rounded once at the end), and mapped over vectors.
#define RL_MAP1(name)                                                            \
  template <class V, RL_IF(::rl::is_vec<V>)> METAL_FUNC V name(V v) {           \
    V r;                                                                         \
    for (int i = 0; i < ::rl::vec_info<V>::n; ++i) r[i] = name(v[i]);            \
    return r;                                                                    \
  }
#define RL_F1(name, expr)                                                        \
  METAL_FUNC float name(float x) { return expr; }                                \
  METAL_FUNC half name(half x) { return (half)name((float)x); }                  \
  METAL_FUNC bfloat name(bfloat x) { return (bfloat)name((float)x); }            \
  RL_MAP1(name)

RL_F1(exp, __builtin_expf(x))
RL_F1(exp2, __builtin_exp2f(x))
RL_F1(exp10, __builtin_powf(10.0f, x))
RL_F1(log, __builtin_logf(x))
RL_F1(log2, __builtin_log2f(x))
RL_F1(log10, __builtin_log10f(x))
RL_F1(sqrt, __builtin_sqrtf(x))
RL_F1(rsqrt, 1.0f / __builtin_sqrtf(x))
RL_F1(sin, __builtin_sinf(x))
RL_F1(cos, __builtin_cosf(x))
RL_F1(tan, __builtin_tanf(x))
RL_F1(asin, __builtin_asinf(x))
RL_F1(acos, __builtin_acosf(x))
RL_F1(atan, __builtin_atanf(x))
RL_F1(sinh, __builtin_sinhf(x))
RL_F1(cosh, __builtin_coshf(x))
RL_F1(tanh, __builtin_tanhf(x))
RL_F1(asinh, __builtin_asinhf(x))
RL_F1(acosh, __builtin_acoshf(x))
RL_F1(atanh, __builtin_atanhf(x))
RL_F1(floor, __builtin_floorf(x))
RL_F1(ceil, __builtin_ceilf(x))
RL_F1(round, __builtin_roundf(x))
RL_F1(rint, __builtin_rintf(x))
RL_F1(trunc, __builtin_truncf(x))
RL_F1(fabs, __builtin_fabsf(x))
RL_F1(fract, __builtin_fminf(x - __builtin_floorf(x), 0x1.fffffep-1f))
RL_F1(saturate, __builtin_fminf(__builtin_fmaxf(x, 0.0f), 1.0f))
RL_F1(sign, x > 0.0f ? 1.0f : x < 0.0f ? -1.0f : (x != x ? 0.0f : x))
RL_F1(cospi, __builtin_cosf(x * 3.14159265358979323846f))
RL_F1(sinpi, __builtin_sinf(x * 3.14159265358979323846f))
RL_F1(tanpi, __builtin_tanf(x * 3.14159265358979323846f))

#define RL_MAP2(name)                                                                 \
  template <class V, RL_IF(::rl::is_vec<V>)> METAL_FUNC V name(V a, V b) {           \
    V r;                                                                              \
    for (int i = 0; i < ::rl::vec_info<V>::n; ++i) r[i] = name(a[i], b[i]);           \
    return r;                                                                         \
  }                                                                                   \
  template <class V, RL_IF(::rl::is_vec<V>)>                                          \
  METAL_FUNC V name(V a, ::rl::elem_t<V> b) {                                         \
    V bv = b;                                                                         \
    return name(a, bv);                                                               \
  }
#define RL_F2(name, expr)                                                                \
  METAL_FUNC float name(float x, float y) { return expr; }                               \
  METAL_FUNC half name(half x, half y) { return (half)name((float)x, (float)y); }        \
  METAL_FUNC bfloat name(bfloat x, bfloat y) { return (bfloat)name((float)x, (float)y); } \
  RL_MAP2(name)

RL_F2(pow, __builtin_powf(x, y))
RL_F2(powr, __builtin_powf(x, y))
RL_F2(atan2, __builtin_atan2f(x, y))
RL_F2(fmod, __builtin_fmodf(x, y))
RL_F2(fmin, __builtin_fminf(x, y))
RL_F2(fmax, __builtin_fmaxf(x, y))
RL_F2(copysign, __builtin_copysignf(x, y))
RL_F2(fdim, __builtin_fdimf(x, y))
RL_F2(divide, x / y)
RL_F2(step, y < x ? 0.0f : 1.0f)  // step(edge, x)

// min/max: IEEE minNum/maxNum for floats (a NaN operand yields the other), as MSL documents.
METAL_FUNC float max(float x, float y) { return __builtin_fmaxf(x, y); }
METAL_FUNC half max(half x, half y) { return (half)__builtin_fmaxf((float)x, (float)y); }
METAL_FUNC bfloat max(bfloat x, bfloat y) { return (bfloat)__builtin_fmaxf((float)x, (float)y); }
METAL_FUNC float min(float x, float y) { return __builtin_fminf(x, y); }
METAL_FUNC half min(half x, half y) { return (half)__builtin_fminf((float)x, (float)y); }
METAL_FUNC bfloat min(bfloat x, bfloat y) { return (bfloat)__builtin_fminf((float)x, (float)y); }
template <class T, RL_IF(::rl::is_int<T>)> METAL_FUNC T max(T x, T y) { return x > y ? x : y; }
template <class T, RL_IF(::rl::is_int<T>)> METAL_FUNC T min(T x, T y) { return x < y ? x : y; }
RL_MAP2(max)
RL_MAP2(min)
template <class T> METAL_FUNC T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <class V, RL_IF(::rl::is_vec<V>)>
METAL_FUNC V clamp(V x, ::rl::elem_t<V> lo, ::rl::elem_t<V> hi) { return min(max(x, lo), hi); }
template <class T> METAL_FUNC T max3(T x, T y, T z) { return max(max(x, y), z); }
template <class T> METAL_FUNC T min3(T x, T y, T z) { return min(min(x, y), z); }
template <class T> METAL_FUNC T median3(T x, T y, T z) { return max(min(x, y), min(max(x, y), z)); }

METAL_FUNC float abs(float x) { return __builtin_fabsf(x); }
METAL_FUNC half abs(half x) { return (half)__builtin_fabsf((float)x); }
METAL_FUNC bfloat abs(bfloat x) { return (bfloat)__builtin_fabsf((float)x); }
template <class T, RL_IF(::rl::is_int<T>)> METAL_FUNC T abs(T x) { return x < (T)0 ? (T)-x : x; }
RL_MAP1(abs)
template <class T, RL_IF(::rl::is_int<T>)> METAL_FUNC T absdiff(T x, T y) { return x > y ? x - y : y - x; }

METAL_FUNC float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
METAL_FUNC half fma(half a, half b, half c) { return (half)__builtin_fmaf((float)a, (float)b, (float)c); }
METAL_FUNC bfloat fma(bfloat a, bfloat b, bfloat c) { return (bfloat)__builtin_fmaf((float)a, (float)b, (float)c); }
template <class V, RL_IF(::rl::is_vec<V>)> METAL_FUNC V fma(V a, V b, V c) {
  V r;
  for (int i = 0; i < ::rl::vec_info<V>::n; ++i) r[i] = fma(a[i], b[i], c[i]);
  return r;
}
template <class T> METAL_FUNC T mix(T x, T y, T a) { return x + (y - x) * a; }
template <class V, RL_IF(::rl::is_vec<V>)>
METAL_FUNC V mix(V x, V y, ::rl::elem_t<V> a) { return x + (y - x) * a; }
template <class T> METAL_FUNC T smoothstep(T e0, T e1, T x) {
  T t = clamp((x - e0) / (e1 - e0), (T)0, (T)1);
  return t * t * ((T)3 - (T)2 * t);
}

METAL_FUNC bool isnan(float x) { return x != x; }
METAL_FUNC bool isnan(half x) { return x != x; }
METAL_FUNC bool isnan(bfloat x) { return x != x; }
METAL_FUNC bool isinf(float x) { return __builtin_isinf(x); }
METAL_FUNC bool isinf(half x) { return __builtin_isinf((float)x); }
METAL_FUNC bool isinf(bfloat x) { return __builtin_isinf((float)x); }
METAL_FUNC bool isfinite(float x) { return __builtin_isfinite(x); }
METAL_FUNC bool isfinite(half x) { return __builtin_isfinite((float)x); }
METAL_FUNC bool isfinite(bfloat x) { return __builtin_isfinite((float)x); }
METAL_FUNC bool signbit(float x) { return __builtin_signbit(x); }
METAL_FUNC bool signbit(half x) { return __builtin_signbit((float)x); }
METAL_FUNC bool signbit(bfloat x) { return __builtin_signbit((float)x); }
METAL_FUNC float ldexp(float x, int k) { return __builtin_ldexpf(x, k); }
METAL_FUNC float frexp(float x, thread int& e) { return __builtin_frexpf(x, &e); }
METAL_FUNC float modf(float x, thread float& i) { return __builtin_modff(x, &i); }
METAL_FUNC float sincos(float x, thread float& c) {
  c = __builtin_cosf(x);
  return __builtin_sinf(x);
}

// select(a, b, c): c ? b : a; ext-vector comparisons give integer masks (-1/0), so any nonzero
// mask component selects b.
template <class T> METAL_FUNC T select(T a, T b, bool c) { return c ? b : a; }
template <class V, class M, RL_IF(::rl::is_vec<V> && ::rl::is_vec<M>)> METAL_FUNC V select(V a, V b, M c) {
  V r;
  for (int i = 0; i < ::rl::vec_info<V>::n; ++i) r[i] = c[i] ? b[i] : a[i];
  return r;
}
METAL_FUNC bool all(bool b) { return b; }
METAL_FUNC bool any(bool b) { return b; }
template <class M, RL_IF(::rl::is_vec<M>)> METAL_FUNC bool all(M m) {
  for (int i = 0; i < ::rl::vec_info<M>::n; ++i)
    if (!m[i]) return false;
  return true;
}
template <class M, RL_IF(::rl::is_vec<M>)> METAL_FUNC bool any(M m) {
  for (int i = 0; i < ::rl::vec_info<M>::n; ++i)
    if (m[i]) return true;
  return false;
}

template <class V, RL_IF(::rl::is_vec<V>)> METAL_FUNC ::rl::elem_t<V> dot(V a, V b) {
  ::rl::elem_t<V> s = a[0] * b[0];
  for (int i = 1; i < ::rl::vec_info<V>::n; ++i) s += a[i] * b[i];
  return s;
}
template <class V, RL_IF(::rl::is_vec<V>)> METAL_FUNC ::rl::elem_t<V> length_squared(V a) { return dot(a, a); }
template <class V, RL_IF(::rl::is_vec<V>)> METAL_FUNC ::rl::elem_t<V> length(V a) { return sqrt(dot(a, a)); }
template <class V, RL_IF(::rl::is_vec<V>)> METAL_FUNC ::rl::elem_t<V> distance(V a, V b) { return length(a - b); }
template <class V, RL_IF(::rl::is_vec<V>)> METAL_FUNC V normalize(V a) { return a * rsqrt(dot(a, a)); }
template <class V, RL_IF(::rl::is_vec<V>)> METAL_FUNC V cross(V a, V b) {
  return V{a.y * b.z - a.z * b.y, a.z * b.x - a.x * b.z, a.x * b.y - a.y * b.x};
}

template <class T, RL_IF(::rl::is_int<T>)> METAL_FUNC T popcount(T x) {
  return (T)__builtin_popcountll((unsigned long long)x & (~0ull >> (64 - 8 * sizeof(T))));
}
template <class T, RL_IF(::rl::is_int<T>)> METAL_FUNC T clz(T x) {
  unsigned long long u = (unsigned long long)x & (~0ull >> (64 - 8 * sizeof(T)));
  return (T)(u == 0 ? 8 * sizeof(T) : __builtin_clzll(u) - (64 - 8 * sizeof(T)));
}
template <class T, RL_IF(::rl::is_int<T>)> METAL_FUNC T ctz(T x) {
  unsigned long long u = (unsigned long long)x & (~0ull >> (64 - 8 * sizeof(T)));
  return (T)(u == 0 ? 8 * sizeof(T) : __builtin_ctzll(u));
}
template <class T, RL_IF(::rl::is_int<T>)> METAL_FUNC T extract_bits(T x, uint offset, uint bits) {
  if (bits == 0) return 0;
  using U = decltype((unsigned long long)x);
  U u = ((U)x >> offset) & (bits >= 64 ? ~0ull : ((1ull << bits) - 1));
  return (T)u;
}
template <class T, RL_IF(::rl::is_int<T>)> METAL_FUNC T mulhi(T x, T y) {
  return (T)(((__int128)x * (__int128)y) >> (8 * sizeof(T)));
}
RL_MAP1(popcount)
RL_MAP1(clz)
RL_MAP1(ctz)

namespace fast {
using namespace ::metal;
}
namespace precise {
using namespace ::metal;
}
}  // namespace metal
