#!/usr/bin/env bash
# The GPU paths, on a machine with a CUDA device (a lent device machine; CI has none):
# tests/gpu (bf16 engine, determinism, KV moves, CUDA tensor channels, CUDA IPC weights, encoders, experts), `phalanx bench
# engine`, `phalanx bench multimodal` and `phalanx bench moe` on the GPU, and the migration, engine-failover and MoE suites
# with CUDA workers.
# Needs torch with CUDA and the services' packages importable (PYTHONPATH=services plus what the machine lacks).
# Usage: scripts/gpu_checks.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-/tmp/phalanx-gpu}"
mkdir -p "$out"
export PYTHONPATH="$PWD/services${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 GRPC_ENABLE_FORK_SUPPORT=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -m pytest tests/gpu -p no:cacheprovider -o filterwarnings= -m gpu -q -s -rfE 2>&1 | tee "$out/tests_gpu.log"
for model in phalanx-tiny-moe phalanx-tiny-dense; do
  python3 -m phalanx.cli bench engine --model "$model" --device cuda --batches 1,8,32,128 --repeats 3 --json \
    2>&1 | tee "$out/bench_engine_${model}.json"
done
# Media TTFT and encoder batching: encoders on the LLM's GPU, then on their own device (the CPU).
python3 -m phalanx.cli bench multimodal --device cuda --json 2>&1 | tee "$out/bench_multimodal_cuda.json"
python3 -m phalanx.cli bench multimodal --device cuda --encoder-device cpu --torch-threads 8 --json \
  2>&1 | tee "$out/bench_multimodal_cuda_cpu_encoder.json"
# The integration suites with every worker on the GPU (and the failover slots' weights there, over CUDA IPC).
PHALANX_ENGINE_DEVICE=cuda python3 -m pytest tests/integration/test_migration.py -p no:cacheprovider -o filterwarnings= -q -rfE \
  2>&1 | tee "$out/migration_cuda.log"
PHALANX_ENGINE_DEVICE=cuda PHALANX_MEMORY_DEVICE=cuda python3 -m pytest tests/integration/test_engine_failover.py \
  -p no:cacheprovider -o filterwarnings= -q -rfE 2>&1 | tee "$out/engine_failover_cuda.log"
# Disaggregated MoE with the attention, expert and monolithic workers on the GPU (bfloat16), then its benchmark there.
PHALANX_ENGINE_DEVICE=cuda PHALANX_EXPERT_DEVICE=cuda python3 -m pytest tests/integration/test_moe_disaggregated.py \
  tests/integration/test_moe_batching.py -p no:cacheprovider -o filterwarnings= -q -rfE 2>&1 | tee "$out/moe_cuda.log"
python3 -m phalanx.cli bench moe --device cuda --json 2>&1 | tee "$out/bench_moe_cuda.json"
