"""Everything that knows ComfyUI: node classes, the run lifecycle, model families, statistics publishing."""
