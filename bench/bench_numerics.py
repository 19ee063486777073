"""Teacher-forced top-1 agreement with the float32 model, on the default GGUF, in one run.

The text is this repository's README and docs, tokenized and cut into windows of
``--window`` tokens (the first ``--windows`` of them). For every position the reference is transformers' float32 model of the same
GGUF file (dequantized exactly); each path under test is asked for its most likely next token
there, given the true prefix, and the table prints how often that is the reference's top token,
the mean negative log-likelihood of the true next token (nats) and how many positions had an
exact tie at the top (two tokens with the same logit: argmax then picks by token id).

Paths (one engine at a time, ``--cpu-threads`` threads):
- ``core default``: ``core serve``'s default for this CPU (the file's blocks; prompt chunks of
  ``--chunk`` tokens, so every GEMM runs the decode kernels: int8 activations, the int8-blocks head);
- ``core dense``: ``--quantization none`` (the dequantized weights in the serving dtype);
- ``llama.cpp`` with ``--llama-cpp-python PY`` (a Python that has ``llama-cpp-python``, see
  ``../shared/bench/README.md``): the same file, ``logits_all``, batches of ``--chunk`` tokens.

    python bench/bench_numerics.py --cpu-threads 2 [--llama-cpp-python /tmp/llama-venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import core  # noqa: F401  (before torch: its OpenMP wait policy, see core/openmp.py)
import torch

from core.engine.device import cpu_model_name
from core.engine.model_loader.loader import default_model_path, resolve_model_path

ROOT = Path(__file__).resolve().parents[1]

LLAMA_CPP = """
import json, sys
import numpy as np
from llama_cpp import Llama
path, threads, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
windows = json.load(open(sys.argv[4]))
llm = Llama(model_path=path, n_ctx=max(len(w) for w in windows) + 8, n_threads=threads, n_batch=chunk, n_ubatch=chunk,
            logits_all=True, verbose=False)
out = []
for w in windows:
    llm.reset()
    llm.eval(w)
    s = np.asarray(llm.scores[: len(w)], dtype=np.float64)
    m = s.max(-1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(s - m).sum(-1))
    top = s.argmax(-1)
    ties = int(((s == m).sum(-1) > 1)[:-1].sum())
    nll = [float(lse[i] - s[i, w[i + 1]]) for i in range(len(w) - 1)]
    out.append({"top": top[:-1].tolist(), "nll": nll, "ties": ties})
json.dump(out, open(sys.argv[5], "w"))
"""


def windows(tokenizer, size: int) -> list[list[int]]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    ids: list[int] = []
    for f in files:
        ids += tokenizer(f.read_text(), add_special_tokens=False)["input_ids"]
    return [ids[i : i + size] for i in range(0, len(ids) - size + 1, size)]


def reference(ws: list[list[int]]) -> list[dict]:
    """transformers' float32 model of the GGUF: top token and log-probabilities per position."""
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for w in ws:
            logp = torch.log_softmax(model(torch.tensor([w])).logits[0, :-1].float(), -1)
            top2 = logp.topk(2, -1).values
            out.append({"top": logp.argmax(-1).tolist(), "nll": (-logp[torch.arange(len(w) - 1), w[1:]]).tolist(),
                        "ties": int((top2[:, 0] == top2[:, 1]).sum())})
    return out


def core_path(ws: list[list[int]], threads: int, chunk: int, **kwargs) -> list[dict]:
    """Each position's top token, NLL and ties from the engine's prompt logprobs (top 2 per position)."""
    from core.engine.offline import Engine

    engine = Engine(cpu_threads=threads, chunked_prefill_size=chunk, disable_radix_cache=True, log_level="warning",
                    **kwargs)
    out = []
    try:
        for w in ws:
            r = engine.generate(input_ids=w, sampling_params={"max_new_tokens": 1, "temperature": 0},
                                return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
            tops = r["meta_info"]["input_top_logprobs"][1:]  # entry i: the candidates for token i given < i
            lps = r["meta_info"]["input_token_logprobs"][1:]
            # the offline engine's entries, SGLang's: (logprob, token id, text)
            out.append({"top": [t[0][1] for t in tops], "nll": [-lp for lp, _, _ in lps],
                        "ties": sum(1 for t in tops if t[0][0] == t[1][0])})
    finally:
        engine.shutdown()
    return out


def llama_cpp(ws: list[list[int]], python: str, threads: int, chunk: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        src, dst = Path(d) / "windows.json", Path(d) / "out.json"
        src.write_text(json.dumps(ws))
        subprocess.run([python, "-c", LLAMA_CPP, str(default_model_path()), str(threads), str(chunk), str(src), str(dst)],
                       check=True)
        return json.loads(dst.read_text())


def score(ref: list[dict], got: list[dict], ws: list[list[int]]) -> tuple[int, float, float, int]:
    """(positions, top-1 agreement %, mean NLL of the true next token, exact ties at the top)."""
    n = agree = ties = 0
    nll = 0.0
    for r, g, w in zip(ref, got, ws):
        top = g["top"][: len(w) - 1]
        n += len(top)
        agree += sum(int(a == b) for a, b in zip(top, r["top"]))
        nll += sum(g["nll"][: len(w) - 1])
        ties += g["ties"]
    return n, 100 * agree / n, nll / n, ties


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-threads", type=int, default=2)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--windows", type=int, default=18, help="the first N windows (18 x 511 = 9,198 positions)")
    ap.add_argument("--chunk", type=int, default=32, help="prompt tokens per forward (decode-sized GEMMs)")
    ap.add_argument("--llama-cpp-python", help="a Python with llama-cpp-python: add llama.cpp on the same file")
    args = ap.parse_args()
    torch.set_num_threads(args.cpu_threads)
    from transformers import AutoTokenizer

    folder, _ = resolve_model_path(None)
    ws = windows(AutoTokenizer.from_pretrained(folder), args.window)[: args.windows]
    ref = reference(ws)
    rows = [("float32 reference (transformers)", ref)]
    rows.append(("core default", core_path(ws, args.cpu_threads, args.chunk)))
    rows.append(("core --quantization none", core_path(ws, args.cpu_threads, args.chunk, quantization="none")))
    if args.llama_cpp_python:
        rows.append(("llama.cpp (same GGUF)", llama_cpp(ws, args.llama_cpp_python, args.cpu_threads, args.chunk)))
    print(f"CPU: {cpu_model_name()}, {args.cpu_threads} threads; {len(ws)} windows of {args.window} tokens "
          f"(README + docs), chunks of {args.chunk}")
    print(f"{'path':<34} {'positions':>9} {'top-1 agree %':>13} {'NLL (nats)':>10} {'top ties':>8}")
    for name, got in rows:
        n, agree, nll, ties = score(ref, got, ws)
        print(f"{name:<34} {n:>9} {agree:>13.2f} {nll:>10.4f} {ties:>8}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
