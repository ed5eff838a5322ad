strata_test(placement_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/placement_test.cc LIBS strata_memory)
