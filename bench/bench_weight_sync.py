"""How long a trainer's full weight update takes: ``update_weights_from_tensor`` (in place, tensors
handed over in process) against ``update_weights_from_disk`` (a fresh module from a safetensors
folder), the same engine alternating between two sets of random weights of a real model shape.

    python bench/bench_weight_sync.py [--shape bench/shapes/smollm2-135m] [--dtype bfloat16] [--rounds 5]

Each update waits for an idle engine (none runs here), writes every tensor, remakes what is
derived from the weights (on the CPU in bf16: oneDNN's packed copies) and flushes the prefix
cache; a greedy request after each checks the engine answers as that set's reference does."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import core  # noqa: F401  (before torch: the CPU runtime's OpenMP settings)
import torch


def make_set(shape: Path, out: Path, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A random checkpoint of ``shape``'s config.json in ``out`` (safetensors); its tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    model.save_pretrained(out)
    (out / "config.json").write_text(json.dumps({**json.loads((out / "config.json").read_text()),
                                                 "torch_dtype": str(dtype).removeprefix("torch.")}))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="bench/shapes/smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cpu-threads", type=int, default=2)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        folders = [Path(tmp) / "a", Path(tmp) / "b"]
        sets = [make_set(Path(args.shape), f, seed, dtype) for f, seed in zip(folders, (0, 1))]
        nbytes = sum(t.numel() * t.element_size() for t in sets[0].values())
        eng = core.Engine(model_path=str(folders[0]), dtype=args.dtype, skip_tokenizer_init=True, device="cpu",
                          cpu_threads=args.cpu_threads, max_total_tokens=4096, log_level="warning")
        probe = {"input_ids": [1, 2, 3, 4, 5, 6, 7, 8], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        want = [eng.generate(**probe)["output_ids"]]
        eng.update_weights_from_disk(str(folders[1]))
        want.append(eng.generate(**probe)["output_ids"])
        times: dict[str, list[float]] = {"tensor": [], "disk": []}
        for _ in range(args.rounds):
            for i in (0, 1):
                t = time.perf_counter()
                ok, message = eng.update_weights_from_tensor(list(sets[i].items()))
                times["tensor"].append(time.perf_counter() - t)
                assert ok and eng.generate(**probe)["output_ids"] == want[i], message
                t = time.perf_counter()
                ok, message, _ = eng.update_weights_from_disk(str(folders[1 - i]))
                times["disk"].append(time.perf_counter() - t)
                assert ok and eng.generate(**probe)["output_ids"] == want[1 - i], message
        eng.shutdown()
    cpu = platform.processor() or platform.machine()
    print(f"# {Path(args.shape).name}, {args.dtype}, {nbytes / 1e6:.0f} MB of weights, {args.cpu_threads} threads, "
          f"torch {torch.__version__}, {cpu}; {2 * args.rounds} updates each way, alternating")
    print("| update | median ms | best ms | GB/s (median) |")
    print("|---|---:|---:|---:|")
    for name, label in (("tensor", "update_weights_from_tensor (in place)"),
                        ("disk", "update_weights_from_disk (fresh module)")):
        med = statistics.median(times[name])
        print(f"| {label} | {med * 1e3:.0f} | {min(times[name]) * 1e3:.0f} | {nbytes / med / 1e9:.2f} |")


if __name__ == "__main__":
    main()
