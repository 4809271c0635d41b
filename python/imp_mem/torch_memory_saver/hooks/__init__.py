"""The two hook modes (``"torch"``, ``"preload"``), named as torch_memory_saver names them."""
