#!/bin/sh
# The checks for a session lent a GPU, in order, each bounded. Run from the repository root on the GPU host after
# ../shared/gpu/README.md's install, e.g.
#   eval "$(python3 .gpu/remote-env.py)" && sh benchmarks/gpu_checks.sh "$OUT"
# The recipe (here: `python3 ../shared/gpu/pack.py --out .gpu`, then into .gpu/wheels the cp312 manylinux wheels of
# msgspec and py-spy, `pip download --no-deps --only-binary=:all: --python-version 3.12`, and into
# .gpu/demo-transformer a copy of the demo Transformer's version directory, <demo models>/demo-transformer/1, which
# `nmt serve --demo` builds):
#   call 1, carry .gpu/ort.tar.xz.part-aa .gpu/parts.sha256 .gpu/remote-install.sh .gpu/wheels:
#     sh .gpu/remote-install.sh; python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/wheels/*.whl
#   call 2 at once (the host gives a machine back after 30 idle seconds), carry .gpu/ort.tar.xz.part-ab
#   .gpu/parts.sha256 .gpu/remote-install.sh .gpu/remote-env.py, timeout 580:
#     sh .gpu/remote-install.sh && eval "$(python3 .gpu/remote-env.py)" && sh benchmarks/gpu_checks.sh "$OUT"
#   call 3 at once, where device time is left, carry .gpu/remote-env.py .gpu/demo-transformer:
#     eval "$(python3 .gpu/remote-env.py)" && sh benchmarks/gpu_checks.sh "$OUT" generate
# Each step's log goes to the folder given (default: gpu-checks/); a step that fails or runs out of time does not
# stop the next, and the steps go in the order of what the open issues need most, so that a call cut short loses
# the least:
#   sh benchmarks/gpu_checks.sh "$OUT"            about 10 minutes: tests/test_gpu.py; the device's search and its
#                                                 CUDA graphs (issue 32's tok/s cells); the server against its bare
#                                                 engine at 128 callers, beam 1, its core profiled (issue 31's
#                                                 unmet GPU cell), then again with --encoder-overlap off, then
#                                                 with --hold-ended off; the serving cell at beam 4; the beam-1 cell
#                                                 with --cuda-graphs
#   sh benchmarks/gpu_checks.sh "$OUT" generate   about 5 minutes: one layer's attention with cache indirection
#                                                 against the in-place kind (cache_reorder.py, seconds); encoder
#                                                 calls at new shapes against seen and bucketed ones
#                                                 (encoder_shapes.py, seconds: why an admission's encoder call
#                                                 took ~2.6 ms on the H200); the
#                                                 engine beside Hugging Face generate, fp32 then fp16 (fp32 took
#                                                 150 s); with .gpu/demo-transformer, a static greedy batch cut
#                                                 at every end against its ended rows held (decode_cuts.py)
# benchmarks/README.md says what each should show (its sections "On an NVIDIA H200..."). A call of its own for a
# few GPU tests (`pytest tests/test_gpu.py -k ...`) needs 130 s or more: the tiny models are trained first.
set -u
out="${1:-gpu-checks}"
part="${2:-first}"
mkdir -p "$out"
export PATH="/tmp/site/bin:$PATH"  # the wheels' programs (py-spy)
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
    # cache indirection (DecoderMaskedMultiHeadAttention) against the in-place GroupQueryAttention, one layer
    step cache_reorder 30 python3 benchmarks/cache_reorder.py --provider cuda --precision fp16 --sizes SMALL \
        --batches 1 32 128 --runs 200
    # an admission's encoder call at a shape not run before, against the same shape again and a bucket's
    step encoder_shapes 60 python3 benchmarks/encoder_shapes.py --size SMALL --precision fp16 --provider cuda
    step engine_vs_generate 240 python3 benchmarks/engine_throughput.py --sizes SMALL --provider cuda \
        --precisions fp32 fp16 --batches 1 32 128 --beams 1 4 --repeats 1 --seconds 1 --pause 0
    if [ -d .gpu/demo-transformer ]; then
        # a static batch of 128 greedy sentences of mixed lengths: the run cut at every end, against the ended rows
        # held (the default on a device, seventeenth session)
        cuts="benchmarks/decode_cuts.py --model-version .gpu/demo-transformer --provider cuda --sentences 128"
        step decode_cuts_cut 40 python3 $cuts --repeats 5 --no-hold-ended
        step decode_cuts_held 40 python3 $cuts --repeats 5
    fi
    exit 0
fi
# the device's beam runs, their CUDA graphs and the plain greedy steps, against the CPU
step test_gpu 170 python3 -m pytest -q -rA -p no:cacheprovider tests/test_gpu.py
# host's selection / device's / device's with CUDA graphs, alternating, SMALL fp16, forced lengths (beam 1: the
# plain arg-max steps, the first two ways alike, against their CUDA graphs)
step device_search 90 python3 benchmarks/device_search.py --size SMALL --precision fp16 --provider cuda \
    --batches 1 32 128 --beams 1 4 --repeats 4 --cuda-graphs
# each server against its bare engine, SMALL fp16, 2 front-ends, 128 callers, the budgets that follow the device
serve="--marian SMALL --precision fp16 --provider cuda --callers 128 --rates --requests 1024 --repeats 1 --single 10 --frontends 2"
# the beam-1 cell with each server's engine core sampled by py-spy (benchmarks/core_profile.py; py-spy from the
# wheels): where the core's time goes where the server reached 0.52-0.59x its bare engine
step batching_beam1 120 python3 benchmarks/batching.py $serve --beam-size 1 \
    --profile-core "$out/core-beam1"
# the same cell with the joining sentences encoded on the decode's thread, as before the eighteenth session: what
# --encoder-overlap (on by default on CUDA) bought
step batching_beam1_no_overlap 120 python3 benchmarks/batching.py $serve --beam-size 1 \
    --serve-args "--encoder-overlap off"
# the same cell with every sentence's end cutting the run (--hold-ended off, as before the nineteenth session): what
# holding ended rows (on by default on CUDA since then, set from the CPU's emulations) bought
step batching_beam1_no_hold 120 python3 benchmarks/batching.py $serve --beam-size 1 --serve-args "--hold-ended off"
step batching_beam4 170 python3 benchmarks/batching.py $serve --beam-size 4
# last, where the call's time allows: the beam-1 cell with the server's steps captured as CUDA graphs (its encoder
# calls still beside the decode, waiting only for the worker's captures), against the beam-1 cells above
step batching_beam1_graphs 120 python3 benchmarks/batching.py $serve --beam-size 1 --serve-args=--cuda-graphs
