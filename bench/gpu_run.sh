#!/usr/bin/env bash
# The GPU machine's side of a run (recipe: ../shared/GPU.md; carry .whl, and .fi for FlashInfer).
# From the repo root there:
#   bench/gpu_run.sh fi             # install the FlashInfer wheel carried in .fi (it travels alone)
#   bench/gpu_run.sh tests [ARGS]   # the gpu-marked tests, then the kernel / graph test files, on CUDA
#   bench/gpu_run.sh bench ARGS     # bench/bench_offline.py ARGS (dummy weights of real shapes: bench/shapes/)
#   bench/gpu_run.sh profile ARGS   # bench/profile_step.py ARGS
#   bench/gpu_run.sh wo [ROWS]      # bench/bench_wo_gemm.py: the weight-only GEMM kernel against bf16 / torch's paths
#   bench/gpu_run.sh all            # the whole check in one call (at most ~9 min; the gpu tests had reached 174 of
#                                   # ~220 after 150 s on an H200 with -n 8): the gpu tests, the weight-only GEMMs,
#                                   # SmolLM2 shapes against transformers (greedy) and sampled, the 8B shapes,
#                                   # fp8 and int8wo at 8B
#   bench/gpu_run.sh wave [SMALL BIG]  # overlap on/off (SmolLM2 and 8B shapes), NGRAM at batch 1, the host tier's
#                                   # load-back, the 8B through HTTP, then the gpu tests (~8 min; SMALL/BIG: shape dirs)
#   core bench serving's client is aiohttp where installed: carry aiohttp, multidict, yarl, propcache, frozenlist,
#   aiosignal, aiohappyeyeballs (else httpx: its client took ~2.5x the CPU an event). py-spy (final) from its wheel.
#   The tests import openai and jsonschema: besides GPU.md's list, carry in .whl openai, httpx2,
#   httpcore2, truststore, jiter, distro, sniffio, anyio, idna, jsonschema, referencing,
#   jsonschema-specifications, rpds-py (the image's pytest-xdist runs them: tests -n 8, ~90 s on an H200).
# Logs land in $OUT (default ./gpu_out). FlashInfer's JIT cache goes to /tmp/fiws; `fisave`
# packs its built kernels into $OUT/fi_jit.tgz, and a carried .fijit/fi_jit.tgz is unpacked
# before a run, so a fresh machine skips the minutes of nvcc.
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 FLASHINFER_WORKSPACE_BASE=/tmp/fiws
mode=$1; shift
if [ "$mode" = fi ]; then
  exec python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fi .fi/*.whl
fi
if [ ! -d /tmp/site/core ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
[ -f .fijit/fi_jit.tgz ] && [ ! -d /tmp/fiws/.cache ] && tar xzf .fijit/fi_jit.tgz -C /
export PYTHONPATH=/tmp/site:/tmp/fi
case $mode in
  tests)
    python3 -m pytest -q -p no:cacheprovider --timeout 200 -m gpu "$@" tests 2>&1 | tee -a "$OUT/gpu_tests.log" | tail -25 ;;
  files)
    python3 -m pytest -q -p no:cacheprovider --timeout 100 -m "not gpu" "$@" 2>&1 | tee -a "$OUT/gpu_files.log" | tail -8 ;;
  bench)
    python3 bench/bench_offline.py "$@" 2>&1 | tee -a "$OUT/bench.log" | grep -v -i warn ;;
  wo)
    python3 bench/bench_wo_gemm.py "$@" 2>&1 | tee -a "$OUT/wo_gemm.log" ;;
  profile)
    python3 bench/profile_step.py "$@" 2>&1 | tee -a "$OUT/profile.log" | grep -v -i warn | cut -c1-220 ;;
  all)
    d="--load-format dummy --skip-tokenizer-init --skip-split"
    timeout 200 "$0" tests -n 8 -rfE
    timeout 60 "$0" wo 1,16
    timeout 80 "$0" bench --model-path bench/shapes/smollm2-135m $d --concurrency 1,16,64,256
    timeout 45 "$0" bench --model-path bench/shapes/smollm2-135m $d --concurrency 1,64,256 --skip-hf --temperature 1 --top-p 0.9
    timeout 60 "$0" bench --model-path bench/shapes/llama-3.1-8b $d --concurrency 1,16,64 --skip-hf
    for q in "--quantization fp8" "--torchao-config int8wo"; do
      timeout 55 "$0" bench --model-path bench/shapes/llama-3.1-8b $d --concurrency 1,16 --skip-hf $q
    done ;;
  wave)
    small=${1:-bench/shapes/smollm2-135m}; big=${2:-bench/shapes/llama-3.1-8b}
    d="--load-format dummy --skip-tokenizer-init --skip-split --skip-hf"
    timeout 50 python3 -m pytest -q -p no:cacheprovider -m gpu -x tests/test_lora_engine.py tests/test_lora_kernels.py \
      tests/test_triton_kernels.py tests/test_speculative_tree.py -k "lora or tree or mixed" 2>&1 | tee -a "$OUT/gpu_tests.log" | tail -6
    timeout 75 "$0" bench --model-path "$small" $d --concurrency 1,64,256 --overlap both
    timeout 115 "$0" bench --model-path "$big" $d --concurrency 1,64,256 --overlap both
    timeout 70 python3 bench/bench_speculative.py --model-path "$big" --repeats 2 2>&1 | grep -v -i warn | tee -a "$OUT/spec.log"
    timeout 45 python3 bench/bench_hicache.py --model-path "$big" --load-format dummy --no-storage --check-tokens 4 \
      2>&1 | grep -v "\[info\|warn" | tee -a "$OUT/hicache.log"
    timeout 95 "$0" serve "$big" ;;
  probe)  # overlap on/off on both shapes, then where a 256-stream overlapped step's host time goes (~4 min)
    small=${1:-bench/shapes/smollm2-135m}; big=${2:-bench/shapes/llama-3.1-8b}
    d="--load-format dummy --skip-tokenizer-init --skip-split --skip-hf"
    timeout 75 "$0" bench --model-path "$small" $d --concurrency 1,64,256 --overlap both
    timeout 90 "$0" bench --model-path "$big" $d --concurrency 1,256 --overlap both
    timeout 60 python3 bench/profile_host.py --model-path "$small" --streams 256 --overlap --stream 2>&1 \
      | grep -v -i warn | tee -a "$OUT/profile_host.log" | tail -45 ;;
  hostpath)  # issue 42 after the host-path work: overlap on/off, where the device idles (~4.5 min)
    small=bench/shapes/smollm2-135m; big=bench/shapes/llama-3.1-8b
    d="--load-format dummy --skip-tokenizer-init --skip-split --skip-hf"
    timeout 70 "$0" bench --model-path "$small" $d --concurrency 1,64,256 --overlap both
    timeout 80 "$0" bench --model-path "$big" $d --concurrency 1,256 --overlap both
    timeout 60 python3 bench/profile_gpu_busy.py "$small" 256 2>&1 | grep -v -i warn | tee -a "$OUT/busy.log"
    timeout 70 python3 bench/profile_gpu_busy.py "$big" 256 2>&1 | grep -v -i warn | tee -a "$OUT/busy.log" ;;
  http)  # the HTTP bars: SmolLM2 shapes 1,000 prompts of 128-256 in / out, engine in its own process and not; the 8B
    timeout 75 "$0" serve bench/shapes/smollm2-135m 1000 256 256 0.5
    SERVE_FLAGS=--disable-frontend-multiprocessing timeout 75 "$0" serve bench/shapes/smollm2-135m 1000 256 256 0.5
    timeout 100 "$0" serve bench/shapes/llama-3.1-8b ;;
  final)  # the gpu tests, the LoRA kernels and step, py-spy of the host under overlap at 256 streams (~5.5 min)
    timeout 170 "$0" tests -n 8 -rfE
    timeout 40 python3 bench/bench_lora_kernels.py --tokens 64 --adapters 16 --rank 16 2>&1 | grep -v -i warn \
      | tee -a "$OUT/lora_kernels.log"
    timeout 110 python3 bench/bench_lora.py --model-path bench/shapes/llama-3.1-8b --load-format dummy --streams 64 \
      --adapters 16 --repeats 2 2>&1 | grep -v -i warn | tee -a "$OUT/lora.log"
    [ -x /tmp/site/bin/py-spy ] && timeout 60 /tmp/site/bin/py-spy record -r 250 --nonblocking --format raw \
      -o "$OUT/spy.txt" -- python3 bench/bench_offline.py --model-path bench/shapes/smollm2-135m --load-format dummy \
      --skip-tokenizer-init --skip-split --skip-hf --concurrency 256 --output-len 1024 --overlap on 2>&1 | tail -4 ;;
  lora)
    timeout 110 python3 bench/bench_lora.py --model-path bench/shapes/llama-3.1-8b --load-format dummy --streams 64 \
      --adapters 16 --repeats 2 2>&1 | grep -v -i warn | tee -a "$OUT/lora.log" ;;
  wave2)
    big=${1:-bench/shapes/llama-3.1-8b}
    timeout 80 python3 bench/bench_speculative.py --model-path "$big" --repeats 2 2>&1 | grep -v -i warn | tee -a "$OUT/spec.log"
    timeout 150 python3 bench/bench_lora.py --model-path "$big" --load-format dummy --streams 64 --adapters 16 --repeats 2 \
      2>&1 | grep -v -i warn | tee -a "$OUT/lora.log"
    timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_lora_kernels.py tests/test_speculative_tree.py \
      tests/test_triton_kernels.py -k "lora or tree" 2>&1 | tee -a "$OUT/gpu_tests.log" | tail -6 ;;
  wave3)
    timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_lora_engine.py 2>&1 | tee -a "$OUT/gpu_tests.log" | tail -4
    timeout 100 python3 bench/bench_lora.py --model-path bench/shapes/llama-3.1-8b --load-format dummy --streams 64 \
      --adapters 16 --repeats 2 2>&1 | grep -v -i warn | tee -a "$OUT/lora.log" ;;
  spec)  # issue 43's CUDA graphs of verifies and drafts: their tests on CUDA, NGRAM at 8B shapes batch 1 (~4 min)
    timeout 150 python3 -m pytest -q -p no:cacheprovider --timeout 120 -rfE tests/test_cuda_graph.py \
      -m "gpu or not gpu" 2>&1 | tee -a "$OUT/gpu_tests.log" | tail -12
    timeout 150 python3 bench/bench_speculative.py --model-path bench/shapes/llama-3.1-8b --repeats 2 2>&1 \
      | grep -v -i warn | tee -a "$OUT/spec.log"
    # SPEC_STREAMS=64: the same at 64 new prompts at once (a verify past the largest verify graph decodes plainly)
    [ -n "${SPEC_STREAMS:-}" ] && timeout 200 python3 bench/bench_speculative.py --model-path bench/shapes/llama-3.1-8b \
      --repeats 1 --streams "$SPEC_STREAMS" 2>&1 | grep -v -i warn | tee -a "$OUT/spec.log"
    [ -n "${SPEC_SMALL:-}" ] && timeout 70 "$0" bench --model-path bench/shapes/smollm2-135m --load-format dummy \
      --skip-tokenizer-init --skip-split --skip-hf --concurrency 1,64,256 --overlap both ;;
  serve)  # core serve on dummy weights + core bench serving: issue 42's HTTP workload (400 prompts, all at once)
    port=30123
    python3 -m core.cli serve --model-path "$1" --load-format dummy --skip-tokenizer-init --port $port \
      --log-level warning ${SERVE_FLAGS:-} > "$OUT/serve.log" 2>&1 &
    pid=$!
    python3 -c "import time, urllib.request as u
for _ in range(240):
    try: u.urlopen('http://127.0.0.1:$port/health', timeout=1); break
    except Exception: time.sleep(0.5)"
    python3 -m core.cli bench serving --port $port --num-prompts ${2:-400} --random-input-len ${3:-1024} \
      --random-output-len ${4:-512} --random-range-ratio ${5:-0.25} --request-rate inf 2>&1 | tee -a "$OUT/serving.log" | tail -22
    kill $pid; wait $pid ;;
  fisave)
    find /tmp/fiws -name '*.so' | tar czf "$OUT/fi_jit.tgz" -T - && ls -la "$OUT/fi_jit.tgz" ;;
esac
