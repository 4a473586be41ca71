// msl_shim.h: enough of the Metal Shading Language (and of the MLX utilities
// that MLX prepends to every custom kernel) for C++17 to compile the kernel
// text MLX builds, with every device/threadgroup access routed through the
// simulator runtime's checks.
//
// Deliberately does not include <cmath> & co.: the kernel must only see names
// that exist in MSL.  Math goes through compiler builtins.
#pragma once
#include <stddef.h>
#include <stdint.h>

#include <type_traits>

#include "msl_rt.h"

#define MSL_SIM 1
#if defined(__has_builtin)
#if __has_builtin(__builtin_COLUMN)
#define MSL_COLUMN() __builtin_COLUMN()
#endif
#endif
#ifndef MSL_COLUMN
#define MSL_COLUMN() 0
#endif
#define __METAL__ 1
#define __METAL_VERSION__ 310
#define METAL_FUNC inline
#define MTL_CONST
#define MLX_MTL_PRAGMA_UNROLL

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;

namespace metal {

// ---------------------------------------------------------------------------
// half / bfloat
// ---------------------------------------------------------------------------
namespace detail {
constexpr uint32_t f2u(float f) { return __builtin_bit_cast(uint32_t, f); }
constexpr float u2f(uint32_t u) { return __builtin_bit_cast(float, u); }

// float -> binary16, round to nearest even (F. Giesen's method)
constexpr uint16_t f32_to_f16(float fv) {
  uint32_t x = f2u(fv);
  const uint32_t sign = x & 0x80000000u;
  x ^= sign;
  uint32_t o = 0;
  if (x >= (127u + 16u) << 23) {
    o = (x > 0x7f800000u) ? 0x7e00u : 0x7c00u;
  } else if (x < (113u << 23)) {
    const uint32_t denorm_magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    float f = u2f(x) + u2f(denorm_magic);
    o = f2u(f) - denorm_magic;
  } else {
    uint32_t mant_odd = (x >> 13) & 1u;
    x += ((uint32_t)(15 - 127) << 23) + 0xfffu;
    x += mant_odd;
    o = x >> 13;
  }
  return (uint16_t)(o | (sign >> 16));
}

constexpr float f16_to_f32(uint16_t h) {
  const uint32_t shifted_exp = 0x7c00u << 13;
  uint32_t o = ((uint32_t)h & 0x7fffu) << 13;
  uint32_t e = shifted_exp & o;
  o += (uint32_t)(127 - 15) << 23;
  if (e == shifted_exp) {
    o += (uint32_t)(128 - 16) << 23;
  } else if (e == 0) {
    o += 1u << 23;
    o = f2u(u2f(o) - u2f(113u << 23));
  }
  o |= ((uint32_t)h & 0x8000u) << 16;
  return u2f(o);
}

constexpr uint16_t f32_to_bf16(float fv) {
  uint32_t u = f2u(fv);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

constexpr float bf16_to_f32(uint16_t b) { return u2f((uint32_t)b << 16); }

struct raw_tag {};
}  // namespace detail

struct half;
struct bfloat;

template <class T>
struct is_lowp : std::false_type {};
template <>
struct is_lowp<half> : std::true_type {};
template <>
struct is_lowp<bfloat> : std::true_type {};

template <class T>
constexpr bool is_scalar_num_v = std::is_arithmetic<T>::value || is_lowp<T>::value;

struct half {
  uint16_t bits;
  half() = default;
  constexpr half(detail::raw_tag, uint16_t b) : bits(b) {}
  template <class T, std::enable_if_t<std::is_arithmetic<T>::value, int> = 0>
  constexpr half(T v) : bits(detail::f32_to_f16((float)v)) {}
  constexpr half(const bfloat& b);
  constexpr operator float() const { return detail::f16_to_f32(bits); }
};

struct bfloat {
  uint16_t bits;
  bfloat() = default;
  constexpr bfloat(detail::raw_tag, uint16_t b) : bits(b) {}
  template <class T, std::enable_if_t<std::is_arithmetic<T>::value, int> = 0>
  constexpr bfloat(T v) : bits(detail::f32_to_bf16((float)v)) {}
  constexpr bfloat(const half& h) : bits(detail::f32_to_bf16((float)h)) {}
  constexpr operator float() const { return detail::bf16_to_f32(bits); }
};
constexpr half::half(const bfloat& b) : bits(detail::f32_to_f16((float)b)) {}

// Result type of a binary arithmetic operation involving half/bfloat.
template <class A, class B, class = void>
struct lowp_result {
  using type = float;  // half (x) float, half (x) bfloat
};
template <class A>
struct lowp_result<A, A, std::enable_if_t<is_lowp<A>::value>> {
  using type = A;
};
template <class A, class B>
struct lowp_result<A, B, std::enable_if_t<is_lowp<A>::value && std::is_integral<B>::value>> {
  using type = A;
};
template <class A, class B>
struct lowp_result<A, B, std::enable_if_t<std::is_integral<A>::value && is_lowp<B>::value>> {
  using type = B;
};

}  // namespace metal

namespace msl {
template <class T>
struct Ref;
// value type of an operand: strips references and access proxies
template <class T>
struct value_of {
  using type = std::remove_cv_t<std::remove_reference_t<T>>;
};
template <class T>
struct value_of<Ref<T>> {
  using type = std::remove_cv_t<T>;
};
template <class T>
using value_of_t = typename value_of<std::remove_cv_t<std::remove_reference_t<T>>>::type;

template <class A, class B>
constexpr bool lowp_op_v =
    (metal::is_lowp<value_of_t<A>>::value || metal::is_lowp<value_of_t<B>>::value) &&
    metal::is_scalar_num_v<value_of_t<A>> && metal::is_scalar_num_v<value_of_t<B>> &&
    !std::is_same<value_of_t<A>, double>::value && !std::is_same<value_of_t<B>, double>::value;
}  // namespace msl

namespace metal {
#define MSL_LOWP_BINOP(OP)                                                                   \
  template <class A, class B, std::enable_if_t<::msl::lowp_op_v<A, B>, int> = 0>             \
  constexpr auto operator OP(A a, B b) {                                                       \
    using VA = ::msl::value_of_t<A>;                                                         \
    using VB = ::msl::value_of_t<B>;                                                         \
    using R = typename lowp_result<VA, VB>::type;                                            \
    return R((float)(VA)a OP(float)(VB) b);                                                  \
  }
MSL_LOWP_BINOP(+)
MSL_LOWP_BINOP(-)
MSL_LOWP_BINOP(*)
MSL_LOWP_BINOP(/)
#undef MSL_LOWP_BINOP
#define MSL_LOWP_CMP(OP)                                                         \
  template <class A, class B, std::enable_if_t<::msl::lowp_op_v<A, B>, int> = 0> \
  constexpr bool operator OP(A a, B b) {                                         \
    using VA = ::msl::value_of_t<A>;                                             \
    using VB = ::msl::value_of_t<B>;                                             \
    return (float)(VA)a OP(float)(VB) b;                                         \
  }
MSL_LOWP_CMP(==)
MSL_LOWP_CMP(!=)
MSL_LOWP_CMP(<)
MSL_LOWP_CMP(<=)
MSL_LOWP_CMP(>)
MSL_LOWP_CMP(>=)
#undef MSL_LOWP_CMP

#define MSL_LOWP_UNARY(T)                                                           \
  constexpr T operator-(T a) { return T(detail::raw_tag{}, (uint16_t)(a.bits ^ 0x8000u)); } \
  constexpr T operator+(T a) { return a; }                                          \
  template <class B, std::enable_if_t<is_scalar_num_v<B>, int> = 0>                 \
  inline T& operator+=(T& a, const B& b) { return a = T(a + b); }                   \
  template <class B, std::enable_if_t<is_scalar_num_v<B>, int> = 0>                 \
  inline T& operator-=(T& a, const B& b) { return a = T(a - b); }                   \
  template <class B, std::enable_if_t<is_scalar_num_v<B>, int> = 0>                 \
  inline T& operator*=(T& a, const B& b) { return a = T(a * b); }                   \
  template <class B, std::enable_if_t<is_scalar_num_v<B>, int> = 0>                 \
  inline T& operator/=(T& a, const B& b) { return a = T(a / b); }                   \
  inline T& operator++(T& a) { return a = T(a + 1); }                               \
  inline T& operator--(T& a) { return a = T(a - 1); }                               \
  inline T operator++(T& a, int) { T o = a; a = T(a + 1); return o; }               \
  inline T operator--(T& a, int) { T o = a; a = T(a - 1); return o; }
MSL_LOWP_UNARY(half)
MSL_LOWP_UNARY(bfloat)
#undef MSL_LOWP_UNARY

// ---------------------------------------------------------------------------
// vectors
// ---------------------------------------------------------------------------
template <class T, int N>
struct vec;

template <class T>
struct vec<T, 2> {
  T x, y;
  vec() = default;
  constexpr vec(T a, T b) : x(a), y(b) {}
  constexpr explicit vec(T s) : x(s), y(s) {}
  template <class U>
  constexpr explicit vec(const vec<U, 2>& o) : x(T(o.x)), y(T(o.y)) {}
  constexpr T& operator[](int i) { return (&x)[i]; }
  constexpr const T& operator[](int i) const { return (&x)[i]; }
};
template <class T>
struct vec<T, 3> {
  T x, y, z;
  vec() = default;
  constexpr vec(T a, T b, T c) : x(a), y(b), z(c) {}
  constexpr explicit vec(T s) : x(s), y(s), z(s) {}
  constexpr vec(const vec<T, 2>& a, T c) : x(a.x), y(a.y), z(c) {}
  constexpr vec(T a, const vec<T, 2>& b) : x(a), y(b.x), z(b.y) {}
  constexpr vec(::msl::U3 u) : x(T(u.x)), y(T(u.y)), z(T(u.z)) {}
  template <class U>
  constexpr explicit vec(const vec<U, 3>& o) : x(T(o.x)), y(T(o.y)), z(T(o.z)) {}
  constexpr T& operator[](int i) { return (&x)[i]; }
  constexpr const T& operator[](int i) const { return (&x)[i]; }
};
template <class T>
struct vec<T, 4> {
  T x, y, z, w;
  vec() = default;
  constexpr vec(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
  constexpr explicit vec(T s) : x(s), y(s), z(s), w(s) {}
  constexpr vec(const vec<T, 2>& a, const vec<T, 2>& b) : x(a.x), y(a.y), z(b.x), w(b.y) {}
  constexpr vec(const vec<T, 3>& a, T d) : x(a.x), y(a.y), z(a.z), w(d) {}
  constexpr vec(T a, const vec<T, 3>& b) : x(a), y(b.x), z(b.y), w(b.z) {}
  constexpr vec(const vec<T, 2>& a, T c, T d) : x(a.x), y(a.y), z(c), w(d) {}
  template <class U>
  constexpr explicit vec(const vec<U, 4>& o) : x(T(o.x)), y(T(o.y)), z(T(o.z)), w(T(o.w)) {}
  constexpr T& operator[](int i) { return (&x)[i]; }
  constexpr const T& operator[](int i) const { return (&x)[i]; }
};

template <class T>
struct is_vec : std::false_type {};
template <class T, int N>
struct is_vec<vec<T, N>> : std::true_type {};

#define MSL_VEC_BINOP(OP, OPA)                                                        \
  template <class T, int N>                                                           \
  constexpr vec<T, N> operator OP(const vec<T, N>& a, const vec<T, N>& b) {           \
    vec<T, N> r;                                                                      \
    for (int i = 0; i < N; ++i) r[i] = T(a[i] OP b[i]);                               \
    return r;                                                                         \
  }                                                                                   \
  template <class T, int N, class S, std::enable_if_t<is_scalar_num_v<S>, int> = 0>   \
  constexpr vec<T, N> operator OP(const vec<T, N>& a, const S& s) {                   \
    vec<T, N> r;                                                                      \
    for (int i = 0; i < N; ++i) r[i] = T(a[i] OP T(s));                               \
    return r;                                                                         \
  }                                                                                   \
  template <class T, int N, class S, std::enable_if_t<is_scalar_num_v<S>, int> = 0>   \
  constexpr vec<T, N> operator OP(const S& s, const vec<T, N>& a) {                   \
    vec<T, N> r;                                                                      \
    for (int i = 0; i < N; ++i) r[i] = T(T(s) OP a[i]);                               \
    return r;                                                                         \
  }                                                                                   \
  template <class T, int N, class B>                                                  \
  constexpr vec<T, N>& operator OPA(vec<T, N>& a, const B& b) {                       \
    return a = a OP b;                                                                \
  }
MSL_VEC_BINOP(+, +=)
MSL_VEC_BINOP(-, -=)
MSL_VEC_BINOP(*, *=)
MSL_VEC_BINOP(/, /=)
MSL_VEC_BINOP(%, %=)
MSL_VEC_BINOP(&, &=)
MSL_VEC_BINOP(|, |=)
MSL_VEC_BINOP(^, ^=)
MSL_VEC_BINOP(<<, <<=)
MSL_VEC_BINOP(>>, >>=)
#undef MSL_VEC_BINOP

#define MSL_VEC_CMP(OP)                                                             \
  template <class T, int N>                                                         \
  constexpr vec<bool, N> operator OP(const vec<T, N>& a, const vec<T, N>& b) {      \
    vec<bool, N> r;                                                                 \
    for (int i = 0; i < N; ++i) r[i] = a[i] OP b[i];                                \
    return r;                                                                       \
  }                                                                                 \
  template <class T, int N, class S, std::enable_if_t<is_scalar_num_v<S>, int> = 0> \
  constexpr vec<bool, N> operator OP(const vec<T, N>& a, const S& s) {              \
    vec<bool, N> r;                                                                 \
    for (int i = 0; i < N; ++i) r[i] = a[i] OP T(s);                                \
    return r;                                                                       \
  }
MSL_VEC_CMP(==)
MSL_VEC_CMP(!=)
MSL_VEC_CMP(<)
MSL_VEC_CMP(<=)
MSL_VEC_CMP(>)
MSL_VEC_CMP(>=)
#undef MSL_VEC_CMP

template <class T, int N>
constexpr vec<T, N> operator-(const vec<T, N>& a) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = T(-a[i]);
  return r;
}
template <int N>
constexpr vec<bool, N> operator!(const vec<bool, N>& a) {
  vec<bool, N> r;
  for (int i = 0; i < N; ++i) r[i] = !a[i];
  return r;
}

#define MSL_VEC_TYPES(T, NAME) \
  typedef vec<T, 2> NAME##2;   \
  typedef vec<T, 3> NAME##3;   \
  typedef vec<T, 4> NAME##4;
MSL_VEC_TYPES(float, float)
MSL_VEC_TYPES(half, half)
MSL_VEC_TYPES(bfloat, bfloat)
MSL_VEC_TYPES(int, int)
MSL_VEC_TYPES(uint, uint)
MSL_VEC_TYPES(short, short)
MSL_VEC_TYPES(ushort, ushort)
MSL_VEC_TYPES(char, char)
MSL_VEC_TYPES(uchar, uchar)
MSL_VEC_TYPES(long, long)
MSL_VEC_TYPES(ulong, ulong)
MSL_VEC_TYPES(bool, bool)
#undef MSL_VEC_TYPES

template <class T, int N>
constexpr bool all(const vec<T, N>& v) {
  for (int i = 0; i < N; ++i)
    if (!v[i]) return false;
  return true;
}
template <class T, int N>
constexpr bool any(const vec<T, N>& v) {
  for (int i = 0; i < N; ++i)
    if (v[i]) return true;
  return false;
}
constexpr bool all(bool b) { return b; }
constexpr bool any(bool b) { return b; }

// ---------------------------------------------------------------------------
// type traits / limits / as_type
// ---------------------------------------------------------------------------
using std::conditional;
using std::conditional_t;
using std::enable_if;
using std::enable_if_t;
using std::integral_constant;
using std::is_same;
using std::is_same_v;
using std::is_signed;
using std::is_unsigned;
using std::make_signed;
using std::make_unsigned;
using std::remove_cv_t;
using std::remove_reference_t;
using std::true_type;
using std::false_type;
template <class T>
struct is_floating_point
    : std::integral_constant<bool, std::is_floating_point<T>::value || is_lowp<T>::value> {};
template <class T>
constexpr bool is_floating_point_v = is_floating_point<T>::value;
template <class T>
struct is_integral : std::is_integral<T> {};
template <class T>
constexpr bool is_integral_v = std::is_integral<T>::value;
template <class T>
struct is_arithmetic : std::integral_constant<bool, is_scalar_num_v<T>> {};
template <class T>
constexpr bool is_arithmetic_v = is_scalar_num_v<T>;

template <class T, class = void>
struct numeric_limits;
template <class T>
struct numeric_limits<T, std::enable_if_t<std::is_integral<T>::value>> {
  static constexpr bool is_specialized = true;
  static constexpr T min() { return std::is_signed<T>::value ? T(T(1) << (sizeof(T) * 8 - 1)) : T(0); }
  static constexpr T max() { return T(~min()); }
  static constexpr T lowest() { return min(); }
};
template <>
struct numeric_limits<float> {
  static constexpr bool is_specialized = true;
  static constexpr float min() { return 1.17549435e-38f; }
  static constexpr float max() { return 3.40282347e+38f; }
  static constexpr float lowest() { return -3.40282347e+38f; }
  static constexpr float epsilon() { return 1.1920929e-07f; }
  static constexpr float infinity() { return __builtin_inff(); }
  static constexpr float quiet_NaN() { return __builtin_nanf(""); }
  static constexpr float denorm_min() { return 1.4e-45f; }
};
template <>
struct numeric_limits<half> {
  static constexpr bool is_specialized = true;
  static constexpr half min() { return half(detail::raw_tag{}, 0x0400); }
  static constexpr half max() { return half(detail::raw_tag{}, 0x7bff); }
  static constexpr half lowest() { return half(detail::raw_tag{}, 0xfbff); }
  static constexpr half epsilon() { return half(detail::raw_tag{}, 0x1400); }
  static constexpr half infinity() { return half(detail::raw_tag{}, 0x7c00); }
  static constexpr half quiet_NaN() { return half(detail::raw_tag{}, 0x7e00); }
};
template <>
struct numeric_limits<bfloat> {
  static constexpr bool is_specialized = true;
  static constexpr bfloat min() { return bfloat(detail::raw_tag{}, 0x0080); }
  static constexpr bfloat max() { return bfloat(detail::raw_tag{}, 0x7f7f); }
  static constexpr bfloat lowest() { return bfloat(detail::raw_tag{}, 0xff7f); }
  static constexpr bfloat epsilon() { return bfloat(detail::raw_tag{}, 0x3c00); }
  static constexpr bfloat infinity() { return bfloat(detail::raw_tag{}, 0x7f80); }
  static constexpr bfloat quiet_NaN() { return bfloat(detail::raw_tag{}, 0x7fc0); }
};

template <class To, class From>
inline To as_type(const From& f) {
  static_assert(sizeof(To) == sizeof(From), "as_type: sizes differ");
  return __builtin_bit_cast(To, f);
}

// ---------------------------------------------------------------------------
// math
// ---------------------------------------------------------------------------
#define MSL_F1(NAME, EXPR)                                                     \
  inline float NAME(float x) { return EXPR; }                                  \
  inline half NAME(half hx) { float x = (float)hx; return half(EXPR); }        \
  inline bfloat NAME(bfloat hx) { float x = (float)hx; return bfloat(EXPR); }  \
  template <class T, int N>                                                    \
  inline vec<T, N> NAME(const vec<T, N>& v) {                                  \
    vec<T, N> r;                                                               \
    for (int i = 0; i < N; ++i) r[i] = NAME(v[i]);                             \
    return r;                                                                  \
  }
#define MSL_F2(NAME, EXPR)                                                                 \
  inline float NAME(float x, float y) { return EXPR; }                                     \
  inline half NAME(half hx, half hy) { float x = hx, y = hy; return half(EXPR); }          \
  inline bfloat NAME(bfloat hx, bfloat hy) { float x = hx, y = hy; return bfloat(EXPR); }  \
  template <class T, int N>                                                                \
  inline vec<T, N> NAME(const vec<T, N>& a, const vec<T, N>& b) {                          \
    vec<T, N> r;                                                                           \
    for (int i = 0; i < N; ++i) r[i] = NAME(a[i], b[i]);                                   \
    return r;                                                                              \
  }
#define MSL_F3(NAME, EXPR)                                                          \
  inline float NAME(float x, float y, float z) { return EXPR; }                     \
  inline half NAME(half hx, half hy, half hz) {                                     \
    float x = hx, y = hy, z = hz;                                                   \
    return half(EXPR);                                                              \
  }                                                                                 \
  inline bfloat NAME(bfloat hx, bfloat hy, bfloat hz) {                             \
    float x = hx, y = hy, z = hz;                                                   \
    return bfloat(EXPR);                                                            \
  }                                                                                 \
  template <class T, int N>                                                         \
  inline vec<T, N> NAME(const vec<T, N>& a, const vec<T, N>& b, const vec<T, N>& c) { \
    vec<T, N> r;                                                                    \
    for (int i = 0; i < N; ++i) r[i] = NAME(a[i], b[i], c[i]);                      \
    return r;                                                                       \
  }

#define MSL_MATH_SET                                                            \
  MSL_F1(exp, __builtin_expf(x))                                                \
  MSL_F1(exp2, __builtin_exp2f(x))                                              \
  MSL_F1(exp10, __builtin_powf(10.0f, x))                                       \
  MSL_F1(log, __builtin_logf(x))                                                \
  MSL_F1(log2, __builtin_log2f(x))                                              \
  MSL_F1(log10, __builtin_log10f(x))                                            \
  MSL_F1(sqrt, __builtin_sqrtf(x))                                              \
  MSL_F1(rsqrt, 1.0f / __builtin_sqrtf(x))                                      \
  MSL_F1(sin, __builtin_sinf(x))                                                \
  MSL_F1(cos, __builtin_cosf(x))                                                \
  MSL_F1(tan, __builtin_tanf(x))                                                \
  MSL_F1(asin, __builtin_asinf(x))                                              \
  MSL_F1(acos, __builtin_acosf(x))                                              \
  MSL_F1(atan, __builtin_atanf(x))                                              \
  MSL_F1(sinh, __builtin_sinhf(x))                                              \
  MSL_F1(cosh, __builtin_coshf(x))                                              \
  MSL_F1(tanh, __builtin_tanhf(x))                                              \
  MSL_F1(asinh, __builtin_asinhf(x))                                            \
  MSL_F1(acosh, __builtin_acoshf(x))                                            \
  MSL_F1(atanh, __builtin_atanhf(x))                                            \
  MSL_F1(sinpi, __builtin_sinf(3.14159265358979f * x))                          \
  MSL_F1(cospi, __builtin_cosf(3.14159265358979f * x))                          \
  MSL_F1(tanpi, __builtin_tanf(3.14159265358979f * x))                          \
  MSL_F1(floor, __builtin_floorf(x))                                            \
  MSL_F1(ceil, __builtin_ceilf(x))                                              \
  MSL_F1(round, __builtin_roundf(x))                                            \
  MSL_F1(rint, __builtin_rintf(x))                                              \
  MSL_F1(trunc, __builtin_truncf(x))                                            \
  MSL_F1(fabs, __builtin_fabsf(x))                                              \
  MSL_F1(fract, __builtin_fminf(x - __builtin_floorf(x), 0x1.fffffep-1f))       \
  MSL_F1(saturate, __builtin_fminf(__builtin_fmaxf(x, 0.0f), 1.0f))             \
  MSL_F1(sign, (x > 0.0f ? 1.0f : x < 0.0f ? -1.0f : (x != x ? 0.0f : x)))      \
  MSL_F2(pow, __builtin_powf(x, y))                                             \
  MSL_F2(powr, __builtin_powf(x, y))                                            \
  MSL_F2(atan2, __builtin_atan2f(x, y))                                         \
  MSL_F2(fmod, __builtin_fmodf(x, y))                                           \
  MSL_F2(fmax, __builtin_fmaxf(x, y))                                           \
  MSL_F2(fmin, __builtin_fminf(x, y))                                           \
  MSL_F2(fdim, __builtin_fdimf(x, y))                                           \
  MSL_F2(copysign, __builtin_copysignf(x, y))                                   \
  MSL_F2(nextafter, __builtin_nextafterf(x, y))                                 \
  MSL_F2(step, (y < x ? 0.0f : 1.0f))                                           \
  MSL_F2(divide, x / y)                                                         \
  MSL_F3(fma, __builtin_fmaf(x, y, z))                                          \
  MSL_F3(mix, x + (y - x) * z)                                                  \
  MSL_F3(fmax3, __builtin_fmaxf(__builtin_fmaxf(x, y), z))                      \
  MSL_F3(fmin3, __builtin_fminf(__builtin_fminf(x, y), z))                      \
  MSL_F3(smoothstep, ([&] { float t = __builtin_fminf(__builtin_fmaxf((z - x) / (y - x), 0.0f), 1.0f); return t * t * (3.0f - 2.0f * t); }()))

MSL_MATH_SET
namespace fast {
MSL_MATH_SET
}
namespace precise {
MSL_MATH_SET
}

// max/min/clamp/abs for floats and integers (same-type arguments, like MSL)
#define MSL_MINMAX(T)                                                           \
  constexpr T max(T a, T b) { return a > b ? a : b; }                           \
  constexpr T min(T a, T b) { return a < b ? a : b; }                           \
  constexpr T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }            \
  constexpr T max3(T a, T b, T c) { return max(max(a, b), c); }                 \
  constexpr T min3(T a, T b, T c) { return min(min(a, b), c); }                 \
  constexpr T median3(T a, T b, T c) { return max(min(a, b), min(max(a, b), c)); }
MSL_MINMAX(int)
MSL_MINMAX(uint)
MSL_MINMAX(short)
MSL_MINMAX(ushort)
MSL_MINMAX(char)
MSL_MINMAX(uchar)
MSL_MINMAX(long)
MSL_MINMAX(ulong)
#undef MSL_MINMAX
inline float max(float a, float b) { return __builtin_fmaxf(a, b); }
inline float min(float a, float b) { return __builtin_fminf(a, b); }
inline float clamp(float x, float lo, float hi) { return min(max(x, lo), hi); }
inline float max3(float a, float b, float c) { return max(max(a, b), c); }
inline float min3(float a, float b, float c) { return min(min(a, b), c); }
inline float median3(float a, float b, float c) { return max(min(a, b), min(max(a, b), c)); }
#define MSL_MINMAX_LOWP(T)                                                           \
  inline T max(T a, T b) { return T(__builtin_fmaxf(a, b)); }                        \
  inline T min(T a, T b) { return T(__builtin_fminf(a, b)); }                        \
  inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }                    \
  inline T max3(T a, T b, T c) { return max(max(a, b), c); }                         \
  inline T min3(T a, T b, T c) { return min(min(a, b), c); }                         \
  inline T abs(T a) { return T(__builtin_fabsf(a)); }
