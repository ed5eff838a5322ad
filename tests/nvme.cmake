# nvme: the I/O engine over every backend (io_uring, thread pool; direct and
# buffered), fault injection, CRC-32C, and the swap store.
strata_test(nvme_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/nvme_test.cc LIBS strata_nvme)
