"""The quantization-method suite: the packed GEMM against dequantize-then-matmul and the float weights.

Each case builds core's :class:`~core.layers.Linear` with the method (a packed ``q/k/v``
layer whose shards load separately, and a single layer with a bias), loads random float
checkpoint weights through the parameters' ``weight_loader`` exactly as the engine does, then
calls ``process_weights_after_loading``. Errors are measured per output row, relative to the
row's norm, so a scale wrong on a few channels is caught as surely as a global one:

* ``load_round_trip``: ``dequantize(layer)`` (the optional method, see
  :class:`core.interfaces.QuantMethod`) is within the method's quantization error of the
  loaded weight, shard by shard;
* ``gemm_vs_dequantized``: ``apply(x)`` equals ``x @ dequantize(layer).T + bias`` within the
  GEMM tolerance, for 1, 7 and 33 tokens, in every activation dtype;
* ``gemm_vs_float``: ``apply(x)`` is within both tolerances of ``x @ W.T + b`` with the
  original float weight (runs without ``dequantize`` too);
* ``device_support``: what a method declares (``devices``, or ``check_device(device)``, which
  the engine asks at start-up) agrees with itself, and where it accepts the device it runs;
  on a device it refuses, the other cases are skipped with its reason.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from core.layers import Linear
from core.testing.suite import Case, Skipped, default_device, fail, resolve_target, seed_for

KIND = "quant_method"
ROUND_TRIP_RTOL = 0.15  # per-row ||dequantize(W) - W|| / ||W||: room for 4-bit group quantization
GEMM_RTOL: dict[torch.dtype, float] = {torch.float32: 1e-2, torch.float16: 2e-2, torch.bfloat16: 3e-2}
TOKENS = (1, 7, 33)


@attrs.define(frozen=True)
class LayerShape:
    name: str
    in_features: int
    output_sizes: tuple[int, ...]
    bias: bool
    shard_names: tuple[str, ...] = ()


LAYERS = (LayerShape("packed_qkv", 128, (64, 32, 32), False, ("q", "k", "v")), LayerShape("single_bias", 256, (64,), True))


@attrs.define
class QuantSubject:
    """A method under test, the device and activation dtypes, and its tolerances."""

    factory: Any
    label: str
    device: torch.device
    dtypes: tuple[torch.dtype, ...]
    round_trip_rtol: float = ROUND_TRIP_RTOL
    gemm_rtol: dict[torch.dtype, float] = attrs.Factory(lambda: dict(GEMM_RTOL))
    kind: str = KIND

    @classmethod
    def build(cls, target: Any, *, plugins: Any = None, device: Any = None, dtypes: Any = None,
              round_trip_rtol: float | None = None, gemm_rtol: dict | None = None) -> QuantSubject:
        factory, label = resolve_target(KIND, target, plugins)
        device = torch.device(device) if device is not None else default_device()
        dtypes = tuple(dtypes or (torch.float32, torch.bfloat16))
        return cls(factory, label, device, dtypes, round_trip_rtol or ROUND_TRIP_RTOL, {**GEMM_RTOL, **(gemm_rtol or {})})

    def declared_devices(self) -> tuple[str, ...] | None:
        declared = getattr(self.factory, "devices", None)
        if declared is None:
            return None
        return tuple(declared() if callable(declared) else declared)


def _weights(shape: LayerShape, gen: torch.Generator) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    shards = [torch.randn(n, shape.in_features, generator=gen) * 0.05 for n in shape.output_sizes]
    bias = torch.randn(sum(shape.output_sizes), generator=gen) * 0.1 if shape.bias else None
    return shards, bias


def _layer(s: QuantSubject, shape: LayerShape, dtype: torch.dtype, case: str
           ) -> tuple[Linear, torch.Tensor, torch.Tensor | None]:
    """A loaded, processed layer and the float weight and bias it was loaded from."""
    gen = torch.Generator().manual_seed(seed_for(KIND, shape.name))
    shards, bias = _weights(shape, gen)
    sizes = list(shape.output_sizes) if len(shape.output_sizes) > 1 else shape.output_sizes[0]
    with torch.device(s.device):
        layer = Linear(shape.in_features, sizes, shape.bias, s.factory(), dtype, shape.shard_names)
    params = dict(layer.named_parameters())
    # what a checkpoint holds for each shard: the float weight, or the method's own tensors for it
    to_ckpt = getattr(layer.quant_method, "checkpoint_tensors", None)
    if "weight" not in params and not callable(to_ckpt):
        raise Skipped(f"the method creates no float 'weight' parameter (it has {sorted(params)}) and has no "
                      f"checkpoint_tensors(weight) to write a float weight in its checkpoint format")
    ids = shape.shard_names if len(shards) > 1 else (None,)
    for shard_id, shard in zip(ids, shards):
        tensors = {"weight": shard} if "weight" in params else to_ckpt(shard)
        for name, t in tensors.items():
            if name not in params:
                raise fail(s, case, f"checkpoint_tensors returned {name!r}, not a parameter of the layer "
                                      f"({sorted(params)})")
            p = params[name]
            t = t.to(s.device, p.dtype) if t.is_floating_point() else t.to(s.device)
            p.weight_loader(p, t) if shard_id is None else p.weight_loader(p, t, shard_id)
    if bias is not None:
        b = params["bias"]
        getattr(b, "weight_loader", lambda p, t, *a: p.data.copy_(t))(b, bias.to(s.device, b.dtype))
    layer.quant_method.process_weights_after_loading(layer)
    # the reference is the float weight as the layer's dtype stored it before quantizing
    return layer, torch.cat(shards).to(dtype).float(), None if bias is None else bias.to(dtype).float()


def _row_error(got: torch.Tensor, want: torch.Tensor) -> tuple[float, int]:
    err = (got.float() - want.float()).norm(dim=-1) / want.float().norm(dim=-1).clamp_min(1e-6)
    row = int(err.argmax())
    return float(err[row]), row


def refusal(s: QuantSubject) -> str | None:
    """Why the method cannot run on the suite's device, as the engine asks at start-up: its
    ``check_device(device)`` when it has one, else its ``devices``; None when it can."""
    check = getattr(s.factory(), "check_device", None)
    if callable(check):
        return check(s.device) or None
    declared = s.declared_devices()
    if declared is not None and s.device.type not in declared:
        return f"it runs on {', '.join(declared)}"
    return None


def _supported_here(s: QuantSubject) -> None:
    if (reason := refusal(s)) is not None:
        raise Skipped(f"the method cannot run on {s.device.type}: {reason} (device_support checks the refusal)")


def _dequantize(s: QuantSubject, layer: Linear) -> torch.Tensor:
    fn = getattr(layer.quant_method, "dequantize", None)
    if not callable(fn):
        raise Skipped("the method has no dequantize(layer) (optional; gemm_vs_float still compares with the float weight)")
    return fn(layer)


def check_round_trip(s: QuantSubject) -> None:
    _supported_here(s)
    for shape in LAYERS:
        for dtype in s.dtypes:
            layer, w, _ = _layer(s, shape, dtype, "load_round_trip")
            deq = _dequantize(s, layer)
            if tuple(deq.shape) != tuple(w.shape):
                raise fail(s, "load_round_trip", f"{shape.name} {dtype}: dequantize gave shape {tuple(deq.shape)}, "
                                                 f"expected {tuple(w.shape)}")
            err, row = _row_error(deq.cpu(), w)
            if err > s.round_trip_rtol:
                raise fail(s, "load_round_trip", f"{shape.name} {dtype}: dequantized row {row} is {err:.3g} away from "
                                                 f"the loaded weight (relative; allowed {s.round_trip_rtol:g})")


def _apply(s: QuantSubject, layer: Linear, x: torch.Tensor, case: str, where: str) -> torch.Tensor:
    y = layer(x)
    if y.dtype != x.dtype or tuple(y.shape) != (x.shape[0], layer.out_features):
        raise fail(s, case, f"{where}: apply returned {tuple(y.shape)} {y.dtype}, expected "
                            f"{(x.shape[0], layer.out_features)} {x.dtype}")
    return y.float().cpu()


@torch.inference_mode()
def check_gemm(s: QuantSubject, against: str) -> None:
    _supported_here(s)
    case = f"gemm_vs_{against}"
    for shape in LAYERS:
        for dtype in s.dtypes:
            layer, w, b = _layer(s, shape, dtype, case)
            ref_w = _dequantize(s, layer).float().cpu() if against == "dequantized" else w
            tol = s.gemm_rtol.get(dtype, 3e-2) + (s.round_trip_rtol if against == "float" else 0.0)
            gen = torch.Generator().manual_seed(seed_for(KIND, case, shape.name))
            for t in TOKENS:
                x = torch.randn(t, shape.in_features, generator=gen).to(dtype)
                where = f"{shape.name}, {t} tokens, {dtype}"
                y = _apply(s, layer, x.to(s.device), case, where)
                want = x.float() @ ref_w.T + (0 if b is None else b)
                err, row = _row_error(y, want)
                if err > tol:
                    raise fail(s, case, f"{where}: output row {row} is {err:.3g} away from x @ {against} weight.T "
                                        f"(relative; allowed {tol:g})")


def check_device_support(s: QuantSubject) -> None:
    """The declaration agrees with itself and with what happens: ``check_device`` refuses a
    device outside ``devices``, and where the method accepts the device, it runs there."""
    declared, check = s.declared_devices(), getattr(s.factory(), "check_device", None)
    if declared is None and not callable(check):
        raise Skipped("the method declares neither devices nor check_device (the engine cannot refuse a device)")
    reason = refusal(s)
    if reason is not None:
        if not isinstance(reason, str):
            raise fail(s, "device_support", f"check_device({s.device}) returned {reason!r}, not a reason (str) or None")
        return  # refused: the engine stops start-up with this reason
    if declared is not None and s.device.type not in declared:
        raise fail(s, "device_support", f"declares devices {declared} but check_device({s.device}) accepts it")
    shape = LAYERS[1]
    layer, _, _ = _layer(s, shape, s.dtypes[0], "device_support")  # accepted here, so it must run here
    _apply(s, layer, torch.randn(2, shape.in_features, dtype=s.dtypes[0], device=s.device), "device_support",
           f"{shape.name} on {s.device.type}")


def quant_cases() -> list[Case]:
    return [
        Case("device_support", check_device_support, "declared devices run; others are refused by name"),
        Case("load_round_trip", check_round_trip, "dequantize(layer) is the loaded weight within the quantization error"),
        Case("gemm_vs_dequantized", lambda s: check_gemm(s, "dequantized"), "apply(x) == x @ dequantize(layer).T + b"),
        Case("gemm_vs_float", lambda s: check_gemm(s, "float"), "apply(x) is near x @ W.T + b for the float weight"),
    ]
