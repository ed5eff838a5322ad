strata_test(placement_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/placement_test.cc LIBS strata_plan)
strata_test(param_window_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/param_window_test.cc LIBS strata_memory)
strata_test(bound_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/bound_test.cc LIBS strata_plan)
