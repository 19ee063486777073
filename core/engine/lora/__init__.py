"""Multi-LoRA serving, the model side (issue 44): read peft adapters (``adapter``), keep them in
device slots that the shared layers add per-token deltas from (``pool``), and track which
adapters exist, who uses them and which are resident (``manager``)."""

from core.engine.lora.adapter import LoRAAdapter, LoRAError, read_adapter
from core.engine.lora.manager import LoRAManager
from core.engine.lora.pool import LayerLoRA, LoRAPool

__all__ = ["LayerLoRA", "LoRAAdapter", "LoRAError", "LoRAManager", "LoRAPool", "read_adapter"]
