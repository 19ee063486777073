"""HiCache storage backends (``--hicache-storage-backend``): ``file`` (``core_plugins.hicache.file``)."""
