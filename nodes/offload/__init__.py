"""CPU Offload: the node and its config (``node``), its sampling run (``session``), which blocks go where
(``placement``) and what ComfyUI itself offers and does (``host``)."""