MSL_MINMAX_LOWP(half)
MSL_MINMAX_LOWP(bfloat)
#undef MSL_MINMAX_LOWP
template <class T, int N>
inline vec<T, N> max(const vec<T, N>& a, const vec<T, N>& b) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = max(a[i], b[i]);
  return r;
}
template <class T, int N>
inline vec<T, N> min(const vec<T, N>& a, const vec<T, N>& b) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = min(a[i], b[i]);
  return r;
}
template <class T, int N>
inline vec<T, N> clamp(const vec<T, N>& x, const vec<T, N>& lo, const vec<T, N>& hi) {
  return min(max(x, lo), hi);
}
template <class T, int N>
inline vec<T, N> clamp(const vec<T, N>& x, T lo, T hi) {
  return min(max(x, vec<T, N>(lo)), vec<T, N>(hi));
}
inline float abs(float a) { return __builtin_fabsf(a); }
inline int abs(int a) { return a < 0 ? -a : a; }
inline long abs(long a) { return a < 0 ? -a : a; }
inline short abs(short a) { return a < 0 ? -a : a; }
inline char abs(char a) { return a < 0 ? -a : a; }
inline uint abs(uint a) { return a; }
template <class T, int N>
inline vec<T, N> abs(const vec<T, N>& v) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = abs(v[i]);
  return r;
}
namespace fast {
using metal::abs;
using metal::clamp;
using metal::max;
using metal::min;
}  // namespace fast
namespace precise {
using metal::abs;
using metal::clamp;
using metal::max;
using metal::min;
}  // namespace precise

