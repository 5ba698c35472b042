"""Sequence Parallel: the node and rank 0's session (``node``), rank 0's group of ranks (``group``), what the ranks
say to each other (``protocol``), a worker rank's state (``rank``) and the worker process (``worker``)."""
