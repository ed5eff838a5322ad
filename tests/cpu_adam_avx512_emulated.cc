// Tests only: cpu_adam/kernel_avx512.cc compiled over tests/avx512_emulation.h
// instead of <immintrin.h>, with no -m flags, so its code runs on any x86-64.
#define STRATA_CPU_ADAM_EMULATE_AVX512 1
#include "cpu_adam/kernel_avx512.cc"