inline bool isnan(float x) { return __builtin_isnan(x); }
inline bool isinf(float x) { return __builtin_isinf(x); }
inline bool isfinite(float x) { return __builtin_isfinite(x); }
inline bool signbit(float x) { return __builtin_signbit(x); }
inline bool isnan(half x) { return __builtin_isnan((float)x); }
inline bool isinf(half x) { return __builtin_isinf((float)x); }
inline bool isfinite(half x) { return __builtin_isfinite((float)x); }
inline bool signbit(half x) { return x.bits >> 15; }
inline bool isnan(bfloat x) { return __builtin_isnan((float)x); }
inline bool isinf(bfloat x) { return __builtin_isinf((float)x); }
inline bool isfinite(bfloat x) { return __builtin_isfinite((float)x); }
inline bool signbit(bfloat x) { return x.bits >> 15; }
template <class T, int N>
inline vec<bool, N> isnan(const vec<T, N>& v) {
  vec<bool, N> r;
  for (int i = 0; i < N; ++i) r[i] = isnan(v[i]);
  return r;
}
template <class T, int N>
inline vec<bool, N> isinf(const vec<T, N>& v) {
  vec<bool, N> r;
  for (int i = 0; i < N; ++i) r[i] = isinf(v[i]);
  return r;
}

