#!/bin/sh
# The first checks for a session lent a GPU, in order, each bounded (about 9 minutes in all: one device call).
# Run from the repository root on the GPU host after ../shared/gpu/README.md's install, e.g.
#   eval "$(python3 .gpu/remote-env.py)" && sh benchmarks/gpu_checks.sh "$OUT"
# Each step's log goes to the folder given (default: gpu-checks/); a step that fails or runs out of time does not
# stop the next. benchmarks/README.md ("CUDA graphs for the device's beam and arg-max runs") says what each
# should show.
#
# A second call within the host's idle window runs the serving checks: sh benchmarks/gpu_checks.sh "$OUT" serving
# (about 9 minutes: static against continuous batching at 128 callers, beams 1 and 4, with the batching budgets
# that now follow the device, then beam 4 with the device's search and its CUDA graphs).
set -u
out="${1:-gpu-checks}"
part="${2:-engine}"
mkdir -p "$out"
step() {
    name="$1"; limit="$2"; shift 2
    echo "== $name ($limit s): $*"
    start=$(date +%s)
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "   exit $? after $(( $(date +%s) - start )) s; last lines:"
    tail -n 12 "$out/$name.log" | sed 's/^/   /'
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/device.txt" 2>&1
cat "$out/device.txt"
if [ "$part" = serving ]; then
    # issue 31's GPU cells: each server against its bare engine, SMALL fp16, 2 front-ends, 128 callers
    serve="--marian SMALL --precision fp16 --provider cuda --callers 128 --rates --requests 1024 --repeats 1 --single 10 --frontends 2"
    step batching_beam1 200 python3 benchmarks/batching.py $serve --beam-size 1
    step batching_beam4 200 python3 benchmarks/batching.py $serve --beam-size 4
    step batching_beam4_device 170 python3 benchmarks/batching.py $serve --beam-size 4 \
        --serve-args "--device-search --cuda-graphs"
    exit 0
fi
# the device's beam runs, their CUDA graphs and the tenth session's plain greedy fix, against the CPU
step test_gpu 240 python3 -m pytest -q tests/test_gpu.py
# host's selection / device's / device's with CUDA graphs, alternating, SMALL fp16, forced lengths (beam 1:
# the plain arg-max steps, the first two ways alike, against their CUDA graphs)
step device_search 300 python3 benchmarks/device_search.py --size SMALL --precision fp16 --provider cuda \
    --batches 1 32 128 --beams 1 4 --repeats 4 --cuda-graphs
