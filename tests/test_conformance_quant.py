"""The quant-method suite of the conformance kit: the built-in methods pass it, a correct
int8 method passes, and a method with a wrong scale, or one that runs where it declared it
cannot, is caught with a message naming the case."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.errors import CoreError
from core.plugins import load_plugins
from core.testing import check_plugin, quant_method_conformance


@pytest.fixture(autouse=True)
def _packed_kernels_only(monkeypatch):
    """These tests check the packed kernels: no dense copy for GEMMs of many rows (see packed.DENSE_MIN_ROWS)."""
    from core_plugins.quant import packed

    monkeypatch.setattr(packed, "DENSE_MIN_ROWS", None)


pytest_plugins = ["core.testing.pytest_plugin"]


@pytest.fixture(params=load_plugins().names("quant_method"))
def quant_method(request):
    """Every installed quant method."""
    return request.param


class Int8PerChannel:
    """A minimal symmetric per-output-channel int8 weight-only method, written for this test."""

    devices = ("cpu", "cuda")
    divisor = 127.0  # absmax / divisor is the scale

    def create_weights(self, layer, in_features, out_features, bias, dtype):
        layer.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        layer.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    def process_weights_after_loading(self, layer):
        w = layer.weight.data.float()
        absmax = w.abs().amax(1, keepdim=True).clamp_min(1e-8)
        layer.qweight = torch.round(w / (absmax / 127)).to(torch.int8)
        layer.scale = (absmax / self.divisor).squeeze(1)
        del layer.weight

    def dequantize(self, layer):
        return layer.qweight.float() * layer.scale[:, None]

    def apply(self, layer, x):
        return F.linear(x, self.dequantize(layer).to(x.dtype), layer.bias)


class WrongScale(Int8PerChannel):
    divisor = 63.5  # twice the right scale


class CudaOnly(Int8PerChannel):
    devices = ("cuda",)

    def check_device(self, device):
        return None if device.type == "cuda" else "int8 CUDA kernels only"


class AcceptsAnyDevice(Int8PerChannel):
    """Declares CUDA only, but its check_device lets the CPU through."""

    devices = ("cuda",)

    def check_device(self, device):
        return None


class CrashesWhereDeclared(Int8PerChannel):
    devices = ("cpu",)

    def apply(self, layer, x):
        raise RuntimeError("no kernel for this shape")


class Int8Checkpoint:
    """Loads pre-quantized checkpoints (``qweight`` int8, ``scale`` per row): no float weight."""

    devices = ("cpu",)

    def create_weights(self, layer, in_features, out_features, bias, dtype):
        layer.qweight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=torch.int8), requires_grad=False)
        layer.scale = torch.nn.Parameter(torch.empty(out_features, dtype=torch.float32), requires_grad=False)
        layer.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    def checkpoint_tensors(self, weight):
        """How a checkpoint in this format stores ``weight`` (for the conformance kit)."""
        scale = weight.abs().amax(1).clamp_min(1e-8) / 127
        return {"qweight": torch.round(weight / scale[:, None]).to(torch.int8), "scale": scale}

    def process_weights_after_loading(self, layer):
        return None

    def dequantize(self, layer):
        return layer.qweight.float() * layer.scale[:, None]

    def apply(self, layer, x):
        return F.linear(x, self.dequantize(layer).to(x.dtype), layer.bias)


class Int8CheckpointSwapsShards(Int8Checkpoint):
    """Loads the q and k shards of a packed layer into each other's rows."""

    def create_weights(self, layer, in_features, out_features, bias, dtype):
        super().create_weights(layer, in_features, out_features, bias, dtype)
        for p in (layer.qweight, layer.scale):
            p.data.zero_()  # rows the swapped loads miss stay zero, not whatever memory held (it once held the right rows)
            p.weight_loader = self._swapped(layer)

    @staticmethod
    def _swapped(layer):
        def load(param, loaded, shard=None):
            if shard is None:
                return param.data.copy_(loaded)
            idx = {"q": 1, "k": 0}.get(shard, layer.shard_names.index(shard))
            param.data.narrow(0, sum(layer.output_sizes[:idx]), loaded.shape[0]).copy_(loaded)
        return load


def test_a_checkpoint_format_method_loads_through_checkpoint_tensors():
    results = {r.case: r for r in check_plugin(Int8Checkpoint, "quant_method", device="cpu")}
    assert {c: r.status for c, r in results.items()} == {
        "device_support": "passed", "load_round_trip": "passed", "gemm_vs_dequantized": "passed", "gemm_vs_float": "passed"}
    results = {r.case: r for r in check_plugin(Int8CheckpointSwapsShards, "quant_method", device="cpu")}
    assert results["load_round_trip"].status == "failed" and results["gemm_vs_float"].status == "failed"
    assert "case 'load_round_trip': packed_qkv torch.float32: dequantized row" in results["load_round_trip"].message


def test_a_correct_int8_method_passes():
    results = {r.case: r.status for r in check_plugin(Int8PerChannel, "quant_method", device="cpu")}
    assert results == {"device_support": "passed", "load_round_trip": "passed", "gemm_vs_dequantized": "passed",
                       "gemm_vs_float": "passed"}


def test_a_wrong_scale_is_caught():
    results = {r.case: r for r in check_plugin(WrongScale, "quant_method", device="cpu")}
    assert results["gemm_vs_dequantized"].status == "passed"  # consistent with itself...
    assert results["load_round_trip"].status == "failed"  # ...but not with the weights it loaded
    assert results["gemm_vs_float"].status == "failed"
    assert results["load_round_trip"].message.startswith(
        "quant_method 'WrongScale' case 'load_round_trip': packed_qkv torch.float32: dequantized row")
    assert "away from the loaded weight (relative; allowed 0.15)" in results["load_round_trip"].message
    assert results["gemm_vs_float"].message.startswith("quant_method 'WrongScale' case 'gemm_vs_float': packed_qkv, 1 tokens")


def test_device_support_declaration_is_honoured_on_cpu():
    results = {r.case: r for r in check_plugin(CudaOnly, "quant_method", device="cpu")}
    assert results["device_support"].status == "passed"  # refused the CPU with a reason
    for case in ("load_round_trip", "gemm_vs_dequantized", "gemm_vs_float"):
        assert results[case].status == "skipped"
        assert results[case].message.startswith("the method cannot run on cpu: int8 CUDA kernels only")
    (r,) = check_plugin(AcceptsAnyDevice, "quant_method", device="cpu", cases=["device_support"])
    assert r.status == "failed"
    assert r.message == ("quant_method 'AcceptsAnyDevice' case 'device_support': declares devices ('cuda',) "
                         "but check_device(cpu) accepts it")
    (r,) = check_plugin(CrashesWhereDeclared, "quant_method", device="cpu", cases=["device_support"])
    assert r.status == "failed" and "case 'device_support': raised RuntimeError: no kernel for this shape" in r.message