template <class T, std::enable_if_t<is_scalar_num_v<T>, int> = 0>
inline T select(T a, T b, bool c) {
  return c ? b : a;
}
template <class T, int N>
inline vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, const vec<bool, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = c[i] ? b[i] : a[i];
  return r;
}
template <class T, int N>
inline vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, bool c) {
  return c ? b : a;
}

template <class T, int N>
inline T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T s = T(0);
  for (int i = 0; i < N; ++i) s = T(s + a[i] * b[i]);
  return s;
}
template <class T, int N>
inline T length(const vec<T, N>& a) {
  return T(__builtin_sqrtf((float)dot(a, a)));
}

inline int popcount(uint x) { return __builtin_popcount(x); }
inline int popcount(int x) { return __builtin_popcount((uint)x); }
inline ulong popcount(ulong x) { return (ulong)__builtin_popcountl(x); }
inline uint clz(uint x) { return x ? (uint)__builtin_clz(x) : 32u; }
inline uint ctz(uint x) { return x ? (uint)__builtin_ctz(x) : 32u; }
inline uint mulhi(uint a, uint b) { return (uint)(((ulong)a * b) >> 32); }
inline int mulhi(int a, int b) { return (int)(((long)a * b) >> 32); }

// ---------------------------------------------------------------------------
// atomics (objects only; operations are below, after the pointer wrappers)
// ---------------------------------------------------------------------------
enum memory_order { memory_order_relaxed = 0, memory_order_seq_cst = 5 };
enum memory_scope { memory_scope_device, memory_scope_threadgroup, memory_scope_simdgroup };

template <class T>
struct atomic {
  T v;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;
typedef atomic<bool> atomic_bool;
typedef atomic<ulong> atomic_ulong;

template <class T>
struct is_atomic : std::false_type {};
template <class T>
struct is_atomic<atomic<T>> : std::true_type {};

// ---------------------------------------------------------------------------
// barriers
// ---------------------------------------------------------------------------
enum class mem_flags : int {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }
constexpr mem_flags operator&(mem_flags a, mem_flags b) { return mem_flags(int(a) & int(b)); }

inline void threadgroup_barrier(mem_flags f, int line = __builtin_LINE(),
                                int col = MSL_COLUMN()) {
  msl_rt_barrier(0, int(f), line, col);
}
inline void simdgroup_barrier(mem_flags f, int line = __builtin_LINE(),
                              int col = MSL_COLUMN()) {
  msl_rt_barrier(1, int(f), line, col);
}

}  // namespace metal

// ---------------------------------------------------------------------------
// checked pointers and element references
// ---------------------------------------------------------------------------
namespace msl {

template <class T>
struct ptr;

// `line`: line of the access in the kernel text (0: unknown, see at_line);
// `value`: for plain writes, the value about to be stored.
template <class T>
inline void check(const Buf* b, const T* p, int64_t n_elems_from_p, uint32_t sz, int mode,
                  int line = 0, const void* value = nullptr) {
  if (!b) return;
  int64_t off = (int64_t)((const char*)p - b->base) + n_elems_from_p * (int64_t)sizeof(T);
  msl_rt_access(const_cast<Buf*>(b), off, sz, mode, line, value);
}

// Proxy for one element of a writable buffer: tells reads from writes.
template <class T>
struct Ref {
  T* p;
  Buf* b;
  int line = 0;
  operator T() const {
    check(b, p, 0, sizeof(T), kRead, line);
    return *p;
  }
  T load() const { return (T) * this; }
  template <class U>
  Ref& operator=(U&& v) {
    T tmp = static_cast<value_of_t<U>>(v);
    check(b, p, 0, sizeof(T), kWrite, line, &tmp);
    *p = tmp;
    return *this;
  }
  Ref& operator=(const Ref& o) {
    T tmp = (T)o;
    check(b, p, 0, sizeof(T), kWrite, line, &tmp);
    *p = tmp;
    return *this;
  }
  Ref(T* p_, Buf* b_, int line_ = 0) : p(p_), b(b_), line(line_) {}
  Ref(const Ref&) = default;
  ptr<T> operator&() const;
#define MSL_REF_CA(OPA, OP)                    \
  template <class U>                           \
  Ref& operator OPA(const U& v) {              \
    T cur = (T) * this;                        \
    T nv = static_cast<T>(cur OP v);           \
    check(b, p, 0, sizeof(T), kWrite, line);   \
    *p = nv;                                   \
    return *this;                              \
  }
  MSL_REF_CA(+=, +)
  MSL_REF_CA(-=, -)
  MSL_REF_CA(*=, *)
  MSL_REF_CA(/=, /)
  MSL_REF_CA(%=, %)
  MSL_REF_CA(&=, &)
  MSL_REF_CA(|=, |)
  MSL_REF_CA(^=, ^)
  MSL_REF_CA(<<=, <<)
  MSL_REF_CA(>>=, >>)
#undef MSL_REF_CA
  Ref& operator++() { return *this += 1; }
  Ref& operator--() { return *this -= 1; }
  T operator++(int) {
    T o = (T) * this;
    *this += 1;
    return o;
  }
  T operator--(int) {
    T o = (T) * this;
    *this -= 1;
    return o;
  }
};

template <class T>
struct elem_ref {
  using type = Ref<T>;
};
template <class T>
struct elem_ref<const T> {
  using type = const T&;
};

// Checked pointer into a device / constant / threadgroup buffer.
template <class T>
struct ptr {
  T* p = nullptr;
  Buf* b = nullptr;
  int line = 0;  // set by at_line for one subscript
  using ref_t = typename elem_ref<T>::type;

  ptr() = default;
  ptr(decltype(nullptr)) {}
  ptr(T* raw) : p(raw), b(raw ? msl_rt_find_buf((const void*)raw) : nullptr) {}
  ptr(T* raw, Buf* buf) : p(raw), b(buf) {}
  template <class U, std::enable_if_t<std::is_convertible<U*, T*>::value, int> = 0>
  ptr(const ptr<U>& o) : p(o.p), b(o.b) {}
  template <class U, std::enable_if_t<!std::is_convertible<U*, T*>::value, int> = 0>
  explicit ptr(const ptr<U>& o) : p((T*)(o.p)), b(o.b) {}
  template <class U, std::enable_if_t<!std::is_convertible<U*, T*>::value, int> = 0>
  explicit ptr(U* raw) : p((T*)raw), b(raw ? msl_rt_find_buf((const void*)raw) : nullptr) {}
  static ptr from_buf(Buf* buf) { return ptr((T*)buf->base, buf); }

  operator T*() const { return p; }
  explicit operator bool() const { return p != nullptr; }

