// Vectorizable float math shared by the CPU kernels (decode_attention.cpp, decoder_ops.cpp).
#pragma once
#include <cmath>
#include <cstdint>

// exp(x) in a form the compiler vectorizes (std::exp stays scalar): Cephes' single-precision polynomial after a
// Cody-Waite reduction, ~1 ulp; inputs clamped to [-87, 88] (exp(-87) ~ 1.6e-38, exp(88) ~ 1.7e38), so the result
// is always finite and positive.
static inline float exp_clamped(float x) {
  const float c = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const float n = std::floor(c * 1.44269504088896341f + 0.5f);
  float r = c - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500E-4f;
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  // 2^n from its bits; a bit cast (not memcpy) keeps the loops around it vectorizable.
  return p * __builtin_bit_cast(float, bits);
}
