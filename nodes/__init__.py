"""Everything that knows ComfyUI: node classes, the run lifecycle, model adapters, statistics publishing."""