  ref_t at(int64_t i) const {
    if constexpr (std::is_const<T>::value) {
      check(b, p, i, sizeof(T), kRead, line);
      return p[i];
    } else {
      return Ref<T>(p + i, b, line);
    }
  }
  template <class I, std::enable_if_t<std::is_integral<value_of_t<I>>::value ||
                                          std::is_enum<value_of_t<I>>::value, int> = 0>
  ref_t operator[](const I& i) const {
    return at((int64_t)(value_of_t<I>)i);
  }
  ref_t operator*() const { return at(0); }
  T* operator->() const {
    check(b, p, 0, sizeof(T), std::is_const<T>::value ? kRead : kWrite);
    return p;
  }
  template <class I, std::enable_if_t<std::is_integral<value_of_t<I>>::value, int> = 0>
  ptr operator+(const I& i) const {
    return ptr(p + (int64_t)(value_of_t<I>)i, b);
  }
  template <class I, std::enable_if_t<std::is_integral<value_of_t<I>>::value, int> = 0>
  ptr operator-(const I& i) const {
    return ptr(p - (int64_t)(value_of_t<I>)i, b);
  }
  template <class U>
  int64_t operator-(const ptr<U>& o) const {
    return p - o.p;
  }
  template <class I>
  ptr& operator+=(const I& i) {
    p += (int64_t)(value_of_t<I>)i;
    return *this;
  }
  template <class I>
  ptr& operator-=(const I& i) {
    p -= (int64_t)(value_of_t<I>)i;
    return *this;
  }
  ptr& operator++() {
    ++p;
    return *this;
  }
  ptr& operator--() {
    --p;
    return *this;
  }
  ptr operator++(int) {
    ptr o = *this;
    ++p;
    return o;
  }
  ptr operator--(int) {
    ptr o = *this;
    --p;
    return o;
  }
};
template <class I, class T, std::enable_if_t<std::is_integral<value_of_t<I>>::value, int> = 0>
inline ptr<T> operator+(const I& i, const ptr<T>& q) {
  return q + i;
}

template <class T>
ptr<T> Ref<T>::operator&() const {
  return ptr<T>(p, b);
}

template <class To, class From>
inline To ptr_cast(const ptr<From>& f) {
  return To(f);
}
template <class To, class From>
inline To ptr_cast(From* f) {
  return To(f);
}
template <class To, class From, std::enable_if_t<!std::is_pointer<From>::value, int> = 0>
inline To ptr_cast(const From& f) {
  return reinterpret_cast<To>(f);
}

// Threadgroup arrays: `threadgroup T name[D0][D1]...;`
template <class T, size_t... D>
struct tgview;
template <class T, size_t D0>
struct tgview<T, D0> {
  T* p;
  Buf* b;
  int line = 0;
  template <class I>
  Ref<T> operator[](const I& i) const {
    int64_t k = (int64_t)(value_of_t<I>)i;
    if (k < 0 || k >= (int64_t)D0) check(b, p, k, sizeof(T), kRead, line);  // out of bounds
    return Ref<T>(p + k, b, line);
  }
  operator ptr<T>() const { return ptr<T>(p, b); }
  operator ptr<const T>() const { return ptr<const T>(p, b); }
  operator T*() const { return p; }
  template <class I, std::enable_if_t<std::is_integral<value_of_t<I>>::value, int> = 0>
  ptr<T> operator+(const I& i) const {
    return ptr<T>(p, b) + i;
  }
};
template <class T, size_t D0, size_t D1, size_t... D>
struct tgview<T, D0, D1, D...> {
  T* p;
  Buf* b;
  int line = 0;
  static constexpr size_t inner = D1 * (1 * ... * D);
  template <class I>
  tgview<T, D1, D...> operator[](const I& i) const {
    int64_t k = (int64_t)(value_of_t<I>)i;
    if (k < 0 || k >= (int64_t)D0) check(b, p, k * (int64_t)inner, sizeof(T), kRead, line);
    return tgview<T, D1, D...>{p + k * (int64_t)inner, b, line};
  }
};

template <class T>
struct has_line : std::false_type {};
template <class T>
struct has_line<ptr<T>> : std::true_type {};
template <class T, size_t... D>
struct has_line<tgview<T, D...>> : std::true_type {};

// `name[i]` in the kernel text is compiled as `::msl::at_line(name, __LINE__)[i]`
// (preprocess.py): checked pointers and threadgroup arrays remember the line for the
// access; anything else (thread arrays, vectors) passes through unchanged.
template <class X>
constexpr decltype(auto) at_line(X&& x, int line) {
  using D = std::remove_cv_t<std::remove_reference_t<X>>;
  if constexpr (has_line<D>::value) {
    D located = x;
    located.line = line;
    return located;
  } else {
    (void)line;
    return static_cast<X&&>(x);
  }
}

template <class T, size_t... D>
struct tgsite {
  uint64_t gen = 0;
  T* mem = nullptr;
  Buf* buf = nullptr;
  static constexpr size_t count = (1 * ... * D);
  tgview<T, (D)...> get(const char* name) {
    if (gen != msl_rt->group_gen) {
      buf = msl_rt_tg_alloc(name, sizeof(T) * count, sizeof(T));
      mem = (T*)buf->base;
      gen = msl_rt->group_gen;
    }
    return tgview<T, (D)...>{mem, buf};
  }
  Ref<T> get_scalar(const char* name) { return get(name)[0]; }
};

}  // namespace msl

