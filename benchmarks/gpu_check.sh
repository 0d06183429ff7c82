#!/usr/bin/env bash
# One-shot check of the CUDA path (issue [gpu]); prints a markdown table at the end.
#
#   bash benchmarks/gpu_check.sh            # from the repository root, on a CUDA machine
#
# 1. kernel tests compiled natively (TRITON_INTERPRET unset): attention, KV copy, FutureMap
# 2. the row-reuse race test on CUDA streams (tests/test_decode_race_cuda.py), the KV
#    write's landing before a transfer is reported (tests/test_transfer_cuda.py), and the
#    decode forward under torch.cuda.set_sync_debug_mode("error") (test_forward_sync_cuda.py)
# 3. greedy tokens on CUDA equal transformers' (tests/test_reference_tokens_cuda.py: the
#    offline engines, and bfloat16 against transformers in bf16 to bf16's precision;
#    tests/test_cuda_graph.py: graph replay vs the eager forward;
#    tests/test_e2e_pd_cuda.py: `pdserve up --device cuda` over ZeroMQ)
# 4. benchmarks/decode_overlap.py, overlap on vs off, with the decode's CUDA graphs and
#    without (decode-overlap-eager)
# 5. benchmarks/kv_transfer.py --device cuda (ZeroMQ between GPU pools through pinned
#    staging, vs raw TCP between host buffers)
# GPU_CHECK_ONLY="step step ..." runs only those steps; GPU_CHECK_LOG=DIR keeps the logs
# there. Each step has its own timeout (13 minutes in all at worst; about 5 when every
# step passes on an H200: see the README's table). Exit status: 0 if
# every step passed, 1 if one failed, 2 if there is no CUDA GPU.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
unset TRITON_INTERPRET  # compile the kernels; never interpret them here
export PDSERVE_CACHE_DIR=${PDSERVE_CACHE_DIR:-$PWD/.cache}
LOG=${GPU_CHECK_LOG:-$(mktemp -d -t gpu_check.XXXX)}  # one log per step
mkdir -p "$LOG"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA GPU visible (torch.cuda.is_available() is False): nothing to check." >&2
    echo "gpu_check: the CPU path is covered by 'make test' (kernels run under TRITON_INTERPRET)." >&2
    exit 2
fi
DEVICE_NAME=$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))')
ROWS=()
FAILED=0

step() {  # step NAME TIMEOUT_S CMD...: runs CMD, logs it, appends a table row
    local name=$1 limit=$2 t0 rc
    shift 2
    case " ${GPU_CHECK_ONLY:-$name} " in *" $name "*) ;; *) return 0 ;; esac
    t0=$(date +%s)
    timeout "$limit" "$@" >"$LOG/$name.log" 2>&1
    rc=$?
    local secs=$(($(date +%s) - t0)) status=pass
    [ $rc -eq 124 ] && status="TIMEOUT (${limit}s)"
    [ $rc -ne 0 ] && [ $rc -ne 124 ] && status="FAIL (rc $rc)"
    [ $rc -ne 0 ] && FAILED=1 && tail -n 25 "$LOG/$name.log" >&2
    ROWS+=("| $name | $status | ${secs}s | $(summary "$name") |")
}

summary() {  # the one-line result of a step, from its log
    case $1 in
    kernel-tests | race-test-cuda | sync-free-forward | tokens-cuda | e2e-pd-cuda) tail -n 1 "$LOG/$1.log" | tr -d '=' | sed 's/^ *//' ;;
    decode-overlap*) "$PY" - "$LOG/$1.log" <<'EOF'
import json, sys
try:
    rows = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])["results"]
    print("; ".join(f"c={r['concurrency']}: off {r['overlap_off']['tokens_per_s']:.0f} / "
                    f"on {r['overlap_on']['tokens_per_s']:.0f} tok/s (x{r['speedup']:.2f})"
                    for r in rows))
except Exception as exc:
    print(f"no result ({type(exc).__name__})")
EOF
        ;;
    kv-transfer) "$PY" - "$LOG/$1.log" <<'EOF'
import json, sys
try:
    rows = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])["results"]
    print("; ".join(f"{r['tokens']} tok: zmq {r['zmq_gbps']:.2f} / raw {r['raw_tcp_gbps']:.2f} GB/s"
                    for r in rows))
except Exception as exc:
    print(f"no result ({type(exc).__name__})")
EOF
        ;;
    esac
}

step kernel-tests 120 "$PY" -m pytest -q -p no:cacheprovider \
    tests/test_triton_attention.py tests/test_kv_copy.py tests/test_future_map.py
step race-test-cuda 60 "$PY" -m pytest -q -p no:cacheprovider tests/test_decode_race_cuda.py \
    tests/test_transfer_cuda.py
step sync-free-forward 60 "$PY" -m pytest -q -p no:cacheprovider tests/test_forward_sync_cuda.py
step tokens-cuda 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_reference_tokens_cuda.py \
    tests/test_cuda_graph.py
step e2e-pd-cuda 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_e2e_pd_cuda.py

OVERLAP_ARGS=(--concurrency 16 64 --prompt-len 128 --output-len 64 --rounds 3 --json)
if "$PY" benchmarks/decode_overlap.py --help 2>/dev/null | grep -q -- '--device'; then
    OVERLAP_ARGS+=(--device cuda)
else
    echo "gpu_check: decode_overlap.py has no --device flag: it measures the CPU path" >&2
fi
step decode-overlap 120 "$PY" benchmarks/decode_overlap.py "${OVERLAP_ARGS[@]}"
step decode-overlap-eager 120 "$PY" benchmarks/decode_overlap.py "${OVERLAP_ARGS[@]}" \
    --disable-cuda-graph
step kv-transfer 60 "$PY" benchmarks/kv_transfer.py --device cuda --tokens 1024 8192 --repeats 3 \
    --rounds 2 --no-curve --json

echo
echo "pdserve gpu_check, $(date -u +%Y-%m-%d), $DEVICE_NAME, torch $("$PY" -c 'import torch; print(torch.__version__)')"
echo
echo "| step | result | time | summary |"
echo "|---|---|---:|---|"
printf '%s\n' "${ROWS[@]}"
echo
echo "logs: $LOG"
exit $FAILED
