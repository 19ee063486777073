"""Data parallelism: ``--dp-size N`` whole engines in their own processes behind one front end
(``engine.py``), each replica's process (``replica.py``) and the policy that picks one (``router.py``)."""
