"""Multi-LoRA kernel cost of one decoder layer (issue 44; CUDA only, not a timed test): the seven
projections of Llama-3.1-8B (qkv, o, gate_up, down as packed layers) for ``--tokens`` decode rows
over ``--adapters`` rank-``--rank`` slots (row i on slot i mod adapters), each way captured in a
CUDA graph and replayed ``--iters`` times; microseconds per layer and the ratio to ``base``.

- ``base``: the projections' GEMMs alone (torch), what a step without adapters runs.
- ``layer``: plus ``LayerLoRA``'s two launches per projection (``sgmv_shrink_split`` /
  ``sgmv_expand_parts``), rows grouped by slot as ``LoRAPool`` groups a decode.
- ``ungrouped``: the same launches, one segment per row (no token index).
- ``per-part``: ``sgmv_shrink`` without a K split and one ``sgmv_expand`` per part, one segment
  per row: the launch structure before the split-K and the one-launch expand.

``--block-n-decode`` and ``--max-splits`` override ``core_kernels.lora``'s constants, to compare tiles.

    python bench/bench_lora_kernels.py --tokens 64 --adapters 16 --rank 16
"""

from __future__ import annotations

import argparse

import torch

# (in features, the parts' output widths): qkv, o, gate_up, down
SHAPES = ((4096, (4096, 1024, 1024)), (4096, (4096,)), (4096, (14336, 14336)), (14336, (4096,)))


def segments_of(slots: list[int], group: bool, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(seg_start, seg_slot, tok_index): one segment per row, or the rows grouped by slot in
    chunks of 16 (``LoRAPool._write_decode``'s layout, without its padding segments)."""
    if not group:
        return (torch.arange(len(slots) + 1, dtype=torch.int32, device=dev),
                torch.tensor(slots, dtype=torch.int32, device=dev), None)
    order = sorted((s, t) for t, s in enumerate(slots) if s >= 0)
    starts: list[int] = []
    seg: list[int] = []
    for i, (s, _) in enumerate(order):
        if not seg or seg[-1] != s or i - starts[-1] == 16:
            starts.append(i)
            seg.append(s)
    starts.append(len(order))
    return tuple(torch.tensor(v, dtype=torch.int32, device=dev) for v in (starts, seg, [t for _, t in order]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--block-n-decode", type=int, default=None)
    ap.add_argument("--max-splits", type=int, default=None)
    args = ap.parse_args()
    from core_kernels import lora as L

    if args.block_n_decode:
        L.BLOCK_N_DECODE = args.block_n_decode
    if args.max_splits:
        L.MAX_SPLITS = args.max_splits
    dev, dt, t, r, s = torch.device("cuda"), torch.bfloat16, args.tokens, args.rank, args.adapters
    slots = [i % s for i in range(t)]
    layers = []
    for k, widths in SHAPES:
        n = sum(widths)
        spans = [(sum(widths[:i]), w) for i, w in enumerate(widths)]
        layers.append(dict(k=k, spans=spans, w=torch.randn(n, k, device=dev, dtype=dt) * k**-0.5,
                           a=torch.randn(s, len(widths) * r, k, device=dev, dtype=dt) * k**-0.5,
                           b=torch.randn(s, n, r, device=dev, dtype=dt) * r**-0.5,
                           x=torch.randn(t, k, device=dev, dtype=dt), y=torch.empty(t, n, device=dev, dtype=dt)))
    grouped, per_row = segments_of(slots, True, dev), segments_of(slots, False, dev)

    def base() -> None:
        for ly in layers:
            torch.matmul(ly["x"], ly["w"].t(), out=ly["y"])

    def fused(seg) -> None:
        start, slot, tok = seg
        msl = 16 if tok is not None else 1
        for ly in layers:
            torch.matmul(ly["x"], ly["w"].t(), out=ly["y"])
            h = L.sgmv_shrink_split(ly["x"], ly["a"], start, slot, msl, tok_index=tok)
            L.sgmv_expand_parts(h, ly["b"], start, slot, msl, ly["y"], ly["spans"], tok_index=tok)

    def per_part() -> None:
        start, slot, _ = per_row
        for ly in layers:
            torch.matmul(ly["x"], ly["w"].t(), out=ly["y"])
            h = torch.empty(t, ly["a"].shape[1], device=dev, dtype=dt)
            L.sgmv_shrink(ly["x"], ly["a"], start, slot, 1, h, splits=1)
            for p, (c0, w) in enumerate(ly["spans"]):
                L.sgmv_expand(h[:, p * r : (p + 1) * r], ly["b"][:, c0 : c0 + w], start, slot, 1, ly["y"][:, c0 : c0 + w])

    def timed(fn) -> float:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # compile outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(args.iters):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end) * 1e3 / args.iters

    runs = {"base": base, "layer": lambda: fused(grouped), "ungrouped": lambda: fused(per_row), "per-part": per_part}
    times = {name: timed(fn) for name, fn in runs.items()}
    print(f"# {torch.cuda.get_device_name()}; Llama-3.1-8B layer, {t} decode rows over {s} rank-{r} adapters; "
          f"BLOCK_N_DECODE {L.BLOCK_N_DECODE}, MAX_SPLITS {L.MAX_SPLITS}")
    for name, us in times.items():
        print(f"{name:<10}{us:>10.1f} us/layer{us / times['base']:>8.2f}x")


if __name__ == "__main__":
    main()
