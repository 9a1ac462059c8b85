// The vectors Aerie's CPU kernels compute in: GCC vector types as wide as the build's instruction
// set (GCC splits a wider vector type into pieces, and lowers some of its operations to scalar
// code: 8x slower on AVX2 alone), and their loads and stores. Included by each kernel's source
// inside its anonymous namespace (so each library keeps its own), after <cstdint> and <cstring>;
// models/native.py digests it with every kernel.
#pragma once

#if defined(__AVX512F__)
constexpr int L = 16;
#elif defined(__AVX__)
constexpr int L = 8;
#else
constexpr int L = 4;
#endif
typedef float vf __attribute__((vector_size(4 * L)));
typedef int32_t vi __attribute__((vector_size(4 * L)));
typedef uint32_t vu __attribute__((vector_size(4 * L)));

template <typename V = vf, typename T>
inline V load(const T* p) { V v; std::memcpy(&v, p, sizeof v); return v; }
template <typename T, typename V>
inline void store(T* p, V v) { std::memcpy(p, &v, sizeof v); }
