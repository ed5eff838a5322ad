# The GPU proof's one-call script (tools/gpu_host_check.sh gpu-proof-2, tools/gpu_proof.py) run end to end
# on the CPU device with tiny configs: a broken script fails here, not on a GPU host.
add_test(NAME GpuProofDryRun COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/gpu_proof_dry_run.sh ${PROJECT_BINARY_DIR}
         ${STRATA_WITH_CUDA})
set_tests_properties(GpuProofDryRun PROPERTIES TIMEOUT 600 ENVIRONMENT "OMP_NUM_THREADS=1;STRATA_RATES_CACHE=off")