// ---------------------------------------------------------------------------
// atomic operations
// ---------------------------------------------------------------------------
namespace metal {
#ifdef MSL_ADDRSPACE_PASS
// syntax-only pass: any pointer to an atomic (in any address space) is accepted
#define MSL_ATOMIC_ANY(NAME) \
  template <class P, class U, class... M> inline auto NAME(P o, U val, M...) { auto r = o->v; (void)val; return r; }
MSL_ATOMIC_ANY(atomic_fetch_add_explicit)
MSL_ATOMIC_ANY(atomic_fetch_sub_explicit)
MSL_ATOMIC_ANY(atomic_fetch_max_explicit)
MSL_ATOMIC_ANY(atomic_fetch_min_explicit)
MSL_ATOMIC_ANY(atomic_fetch_and_explicit)
MSL_ATOMIC_ANY(atomic_fetch_or_explicit)
MSL_ATOMIC_ANY(atomic_fetch_xor_explicit)
MSL_ATOMIC_ANY(atomic_exchange_explicit)
#undef MSL_ATOMIC_ANY
template <class P, class U, class... M> inline void atomic_store_explicit(P o, U val, M...) { (void)o; (void)val; }
template <class P, class... M> inline auto atomic_load_explicit(P o, M...) { auto r = o->v; return r; }
template <class P, class E, class U, class... M>
inline bool atomic_compare_exchange_weak_explicit(P o, E e, U d, M...) { (void)o; (void)e; (void)d; return true; }
#else
#define MSL_ATOMIC_RMW(NAME, EXPR)                                                  \
  template <class T, class U>                                                       \
  inline T NAME(::msl::ptr<atomic<T>> o, U val, memory_order = memory_order_relaxed) { \
    ::msl::check(o.b, o.p, 0, sizeof(T), ::msl::kAtomicRMW);                        \
    T old = o.p->v;                                                                 \
    T v = T(val);                                                                   \
    o.p->v = (EXPR);                                                                \
    return old;                                                                     \
  }                                                                                 \
  template <class T, class U>                                                       \
  inline T NAME(atomic<T>* o, U val, memory_order m = memory_order_relaxed) {       \
    return NAME(::msl::ptr<atomic<T>>(o), val, m);                                  \
  }
MSL_ATOMIC_RMW(atomic_fetch_add_explicit, T(old + v))
MSL_ATOMIC_RMW(atomic_fetch_sub_explicit, T(old - v))
MSL_ATOMIC_RMW(atomic_fetch_max_explicit, (old > v ? old : v))
MSL_ATOMIC_RMW(atomic_fetch_min_explicit, (old < v ? old : v))
MSL_ATOMIC_RMW(atomic_fetch_and_explicit, T(old & v))
MSL_ATOMIC_RMW(atomic_fetch_or_explicit, T(old | v))
MSL_ATOMIC_RMW(atomic_fetch_xor_explicit, T(old ^ v))
MSL_ATOMIC_RMW(atomic_exchange_explicit, v)
#undef MSL_ATOMIC_RMW

template <class T, class U>
inline void atomic_store_explicit(::msl::ptr<atomic<T>> o, U val,
                                  memory_order = memory_order_relaxed) {
  ::msl::check(o.b, o.p, 0, sizeof(T), ::msl::kAtomicStore);
  o.p->v = T(val);
}
template <class T, class U>
inline void atomic_store_explicit(atomic<T>* o, U val, memory_order m = memory_order_relaxed) {
  atomic_store_explicit(::msl::ptr<atomic<T>>(o), val, m);
}
template <class T>
inline T atomic_load_explicit(::msl::ptr<atomic<T>> o, memory_order = memory_order_relaxed) {
  ::msl::check(o.b, o.p, 0, sizeof(T), ::msl::kAtomicLoad);
  return o.p->v;
}
template <class T>
inline T atomic_load_explicit(::msl::ptr<const atomic<T>> o, memory_order = memory_order_relaxed) {
  ::msl::check(o.b, o.p, 0, sizeof(T), ::msl::kAtomicLoad);
  return o.p->v;
}
template <class T>
inline T atomic_load_explicit(atomic<T>* o, memory_order m = memory_order_relaxed) {
  return atomic_load_explicit(::msl::ptr<atomic<T>>(o), m);
}
template <class T, class E, class U>
inline bool atomic_compare_exchange_weak_explicit(::msl::ptr<atomic<T>> o, E expected, U desired,
                                                  memory_order = memory_order_relaxed,
                                                  memory_order = memory_order_relaxed) {
  ::msl::check(o.b, o.p, 0, sizeof(T), ::msl::kAtomicRMW);
  T cur = o.p->v;
  T exp = *expected;
  if (cur == exp) {
    o.p->v = T(desired);
    return true;
  }
  *expected = cur;
  return false;
}
template <class T, class E, class U>
inline bool atomic_compare_exchange_weak_explicit(atomic<T>* o, E expected, U desired,
                                                  memory_order a = memory_order_relaxed,
                                                  memory_order b = memory_order_relaxed) {
  return atomic_compare_exchange_weak_explicit(::msl::ptr<atomic<T>>(o), expected, desired, a, b);
}

#endif  // MSL_ADDRSPACE_PASS

// ---------------------------------------------------------------------------
// simd collectives
// ---------------------------------------------------------------------------
namespace sim_detail {
enum Op {
  kSum = 1, kProd, kMax, kMin, kAnd, kOr, kXor, kPreIncSum, kPreExcSum, kPreIncProd,
  kPreExcProd, kShuffle, kShuffleXor, kShuffleUp, kShuffleDown, kBroadcast, kBroadcastFirst,
  kAll, kAny, kBallot, kFillUp, kFillDown, kRotUp, kRotDown, kIsFirst
};

template <class T>
inline T poison() {
  T r;
  __builtin_memset((void*)&r, 0xFF, sizeof(T));
  return r;
}
template <class T>
inline T vmax(const T& a, const T& b) { return max(a, b); }
template <class T>
inline T vmin(const T& a, const T& b) { return min(a, b); }
inline bool vmax(bool a, bool b) { return a || b; }
inline bool vmin(bool a, bool b) { return a && b; }

// Results of a collective over `w` lanes (32 for a simdgroup, 4 for a quad).
template <class T>
void resolve_lanes(int op, ::msl::CollSlot* s, const uint8_t* act, int w) {
  auto in = [&](int l) -> const T& { return *(const T*)s[l].in; };
  auto out = [&](int l) -> T& { return *(T*)s[l].out; };
  int first = -1;
  for (int l = 0; l < w; ++l)
    if (act[l] && first < 0) first = l;
  if (first < 0) return;
  auto src = [&](int l) -> T { return (l >= 0 && l < w && act[l]) ? in(l) : poison<T>(); };
  switch (op) {
    case kSum: case kProd: case kMax: case kMin: case kAnd: case kOr: case kXor: {
      T acc = in(first);
      for (int l = first + 1; l < w; ++l) {
        if (!act[l]) continue;
        if constexpr (std::is_same<T, bool>::value) {
          if (op == kMax || op == kOr || op == kSum) acc = acc || in(l);
          else if (op == kMin || op == kAnd || op == kProd) acc = acc && in(l);
          else acc = acc != in(l);
        } else {
          if (op == kSum) acc = T(acc + in(l));
          else if (op == kProd) acc = T(acc * in(l));
          else if (op == kMax) acc = vmax(acc, in(l));
          else if (op == kMin) acc = vmin(acc, in(l));
          else if constexpr (std::is_integral<T>::value) {
            if (op == kAnd) acc = acc & in(l);
            else if (op == kOr) acc = acc | in(l);
            else acc = acc ^ in(l);
          }
        }
      }
      for (int l = 0; l < w; ++l)
        if (act[l]) out(l) = acc;
      break;
    }
    case kPreIncSum: case kPreExcSum: case kPreIncProd: case kPreExcProd: {
      if constexpr (!std::is_same<T, bool>::value) {
        bool sum = op == kPreIncSum || op == kPreExcSum;
        bool inc = op == kPreIncSum || op == kPreIncProd;
        T acc = sum ? T(0) : T(1);
        for (int l = 0; l < w; ++l) {
          if (!act[l]) continue;
          T v = in(l);
          if (inc) acc = sum ? T(acc + v) : T(acc * v);
          out(l) = acc;
          if (!inc) acc = sum ? T(acc + v) : T(acc * v);
        }
      }
      break;
    }
    case kShuffle: case kBroadcast:
      for (int l = 0; l < w; ++l)
        if (act[l]) out(l) = src((int)s[l].arg);
      break;
    case kShuffleXor:
      for (int l = 0; l < w; ++l)
        if (act[l]) out(l) = src(l ^ (int)s[l].arg);
      break;
    case kShuffleUp:
      for (int l = 0; l < w; ++l)
        if (act[l]) out(l) = (l - (int)s[l].arg < 0) ? in(l) : src(l - (int)s[l].arg);
      break;
    case kShuffleDown:
      for (int l = 0; l < w; ++l)
        if (act[l]) out(l) = (l + (int)s[l].arg >= w) ? in(l) : src(l + (int)s[l].arg);
      break;
    case kRotUp:
      for (int l = 0; l < w; ++l)
        if (act[l]) out(l) = src(((l - (int)s[l].arg) % w + w) % w);
      break;
    case kRotDown:
      for (int l = 0; l < w; ++l)
        if (act[l]) out(l) = src((l + (int)s[l].arg) % w);
      break;
    case kFillUp:
      for (int l = 0; l < w; ++l) {
        if (!act[l]) continue;
        int k = l - (int)s[l].arg;
        out(l) = k >= 0 ? src(k) : (act[k + w] ? *(const T*)s[k + w].in2 : poison<T>());
      }
      break;
    case kFillDown:
      for (int l = 0; l < w; ++l) {
        if (!act[l]) continue;
        int k = l + (int)s[l].arg;
        out(l) = k < w ? src(k) : (act[k - w] ? *(const T*)s[k - w].in2 : poison<T>());
      }
      break;
    case kBroadcastFirst:
      for (int l = 0; l < w; ++l)
        if (act[l]) out(l) = in(first);
      break;
    default:
      break;
  }
}

template <class T>
void resolve(int op, ::msl::CollSlot* s, const uint8_t* act) {
  resolve_lanes<T>(op, s, act, 32);
}

// quad_* collectives: op codes are the simd ones + kQuad; each quad of 4 lanes
// combines on its own (the whole simdgroup meets, see docs/simulator.md).
enum { kQuad = 32 };
template <class T>
void resolve_quad(int op, ::msl::CollSlot* s, const uint8_t* act) {
  for (int q = 0; q < 8; ++q) resolve_lanes<T>(op - kQuad, s + 4 * q, act + 4 * q, 4);
}

inline void resolve_vote(int op, ::msl::CollSlot* s, const uint8_t* act) {
  uint64_t mask = 0;
  int first = -1;
  for (int l = 0; l < 32; ++l)
    if (act[l]) {
      if (first < 0) first = l;
      if (*(const bool*)s[l].in) mask |= 1ull << l;
    }
  uint64_t amask = 0;
  for (int l = 0; l < 32; ++l)
    if (act[l]) amask |= 1ull << l;
  for (int l = 0; l < 32; ++l) {
    if (!act[l]) continue;
    if (op == kAll) *(bool*)s[l].out = mask == amask;
    else if (op == kAny) *(bool*)s[l].out = mask != 0;
    else if (op == kIsFirst) *(bool*)s[l].out = l == first;
    else *(uint64_t*)s[l].out = mask;
  }
}

template <class T>
inline T coll(int op, const T& x, int64_t arg, int line, int col, const T* x2 = nullptr) {
  T r;
  ::msl::CollSlot slot{&x, x2, &r, arg};
  msl_rt_collective(op, line, col, slot, op >= kQuad ? &resolve_quad<T> : &resolve<T>);
  return r;
}
}  // namespace sim_detail

#define MSL_COLL1(NAME, OP)                                                        \
  template <class T>                                                               \
  inline ::msl::value_of_t<T> NAME(T x, int line = __builtin_LINE(),              \
                                   int col = MSL_COLUMN()) {                 \
    ::msl::value_of_t<T> v = x;                                                    \
    return sim_detail::coll(sim_detail::OP, v, 0, line, col);                      \
  }
MSL_COLL1(simd_sum, kSum)
MSL_COLL1(simd_product, kProd)
MSL_COLL1(simd_max, kMax)
MSL_COLL1(simd_min, kMin)
MSL_COLL1(simd_and, kAnd)
MSL_COLL1(simd_or, kOr)
MSL_COLL1(simd_xor, kXor)
MSL_COLL1(simd_prefix_inclusive_sum, kPreIncSum)
MSL_COLL1(simd_prefix_exclusive_sum, kPreExcSum)
MSL_COLL1(simd_prefix_inclusive_product, kPreIncProd)
MSL_COLL1(simd_prefix_exclusive_product, kPreExcProd)
MSL_COLL1(simd_broadcast_first, kBroadcastFirst)
MSL_COLL1(quad_sum, kQuad + sim_detail::kSum)
MSL_COLL1(quad_product, kQuad + sim_detail::kProd)
MSL_COLL1(quad_max, kQuad + sim_detail::kMax)
MSL_COLL1(quad_min, kQuad + sim_detail::kMin)
MSL_COLL1(quad_and, kQuad + sim_detail::kAnd)
MSL_COLL1(quad_or, kQuad + sim_detail::kOr)
MSL_COLL1(quad_xor, kQuad + sim_detail::kXor)
MSL_COLL1(quad_prefix_inclusive_sum, kQuad + sim_detail::kPreIncSum)
MSL_COLL1(quad_prefix_exclusive_sum, kQuad + sim_detail::kPreExcSum)
MSL_COLL1(quad_prefix_inclusive_product, kQuad + sim_detail::kPreIncProd)
MSL_COLL1(quad_prefix_exclusive_product, kQuad + sim_detail::kPreExcProd)
MSL_COLL1(quad_broadcast_first, kQuad + sim_detail::kBroadcastFirst)
#undef MSL_COLL1

#define MSL_COLL2(NAME, OP)                                                          \
  template <class T, class I>                                                        \
  inline ::msl::value_of_t<T> NAME(T x, I arg, int line = __builtin_LINE(),         \
                                   int col = MSL_COLUMN()) {                   \
    ::msl::value_of_t<T> v = x;                                                      \
    return sim_detail::coll(sim_detail::OP, v, (int64_t)(::msl::value_of_t<I>)arg, line, col); \
  }
MSL_COLL2(simd_shuffle, kShuffle)
MSL_COLL2(simd_shuffle_xor, kShuffleXor)
MSL_COLL2(simd_shuffle_up, kShuffleUp)
MSL_COLL2(simd_shuffle_down, kShuffleDown)
MSL_COLL2(simd_shuffle_rotate_up, kRotUp)
MSL_COLL2(simd_shuffle_rotate_down, kRotDown)
MSL_COLL2(simd_broadcast, kBroadcast)
MSL_COLL2(quad_shuffle, kQuad + sim_detail::kShuffle)
MSL_COLL2(quad_shuffle_xor, kQuad + sim_detail::kShuffleXor)
MSL_COLL2(quad_shuffle_up, kQuad + sim_detail::kShuffleUp)
MSL_COLL2(quad_shuffle_down, kQuad + sim_detail::kShuffleDown)
MSL_COLL2(quad_shuffle_rotate_up, kQuad + sim_detail::kRotUp)
MSL_COLL2(quad_shuffle_rotate_down, kQuad + sim_detail::kRotDown)
MSL_COLL2(quad_broadcast, kQuad + sim_detail::kBroadcast)
#undef MSL_COLL2

template <class T, class I>
inline ::msl::value_of_t<T> simd_shuffle_and_fill_up(T x, T fill, I d,
                                                     int line = __builtin_LINE(),
                                                     int col = MSL_COLUMN()) {
  ::msl::value_of_t<T> v = x, f = fill;
  return sim_detail::coll(sim_detail::kFillUp, v, (int64_t)d, line, col, &f);
}
template <class T, class I>
inline ::msl::value_of_t<T> simd_shuffle_and_fill_down(T x, T fill, I d,
                                                       int line = __builtin_LINE(),
                                                       int col = MSL_COLUMN()) {
  ::msl::value_of_t<T> v = x, f = fill;
  return sim_detail::coll(sim_detail::kFillDown, v, (int64_t)d, line, col, &f);
}

struct simd_vote {
  uint64_t v;
  explicit constexpr simd_vote(uint64_t x = 0) : v(x) {}
  explicit constexpr operator uint64_t() const { return v; }
  constexpr bool all() const { return v == 0xFFFFFFFFull; }
  constexpr bool any() const { return v != 0; }
};

inline bool simd_all(bool b, int line = __builtin_LINE(), int col = MSL_COLUMN()) {
  bool r;
  ::msl::CollSlot slot{&b, nullptr, &r, 0};
  msl_rt_collective(sim_detail::kAll, line, col, slot, &sim_detail::resolve_vote);
  return r;
}
inline bool simd_any(bool b, int line = __builtin_LINE(), int col = MSL_COLUMN()) {
  bool r;
  ::msl::CollSlot slot{&b, nullptr, &r, 0};
  msl_rt_collective(sim_detail::kAny, line, col, slot, &sim_detail::resolve_vote);
  return r;
}
inline simd_vote simd_ballot(bool b, int line = __builtin_LINE(), int col = MSL_COLUMN()) {
  uint64_t r;
  ::msl::CollSlot slot{&b, nullptr, &r, 0};
  msl_rt_collective(sim_detail::kBallot, line, col, slot, &sim_detail::resolve_vote);
  return simd_vote(r);
}
inline bool simd_is_first(int line = __builtin_LINE(), int col = MSL_COLUMN()) {
  bool b = true, r;
  ::msl::CollSlot slot{&b, nullptr, &r, 0};
  msl_rt_collective(sim_detail::kIsFirst, line, col, slot, &sim_detail::resolve_vote);
  return r;
}

// ---------------------------------------------------------------------------
// simdgroup matrices (8x8): every lane holds two elements of the matrix, at the
// coordinates `sg_coord` gives (the layout MLX's steel GEMM relies on); loads,
// stores and products are collectives of the whole (full) simdgroup.
// ---------------------------------------------------------------------------
namespace sim_detail {
enum { kMatLoad = 64, kMatStore, kMatMulAcc, kMatMul };

// Row and first column of the two elements lane `lane` holds; the second
// element is at (row, col + 1).
inline void sg_coord(uint32_t lane, int& row, int& col) {
  const uint32_t q = lane / 4;
  row = (int)((q & 4) + (lane / 2) % 4);
  col = (int)((q & 2) * 2 + (lane % 2) * 2);
}
inline uint32_t my_lane() { return ::msl_rt->cur ? ::msl_rt->cur->attrs.thread_index_in_simdgroup : 0; }

// Simdgroup matrix operations need all 32 lanes: a partial simdgroup (threadgroup
// size not a multiple of 32) cannot run them.
inline void require_full_simdgroup(const char* what) {
  if (!::msl_rt->cur) return;
  const ::msl::Attrs& a = ::msl_rt->cur->attrs;
  const uint32_t n = a.threads_per_threadgroup.x * a.threads_per_threadgroup.y *
                     a.threads_per_threadgroup.z;
  const uint32_t lanes = n - 32 * a.simdgroup_index_in_threadgroup;
  if (lanes < 32) {
    char m[200];
    __builtin_snprintf(m, sizeof m,
                       "%s in a simdgroup of %u threads: simdgroup matrices need all 32 lanes "
                       "(make the threadgroup size a multiple of 32)", what, lanes);
    msl_rt_fail(4, m);
  }
}

// A meeting point of the whole simdgroup that computes nothing.
inline void meet(int op, int line, int col) {
  int x = 0;
  (void)coll(op, x, 0, line, col);
}

template <class TA, class TB, class TC>
struct MatOperands {
  const vec<TA, 2>* a;
  const vec<TB, 2>* b;
  const vec<TC, 2>* c;  // nullptr: simdgroup_multiply
};

// d = a * b (+ c) over the 32 lanes' fragments; products summed in float in k order,
// rounded to the element type of d once.
template <class TD, class TA, class TB, class TC>
void resolve_mma(int op, ::msl::CollSlot* s, const uint8_t* act) {
  float A[8][8], B[8][8], C[8][8];
  for (int l = 0; l < 32; ++l) {
    if (!act[l]) return;  // unreachable: require_full_simdgroup ran first
    const auto* o = (const MatOperands<TA, TB, TC>*)s[l].in;
    int r, c;
    sg_coord((uint32_t)l, r, c);
    for (int k = 0; k < 2; ++k) {
      A[r][c + k] = (float)(*o->a)[k];
      B[r][c + k] = (float)(*o->b)[k];
      C[r][c + k] = o->c ? (float)(*o->c)[k] : 0.0f;
    }
  }
  (void)op;
  for (int l = 0; l < 32; ++l) {
    int r, c;
    sg_coord((uint32_t)l, r, c);
    auto* d = (vec<TD, 2>*)s[l].out;
    for (int k = 0; k < 2; ++k) {
      float acc = 0.0f;
      for (int j = 0; j < 8; ++j) acc += A[r][j] * B[j][c + k];
      (*d)[k] = TD(acc + C[r][c + k]);
    }
  }
}
}  // namespace sim_detail

template <class T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "the simulator models 8x8 simdgroup matrices only");
  vec<T, 2> elems;  // this lane's two elements, see sim_detail::sg_coord

  simdgroup_matrix() = default;
  // Diagonal matrix: `d` on the diagonal, zero elsewhere (as in MSL).
  template <class U, std::enable_if_t<is_scalar_num_v<::msl::value_of_t<U>>, int> = 0>
  explicit simdgroup_matrix(U d) {
    int r, c;
    sim_detail::sg_coord(sim_detail::my_lane(), r, c);
    for (int k = 0; k < 2; ++k) elems[k] = r == c + k ? T((::msl::value_of_t<U>)d) : T(0);
  }
  vec<T, 2>& thread_elements() { return elems; }
  const vec<T, 2>& thread_elements() const { return elems; }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <class T, int Cols, int Rows, class U>
