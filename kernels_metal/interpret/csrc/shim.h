// shim.h: enough of the Metal Shading Language, on top of clang C++17, to compile the kernel
// sources MLX generates for mx.fast.metal_kernel. Included first in every kernel TU. No libc
// headers here: their global `abs`, `exp`, `select` would collide with metal's under
// `using namespace metal;`.
#pragma once
#include "abi.h"

// ---- address spaces and attributes --------------------------------------------------------
// `threadgroup` declarations in a kernel body are rewritten by translate.py into registered
// statics; what is left of the keyword (pointer qualifiers) expands to nothing.
#define device
#define constant
#define thread
#define threadgroup
#define threadgroup_imageblock
#define ray_data
#define object_data
#define METAL_FUNC inline __attribute__((always_inline))
#define MLX_MTL_PRAGMA_UNROLL _Pragma("clang loop unroll(full)")
#define MLX_MTL_CONST static constant constexpr const
#define MLX_MTL_LOOP_UNROLL _Pragma("clang loop unroll(full)")

// ---- scalar types -------------------------------------------------------------------------
typedef _Float16 half;
typedef __bf16 bfloat;
typedef half float16_t;  // MLX's names (get_type_string)
typedef bfloat bfloat16_t;
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;  // MSL long/ulong are 64-bit, as on LP64

// ---- MSL constants ---------------------------------------------------------------------------
#define INFINITY __builtin_inff()
#define NAN __builtin_nanf("")
#define HUGE_VALF __builtin_huge_valf()
#define MAXFLOAT 0x1.fffffep+127f
#define FLT_MAX 0x1.fffffep+127f
#define FLT_MIN 0x1p-126f
#define FLT_EPSILON 0x1p-23f
#define FLT_DIG 6
#define FLT_MANT_DIG 24
#define FLT_MAX_10_EXP 38
#define FLT_MAX_EXP 128
#define FLT_MIN_10_EXP (-37)
#define FLT_MIN_EXP (-125)
#define FLT_RADIX 2
#define HALF_MAX ((half)65504.0f)
#define MAXHALF ((half)65504.0f)
#define HALF_MIN ((half)0x1p-14f)
#define HALF_EPSILON ((half)0x1p-10f)
#define HUGE_VALH ((half)__builtin_inff())
#define HALF_DIG 3
#define HALF_MANT_DIG 11
#define HALF_MAX_10_EXP 4
#define HALF_MAX_EXP 16
#define HALF_MIN_10_EXP (-4)
#define HALF_MIN_EXP (-13)
#define HALF_RADIX 2
#define BFLOAT_MAX ((bfloat)0x1.fep+127f)
#define MAXBFLOAT ((bfloat)0x1.fep+127f)
#define BFLOAT_MIN ((bfloat)0x1p-126f)
#define BFLOAT_EPSILON ((bfloat)0x1p-7f)
#define HUGE_VALBF ((bfloat)__builtin_inff())
#define BFLOAT_DIG 2
#define BFLOAT_MANT_DIG 8
#define BFLOAT_MAX_10_EXP 38
#define BFLOAT_MAX_EXP 128
#define BFLOAT_MIN_10_EXP (-37)
#define BFLOAT_MIN_EXP (-125)
#define BFLOAT_RADIX 2
#define CHAR_BIT 8
#define SCHAR_MAX 127
#define SCHAR_MIN (-128)
#define UCHAR_MAX 255
#define CHAR_MAX 127
#define CHAR_MIN (-128)
#define SHRT_MAX 32767
#define SHRT_MIN (-32768)
#define USHRT_MAX 65535
#define INT_MAX 2147483647
#define INT_MIN (-2147483647 - 1)
#define UINT_MAX 4294967295u
#define LONG_MAX 9223372036854775807l
#define LONG_MIN (-9223372036854775807l - 1)
#define ULONG_MAX 18446744073709551615ul
#define M_E_F 2.71828182845904523536f
#define M_LOG2E_F 1.44269504088896340736f
#define M_LOG10E_F 0.434294481903251827651f
#define M_LN2_F 0.693147180559945309417f
#define M_LN10_F 2.30258509299404568402f
#define M_PI_F 3.14159265358979323846f
#define M_PI_2_F 1.57079632679489661923f
#define M_PI_4_F 0.785398163397448309616f
#define M_1_PI_F 0.318309886183790671538f
#define M_2_PI_F 0.636619772367581343076f
#define M_2_SQRTPI_F 1.12837916709551257390f
#define M_SQRT2_F 1.41421356237309504880f
#define M_SQRT1_2_F 0.707106781186547524401f
#define M_E_H ((half)M_E_F)
#define M_LOG2E_H ((half)M_LOG2E_F)
#define M_LOG10E_H ((half)M_LOG10E_F)
#define M_LN2_H ((half)M_LN2_F)
#define M_LN10_H ((half)M_LN10_F)
#define M_PI_H ((half)M_PI_F)
#define M_PI_2_H ((half)M_PI_2_F)
#define M_PI_4_H ((half)M_PI_4_F)
#define M_1_PI_H ((half)M_1_PI_F)
#define M_2_PI_H ((half)M_2_PI_F)
#define M_2_SQRTPI_H ((half)M_2_SQRTPI_F)
#define M_SQRT2_H ((half)M_SQRT2_F)
#define M_SQRT1_2_H ((half)M_SQRT1_2_F)
#define M_E_BF ((bfloat)M_E_F)
#define M_LOG2E_BF ((bfloat)M_LOG2E_F)
#define M_LOG10E_BF ((bfloat)M_LOG10E_F)
#define M_LN2_BF ((bfloat)M_LN2_F)
#define M_LN10_BF ((bfloat)M_LN10_F)
#define M_PI_BF ((bfloat)M_PI_F)
#define M_PI_2_BF ((bfloat)M_PI_2_F)
#define M_PI_4_BF ((bfloat)M_PI_4_F)
#define M_1_PI_BF ((bfloat)M_1_PI_F)
#define M_2_PI_BF ((bfloat)M_2_PI_F)
#define M_2_SQRTPI_BF ((bfloat)M_2_SQRTPI_F)
#define M_SQRT2_BF ((bfloat)M_SQRT2_F)
#define M_SQRT1_2_BF ((bfloat)M_SQRT1_2_F)

