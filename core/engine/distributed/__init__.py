"""Tensor parallelism across processes: rank 0's group and per-step broadcast (``tensor_parallel.py``),
the other ranks' process (``tp_worker.py``), and the helpers ranks and data-parallel replicas share
(``collectives.py``)."""
