"""Shared test support: finding ComfyUI, building tiny real models, driving a real server."""