// ---- vector types (clang ext vectors: swizzles, elementwise ops, scalar splat) -------------
#define RL_VECS(T, name)                                     \
  typedef T name##2 __attribute__((ext_vector_type(2)));     \
  typedef T name##3 __attribute__((ext_vector_type(3)));     \
  typedef T name##4 __attribute__((ext_vector_type(4)));     \
  typedef T packed_##name##2 __attribute__((ext_vector_type(2), aligned(sizeof(T)))); \
  typedef T packed_##name##4 __attribute__((ext_vector_type(4), aligned(sizeof(T))));
RL_VECS(float, float)
RL_VECS(half, half)
RL_VECS(bfloat, bfloat)
RL_VECS(int, int)
RL_VECS(uint, uint)
RL_VECS(short, short)
RL_VECS(ushort, ushort)
RL_VECS(char, char)
RL_VECS(uchar, uchar)
RL_VECS(long, long)
RL_VECS(ulong, ulong)
RL_VECS(bool, bool)
#undef RL_VECS

namespace rl {
template <bool B, class T = void> struct enable_if {};
template <class T> struct enable_if<true, T> { using type = T; };
template <class T> struct identity { using type = T; };
template <class A, class B> struct same { static constexpr bool value = false; };
template <class A> struct same<A, A> { static constexpr bool value = true; };

template <class T> struct vec_info {
  static constexpr int n = 0;  // a scalar
  using elem = T;
};
template <class T, int N> struct vec_info<T __attribute__((ext_vector_type(N)))> {
  static constexpr int n = N;
  using elem = T;
};
template <class T> constexpr bool is_vec = vec_info<T>::n > 0;
template <class T> constexpr bool is_float =
    same<T, float>::value || same<T, half>::value || same<T, bfloat>::value || same<T, double>::value;
template <class T> struct int_info { static constexpr bool value = false; };
#define RL_INT(T) template <> struct int_info<T> { static constexpr bool value = true; };
RL_INT(char) RL_INT(signed char) RL_INT(unsigned char) RL_INT(short) RL_INT(unsigned short)
RL_INT(int) RL_INT(unsigned int) RL_INT(long) RL_INT(unsigned long) RL_INT(long long)
RL_INT(unsigned long long)
#undef RL_INT
template <class T> constexpr bool is_int = int_info<T>::value;  // integer scalars
template <class T> using elem_t = typename vec_info<T>::elem;

#define RL_IF(cond) typename ::rl::enable_if<(cond), int>::type = 0

// MSL vector constructors: T4(s), T4(a, b, c, d), T4(v2, v2), T4(v3, s), T4(other_vec4)...
template <class E, class A> inline void append(E* buf, int& k, A a) {
  if constexpr (is_vec<A>) {
    for (int i = 0; i < vec_info<A>::n; ++i) buf[k++] = (E)a[i];
  } else {
    buf[k++] = (E)a;
  }
}
template <class A> constexpr int count_of() { return is_vec<A> ? vec_info<A>::n : 1; }

template <class V, class... A> inline V make_vec(A... a) {
  using E = elem_t<V>;
  constexpr int N = vec_info<V>::n;
  if constexpr (sizeof...(A) == 0) {
    return V{};
  } else if constexpr (sizeof...(A) == 1 && (!is_vec<A> && ...)) {
    V r = (E)(a, ...);  // splat
    return r;
  } else {
    static_assert((count_of<A>() + ...) == N, "wrong number of vector components");
    E buf[N];
    int k = 0;
    (append(buf, k, a), ...);
    V r;
    for (int i = 0; i < N; ++i) r[i] = buf[i];
    return r;
  }
}
}  // namespace rl

