strata_test(tiered_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/tiered_test.cc LIBS strata_engine)
