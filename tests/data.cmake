strata_test(data_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/data_test.cc LIBS strata_data)