#include "msl_math.h"
#include "msl_sync.h"

using namespace metal;

#include "mlx_utils.h"

// ---- interpreter plumbing used by the generated launch code -----------------------------------
namespace rl {
inline uint3 u3(const uint32_t* p) { return uint3{p[0], p[1], p[2]}; }
}

// ---- MSL vector constructors: `float4(a, b, c, d)`, `half4(v)`, `float4(v2, v2)`... ------------
// A function-like macro only expands when the name is followed by `(`, so `float4 x;` and
// `device float4* p` still name the type. Defined last so the shim itself is unaffected.
#define float2(...) ::rl::make_vec<::float2>(__VA_ARGS__)
#define float3(...) ::rl::make_vec<::float3>(__VA_ARGS__)
#define float4(...) ::rl::make_vec<::float4>(__VA_ARGS__)
#define half2(...) ::rl::make_vec<::half2>(__VA_ARGS__)
#define half3(...) ::rl::make_vec<::half3>(__VA_ARGS__)
#define half4(...) ::rl::make_vec<::half4>(__VA_ARGS__)
#define bfloat2(...) ::rl::make_vec<::bfloat2>(__VA_ARGS__)
#define bfloat3(...) ::rl::make_vec<::bfloat3>(__VA_ARGS__)
#define bfloat4(...) ::rl::make_vec<::bfloat4>(__VA_ARGS__)
#define int2(...) ::rl::make_vec<::int2>(__VA_ARGS__)
#define int3(...) ::rl::make_vec<::int3>(__VA_ARGS__)
#define int4(...) ::rl::make_vec<::int4>(__VA_ARGS__)
#define uint2(...) ::rl::make_vec<::uint2>(__VA_ARGS__)
#define uint3(...) ::rl::make_vec<::uint3>(__VA_ARGS__)
#define uint4(...) ::rl::make_vec<::uint4>(__VA_ARGS__)
#define short2(...) ::rl::make_vec<::short2>(__VA_ARGS__)
#define short3(...) ::rl::make_vec<::short3>(__VA_ARGS__)
#define short4(...) ::rl::make_vec<::short4>(__VA_ARGS__)
#define ushort2(...) ::rl::make_vec<::ushort2>(__VA_ARGS__)
#define ushort3(...) ::rl::make_vec<::ushort3>(__VA_ARGS__)
#define ushort4(...) ::rl::make_vec<::ushort4>(__VA_ARGS__)
#define char2(...) ::rl::make_vec<::char2>(__VA_ARGS__)
#define char3(...) ::rl::make_vec<::char3>(__VA_ARGS__)
#define char4(...) ::rl::make_vec<::char4>(__VA_ARGS__)
#define uchar2(...) ::rl::make_vec<::uchar2>(__VA_ARGS__)
#define uchar3(...) ::rl::make_vec<::uchar3>(__VA_ARGS__)
#define uchar4(...) ::rl::make_vec<::uchar4>(__VA_ARGS__)
#define long2(...) ::rl::make_vec<::long2>(__VA_ARGS__)
#define long3(...) ::rl::make_vec<::long3>(__VA_ARGS__)
#define long4(...) ::rl::make_vec<::long4>(__VA_ARGS__)
#define ulong2(...) ::rl::make_vec<::ulong2>(__VA_ARGS__)
#define ulong3(...) ::rl::make_vec<::ulong3>(__VA_ARGS__)
#define ulong4(...) ::rl::make_vec<::ulong4>(__VA_ARGS__)
#define bool2(...) ::rl::make_vec<::bool2>(__VA_ARGS__)
#define bool3(...) ::rl::make_vec<::bool3>(__VA_ARGS__)
#define bool4(...) ::rl::make_vec<::bool4>(__VA_ARGS__)
