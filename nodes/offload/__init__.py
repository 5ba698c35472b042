"""CPU Offload: the node and its run (``node``), and which blocks go where (``placement``)."""
