# cpu_adam: the kernels against a double reference (no LibTorch), and against
# torch::optim::AdamW in a separate target, so that only it pays for LibTorch.
strata_test(cpu_adam_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/cpu_adam_test.cc LIBS strata_cpu_adam)