inline simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(U value) {
  simdgroup_matrix<T, Cols, Rows> m;
  m.elems = vec<T, 2>(T((::msl::value_of_t<U>)value));
  return m;
}

namespace sim_detail {
// Where this lane's element k (of the two it holds) of an 8 x 8 matrix lives in memory, for
// simdgroup_load and simdgroup_store (the layout below).
inline int64_t sg_element_at(uint64_t origin_x, uint64_t origin_y, uint64_t elements_per_row,
                             bool transpose, int k) {
  int r, c;
  sg_coord(my_lane(), r, c);
  const int64_t ox = (int64_t)origin_x, oy = (int64_t)origin_y, ld = (int64_t)elements_per_row;
  return transpose ? (ox + c + k) * ld + oy + r : (oy + r) * ld + ox + c + k;
}
}  // namespace sim_detail

// Element (row, col) of the matrix lives in memory at
//   src[(origin.y + row) * elements_per_row + origin.x + col]   (transpose = false)
//   src[(origin.x + col) * elements_per_row + origin.y + row]   (transpose = true);
// each lane reads (writes) the two elements it holds.
template <class T, int Cols, int Rows, class P, class O = ulong2>
inline void simdgroup_load(simdgroup_matrix<T, Cols, Rows>& d, P src, ulong elements_per_row = Cols,
                           O matrix_origin = O(0), bool transpose_matrix = false,
                           int line = __builtin_LINE(), int col = MSL_COLUMN()) {
  sim_detail::require_full_simdgroup("simdgroup_load");
  sim_detail::meet(sim_detail::kMatLoad, line, col);
  for (int k = 0; k < 2; ++k) {
    const int64_t at = sim_detail::sg_element_at(matrix_origin.x, matrix_origin.y, elements_per_row,
                                                 transpose_matrix, k);
    T v = ::msl::at_line(src, line)[at];
    d.elems[k] = v;
  }
}

