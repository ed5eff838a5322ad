# The step's numerics options: fp16 with loss scaling (the scaler's schedule,
# skipped steps) and run.recompute (kept graphs against recompute).
strata_test(step_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/step_test.cc LIBS strata_engine)
# Not a test: GPU benchmark (a)'s reference, a plain LibTorch training loop of
# a config's model with LibTorch's fused AdamW (tools/bench_gpu.py runs it).
add_executable(bench_train_torch ${PROJECT_SOURCE_DIR}/tools/bench_train_torch.cc)
target_link_libraries(bench_train_torch PRIVATE strata_model strata_config ${TORCH_LIBRARIES} CLI11::CLI11
                                                nlohmann_json::nlohmann_json strata_warnings)
