# tests of src/config
strata_test(config_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/config_test.cc LIBS strata_config)
