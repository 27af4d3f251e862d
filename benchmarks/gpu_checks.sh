#!/bin/sh
# The checks for a host with an NVIDIA GPU, in order, each bounded; run from the repository root once
# onnxruntime-gpu is installed (docs/gpu.md):
#   sh benchmarks/gpu_checks.sh OUT            about 9 minutes: tests/test_gpu.py; beam search's selection on the
#                                              device and its CUDA graphs against the host's (tools/probes/device_search.py);
#                                              the server against its bare engine at 128 callers, beam 1 (its engine
#                                              core profiled with py-spy when installed) and beam 4; beam 1 with
#                                              --cuda-graphs
#   sh benchmarks/gpu_checks.sh OUT generate   about 5 minutes: one layer's attention with cache indirection against
#                                              the in-place kind; encoder calls at new shapes against seen and
#                                              bucketed ones; the engine beside Hugging Face generate, fp32 and fp16;
#                                              with DEMO_VERSION set to a demo Transformer's version directory, a
#                                              static greedy batch cut at every end against its ended rows held
# Each step's log goes to OUT (default gpu-checks/); a step that fails or runs out of time does not stop the next.
# docs/gpu.md says what each step decides.
set -u
out="${1:-gpu-checks}"
part="${2:-first}"
mkdir -p "$out"
step() {
    name="$1"; limit="$2"; shift 2
    echo "== $name ($limit s): $*"
    start=$(date +%s)
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "   exit $? after $(( $(date +%s) - start )) s; last lines:"
    tail -n 14 "$out/$name.log" | sed 's/^/   /'
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/device.txt" 2>&1
cat "$out/device.txt"
if [ "$part" = generate ]; then
    step cache_reorder 30 python3 tools/probes/cache_reorder.py --provider cuda --precision fp16 --sizes SMALL \
        --batches 1 32 128 --runs 200
    step encoder_shapes 60 python3 tools/probes/encoder_shapes.py --size SMALL --precision fp16 --provider cuda
    step engine_vs_generate 240 python3 benchmarks/engine_throughput.py --sizes SMALL --provider cuda \
        --precisions fp32 fp16 --batches 1 32 128 --beams 1 4 --repeats 1 --seconds 1 --pause 0
    if [ -n "${DEMO_VERSION:-}" ]; then
        cuts="tools/probes/decode_cuts.py --model-version $DEMO_VERSION --provider cuda --sentences 128"
        step decode_cuts_cut 40 python3 $cuts --repeats 5 --no-hold-ended
        step decode_cuts_held 40 python3 $cuts --repeats 5
    fi
    exit 0
fi
step test_gpu 170 python3 -m pytest -q -rA -p no:cacheprovider tests/test_gpu.py
step device_search 90 python3 tools/probes/device_search.py --size SMALL --precision fp16 --provider cuda \
    --batches 1 32 128 --beams 1 4 --repeats 4 --cuda-graphs
serve="--marian SMALL --precision fp16 --provider cuda --callers 128 --rates --requests 1024 --repeats 1 --single 10 --frontends 2"
profile=""
command -v py-spy >/dev/null 2>&1 && profile="--profile-core $out/core-beam1"
step batching_beam1 120 python3 benchmarks/batching.py $serve --beam-size 1 $profile
step batching_beam4 170 python3 benchmarks/batching.py $serve --beam-size 4
step batching_beam1_graphs 120 python3 benchmarks/batching.py $serve --beam-size 1 --serve-args=--cuda-graphs
