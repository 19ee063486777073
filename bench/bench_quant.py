"""Batch-1 decode speed of the default model, dense vs weight-only int8 vs 4-bit, in one run.

Each mode is its own engine over the embedded SmolLM2-135M-Instruct, all at ``--dtype auto``:
``dense`` (``--quantization none``: the GGUF dequantized), ``int8wo`` (``--torchao-config
int8wo``: Linear layers and the LM head per-channel int8), ``int4`` (the default for a GGUF
model on CPU: the file's Q4_1 blocks repacked to int4, its Q8_0 head as int8) and, with
``--modes``, ``int4wo-32`` (4-bit quantized at load, the LM head int8). One request
of ``--input-len`` random tokens generates exactly ``--output-len`` tokens (EOS ignored); the
modes take turns for ``--repeats`` rounds so a noisy machine hurts them alike, and the median
and best of each are printed: output tok/s over the whole request and decode tok/s (after the
first token). Engines are built one at a time, measured, and shut down.

With ``--llama-cpp-python PY`` (a Python that has ``llama-cpp-python``, see
``../shared/bench/README.md``), llama.cpp runs the same GGUF file in the same rounds, as the mode
``llama.cpp``: the same prompt evaluated, then exactly ``--output-len`` greedy tokens, each
sampled and evaluated one at a time, with ``--cpu-threads`` threads; a subprocess per round.

    python bench/bench_quant.py --cpu-threads 2 [--llama-cpp-python /tmp/llama-venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import core  # noqa: F401  (before torch: its OpenMP wait policy, see core/openmp.py)
import torch

from core.engine.device import cpu_model_name

MODES = {
    "dense": {"quantization": "none"},
    "int8wo": {"torchao_config": "int8wo"},
    "int4": {"quantization": "gguf"},  # the file's blocks: the engine's default on CPU, except with an
    # explicit --dtype float32 (the exact reference then), so asked for by name
    "int4wo-32": {"torchao_config": "int4wo-32"},
}


def run_once(engine, prompt: list[int], out_len: int) -> tuple[float, float]:
    """(output tok/s over the request, decode tok/s after the first token)."""
    params = {"temperature": 0, "max_new_tokens": out_len, "ignore_eos": True}
    t0 = time.perf_counter()
    first = None
    n = 0
    for chunk in engine.generate(input_ids=prompt, sampling_params=params, stream=True):
        if first is None and chunk["output_ids"]:
            first = time.perf_counter()
        n = len(chunk["output_ids"])
    wall = time.perf_counter() - t0
    return n / wall, (n - 1) / (t0 + wall - first)


LLAMA_CPP = """
import json, sys, time
from llama_cpp import Llama
path, threads, out_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
prompt = json.loads(sys.argv[4])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False)
t0 = time.perf_counter()
llm.eval(prompt)
tok = llm.sample(temp=0.0)
first = time.perf_counter()
for _ in range(out_len - 1):
    llm.eval([tok])
    tok = llm.sample(temp=0.0)
end = time.perf_counter()
print(json.dumps([out_len / (end - t0), (out_len - 1) / (end - first)]))
"""


def run_llama_cpp(python: str, threads: int, prompt: list[int], out_len: int) -> tuple[float, float]:
    from core.engine.model_loader.loader import default_model_path

    proc = subprocess.run([python, "-c", LLAMA_CPP, str(default_model_path()), str(threads), str(out_len), json.dumps(prompt)],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise SystemExit(f"llama.cpp run failed: {proc.stderr[-2000:]}")
    out, dec = json.loads(proc.stdout.strip().splitlines()[-1])
    return out, dec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="dense,int8wo,int4", help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cpu-threads", type=int, default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--llama-cpp-python", default=None, help="a Python with llama-cpp-python: adds llama.cpp as a mode")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        ap.error(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")

    from core import Engine
    from core.engine.device import cpu_native_bf16
    from core.log import configure_logging

    configure_logging("warning")
    native, why = cpu_native_bf16()
    print(f"# {cpu_model_name()}; torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}; "
          f"native bf16: {native} ({why}); threads {args.cpu_threads or torch.get_num_threads()}")
    prompt = torch.randint(100, 49000, (args.input_len,), generator=torch.Generator().manual_seed(0)).tolist()
    engines = {}
    for mode in modes:
        engines[mode] = Engine(dtype=args.dtype, max_total_tokens=args.input_len + args.output_len + 64,
                               max_running_requests=1, cpu_threads=args.cpu_threads, log_level="warning",
                               disable_radix_cache=True, **MODES[mode])
        run_once(engines[mode], prompt, 8)  # warm-up (and the packed LM head is built on first use)
    results: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    if args.llama_cpp_python:
        results["llama.cpp"] = []
    threads = args.cpu_threads or torch.get_num_threads()
    try:
        for _ in range(args.repeats):
            for mode in modes:
                results[mode].append(run_once(engines[mode], prompt, args.output_len))
            if args.llama_cpp_python:
                results["llama.cpp"].append(run_llama_cpp(args.llama_cpp_python, threads, prompt, args.output_len))
    finally:
        for e in engines.values():
            e.shutdown()
    dtype = next(iter(engines.values())).engine.model_config.dtype
    print(f"# SmolLM2-135M-Instruct, batch 1, {args.input_len} in / {args.output_len} out, activations "
          f"{str(dtype).removeprefix('torch.')}, {args.repeats} rounds (modes interleaved)")
    print("| mode | output tok/s (median / best) | decode tok/s (median / best) | vs dense |")
    print("|---|---:|---:|---:|")
    base = statistics.median(d for _, d in results[modes[0]])
    for mode in results:
        out = [o for o, _ in results[mode]]
        dec = [d for _, d in results[mode]]
        print(f"| {mode} | {statistics.median(out):.1f} / {max(out):.1f} | {statistics.median(dec):.1f} / "
              f"{max(dec):.1f} | {statistics.median(dec) / base:.2f}x |")


if __name__ == "__main__":
    main()
