"""From a checkpoint to a model on the device: reading HF folders and GGUF files (``loader.py``),
the GGUF conversion cache (``gguf_cache.py``), hub ids (``hub.py``), building a model the same way
on every rank (``model_build.py``), and reloading weights in place (``weight_update.py``)."""
