"""Multimodal processors (``register_multimodal_processors``): Qwen2-VL and Qwen2.5-VL
(``core_plugins.multimodal.qwen2_vl``)."""
