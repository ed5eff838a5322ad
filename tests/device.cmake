# The device layer: the CPU implementation always; the CUDA one where the
# build has it and the machine has a GPU (skipped, with the reason, elsewhere).
strata_test(device_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/device_test.cc LIBS strata_plan)