template <class T, int Cols, int Rows, class P, class O = ulong2>
inline void simdgroup_store(const simdgroup_matrix<T, Cols, Rows>& a, P dst,
                            ulong elements_per_row = Cols, O matrix_origin = O(0),
                            bool transpose_matrix = false, int line = __builtin_LINE(),
                            int col = MSL_COLUMN()) {
  sim_detail::require_full_simdgroup("simdgroup_store");
  sim_detail::meet(sim_detail::kMatStore, line, col);
  for (int k = 0; k < 2; ++k) {
    const int64_t at = sim_detail::sg_element_at(matrix_origin.x, matrix_origin.y, elements_per_row,
                                                 transpose_matrix, k);
    ::msl::at_line(dst, line)[at] = a.elems[k];
  }
}

template <class TD, class TA, class TB, class TC, int Cols, int Rows, int K>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<TD, Cols, Rows>& d,
                                          const simdgroup_matrix<TA, K, Rows>& a,
                                          const simdgroup_matrix<TB, Cols, K>& b,
                                          const simdgroup_matrix<TC, Cols, Rows>& c,
                                          int line = __builtin_LINE(), int col = MSL_COLUMN()) {
  sim_detail::require_full_simdgroup("simdgroup_multiply_accumulate");
  sim_detail::MatOperands<TA, TB, TC> o{&a.elems, &b.elems, &c.elems};
  vec<TD, 2> r;
  ::msl::CollSlot slot{&o, nullptr, &r, 0};
  msl_rt_collective(sim_detail::kMatMulAcc, line, col, slot,
                    &sim_detail::resolve_mma<TD, TA, TB, TC>);
  d.elems = r;
}

template <class TD, class TA, class TB, int Cols, int Rows, int K>
inline void simdgroup_multiply(simdgroup_matrix<TD, Cols, Rows>& d,
                               const simdgroup_matrix<TA, K, Rows>& a,
                               const simdgroup_matrix<TB, Cols, K>& b,
                               int line = __builtin_LINE(), int col = MSL_COLUMN()) {
  sim_detail::require_full_simdgroup("simdgroup_multiply");
  sim_detail::MatOperands<TA, TB, TD> o{&a.elems, &b.elems, nullptr};
  vec<TD, 2> r;
  ::msl::CollSlot slot{&o, nullptr, &r, 0};
  msl_rt_collective(sim_detail::kMatMul, line, col, slot,
                    &sim_detail::resolve_mma<TD, TA, TB, TD>);
  d.elems = r;
}

}  // namespace metal

// ---------------------------------------------------------------------------
// MLX utils.h subset (MLX prepends utils.h to every custom kernel)
// ---------------------------------------------------------------------------
using namespace metal;

typedef half float16_t;
typedef bfloat bfloat16_t;

#define INFINITY __builtin_inff()
#define NAN __builtin_nanf("")
#define MAXFLOAT 3.40282347e+38f
#define HUGE_VALF __builtin_inff()
#define FLT_MAX 3.40282347e+38f
#define FLT_MIN 1.17549435e-38f
#define FLT_EPSILON 1.1920929e-07f
#define HALF_MAX 65504.0f
#define M_PI_F 3.14159265358979323846f
#define M_PI_2_F 1.57079632679489661923f
#define M_E_F 2.71828182845904523536f
#define M_LN2_F 0.693147180559945309417f
#define M_LN10_F 2.30258509299404568402f
#define M_LOG2E_F 1.44269504088896340736f
#define M_LOG10E_F 0.434294481903251827651f
#define M_SQRT2_F 1.41421356237309504880f
#define M_1_SQRT2_F 0.707106781186547524401f

inline uint16_t bfloat16_to_uint16(const bfloat16_t x) { return x.bits; }
inline bfloat16_t uint16_to_bfloat16(const uint16_t x) {
  return bfloat16_t(metal::detail::raw_tag{}, x);
}

template <typename U>
struct Limits {
  static constexpr U max = metal::numeric_limits<U>::max();
  static constexpr U min = metal::numeric_limits<U>::lowest();
  static constexpr U finite_max = metal::numeric_limits<U>::max();
  static constexpr U finite_min = metal::numeric_limits<U>::lowest();
};
#define MSL_FLOAT_LIMIT(T)                                                \
  template <>                                                             \
  struct Limits<T> {                                                      \
    static constexpr T max = metal::numeric_limits<T>::infinity();        \
    static constexpr T min = T(-metal::numeric_limits<T>::infinity());    \
    static constexpr T finite_max = metal::numeric_limits<T>::max();      \
    static constexpr T finite_min = T(-metal::numeric_limits<T>::max());  \
  };
MSL_FLOAT_LIMIT(float)
MSL_FLOAT_LIMIT(half)
MSL_FLOAT_LIMIT(bfloat)
#undef MSL_FLOAT_LIMIT
template <>
struct Limits<bool> {
  static constexpr bool max = true;
  static constexpr bool min = false;
};

#ifdef MSL_ADDRSPACE_PASS
template <typename IdxT = int64_t, typename E, typename P, typename Q>
inline IdxT elem_to_loc(E elem, P shape, Q strides, int ndim) { (void)shape[0]; (void)strides[0]; return IdxT(elem) + ndim; }
template <typename IdxT = int64_t, typename Q>
inline IdxT elem_to_loc_1(uint elem, Q stride) { return elem * IdxT(stride); }
template <typename IdxT = int64_t, typename Q>
inline IdxT elem_to_loc_2(uint2 elem, Q strides) { return elem.x * IdxT(strides[1]); }
template <typename IdxT = int64_t, typename Q>
inline IdxT elem_to_loc_3(uint3 elem, Q strides) { return elem.x * IdxT(strides[2]); }
#else
template <typename IdxT = int64_t, typename E>
inline IdxT elem_to_loc(E elem_, ::msl::ptr<const int> shape, ::msl::ptr<const int64_t> strides,
                        int ndim) {
  IdxT elem = (IdxT)elem_;
  IdxT loc = 0;
  for (int i = ndim - 1; i >= 0 && elem > 0; --i) {
    loc += (elem % shape[i]) * IdxT(strides[i]);
    elem /= shape[i];
  }
  return loc;
}
template <typename IdxT = int64_t>
inline IdxT elem_to_loc(uint3 elem, ::msl::ptr<const int> shape,
                        ::msl::ptr<const int64_t> strides, int ndim) {
  IdxT loc = elem.x * IdxT(strides[ndim - 1]) + elem.y * IdxT(strides[ndim - 2]);
  for (int d = ndim - 3; d >= 0; --d) {
    loc += (elem.z % shape[d]) * IdxT(strides[d]);
    elem.z /= shape[d];
  }
  return loc;
}
template <typename IdxT = int64_t>
inline IdxT elem_to_loc_1(uint elem, const int64_t& stride) {
  return elem * IdxT(stride);
}
template <typename IdxT = int64_t>
inline IdxT elem_to_loc_2(uint2 elem, ::msl::ptr<const int64_t> strides) {
  return elem.x * IdxT(strides[1]) + elem.y * IdxT(strides[0]);
}
template <typename IdxT = int64_t>
inline IdxT elem_to_loc_3(uint3 elem, ::msl::ptr<const int64_t> strides) {
  return elem.x * IdxT(strides[2]) + elem.y * IdxT(strides[1]) + elem.z * IdxT(strides[0]);
}

#endif  // MSL_ADDRSPACE_PASS

template <typename T, typename U>
inline T ceildiv(T N, U M) {
  return (N + M - 1) / M;
}

// MLX defines log1p at global scope (MSL itself has none).
inline float log1p(float x) {
  float xp1 = 1.0f + x;
  if (xp1 == Limits<float>::max) return Limits<float>::max;
  if (xp1 == 1.0f) return x;
  return x * (metal::log(xp1) / (xp1 - 1.0f));
}
inline bfloat16_t log1p(bfloat16_t x) {
  float xp1 = 1.0f + static_cast<float>(x);
  if (xp1 == Limits<float>::max) return Limits<bfloat16_t>::max;
  if (xp1 == 1.0f) return x;
  return bfloat16_t(x * (metal::log(xp1) / (xp1 - 1.0f)));
}

template <bool condition, typename T, typename U>
struct ConditionalType {
  using type = U;
};
template <typename T, typename U>
struct ConditionalType<true, T, U> {
  using type = T;
};

template <typename U, typename T>
inline U cast_to(T val) {
  return static_cast<U>(val);
}

namespace msl {
inline metal::half half_lit(float f) { return metal::half(f); }
}  // namespace msl

// Address-space qualifiers: the rewriter turns qualified pointer types into
// ::msl::ptr<...> and threadgroup declarations into ::msl::tgsite; what is
// left of the keywords means nothing on a CPU.
#ifdef MSL_ADDRSPACE_PASS
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#else
#define device
#define constant
#define threadgroup
#endif
#define thread
#define kernel
