# cpu_adam: the kernels against a double reference (no LibTorch), and against
# torch::optim::AdamW in a separate target, so that only it pays for LibTorch.
strata_test(cpu_adam_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/cpu_adam_test.cc LIBS strata_cpu_adam)
# The head's fused cross-entropy kernels (cpu_adam/cross_entropy.h).
strata_test(cross_entropy_kernel_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/cross_entropy_kernel_test.cc
            LIBS strata_cpu_adam)

# The AVX-512 kernel code on any CPU, over scalar stand-ins for its intrinsics
# (CI machines have no AVX-512).
strata_test(cpu_adam_avx512_emulated_test
            SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/cpu_adam_avx512_emulated_test.cc
                    ${CMAKE_CURRENT_SOURCE_DIR}/cpu_adam_avx512_emulated.cc
            LIBS strata_cpu_adam)
target_include_directories(cpu_adam_avx512_emulated_test PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
# -Wno-psabi: the stand-ins pass 64-byte vectors without AVX-512 enabled, all
# inside this one file, so the ABI note does not apply.
target_compile_options(cpu_adam_avx512_emulated_test PRIVATE -ffp-contract=off -Wno-psabi)

if(STRATA_LEAF_ONLY)
  return()
endif()
strata_test(cpu_adam_torch_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/cpu_adam_torch_test.cc
            LIBS strata_cpu_adam ${TORCH_LIBRARIES})

# Not a test: LibTorch's CPU AdamW against CpuAdam (the LibTorch half of
# `strata bench-adam`); lives here because cpu_adam itself must not see LibTorch.
add_executable(bench_adam_torch ${PROJECT_SOURCE_DIR}/tools/bench_adam_torch.cc)
target_link_libraries(bench_adam_torch PRIVATE strata_cpu_adam ${TORCH_LIBRARIES} CLI11::CLI11
                                               strata_warnings)
