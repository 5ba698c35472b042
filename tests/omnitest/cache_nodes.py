"""Host-test helpers shared by the composition tests: identity calibrations (TeaCache's rescale is the identity,
MagCache's curve a constant ratio) and the two Apply nodes run on them, and a tiny LoRA on a model's block linears."""
from __future__ import annotations

import torch


def save_identity_calibrations(name: str, steps: int, family: str = "wan") -> None:
    """Calibration files ``name`` for TeaCache and MagCache in ComfyUI's user directory."""
    from omnitest.pack import pack_module

    files = pack_module("nodes.caches.calibration_files")
    files.save("teacache", name, {"coefficients": [0, 0, 0, 1, 0], "family": family, "signal": "default"})
    files.save("magcache", name, {"family": family, "mag_ratios": [1.0] + [0.95] * (steps - 1)})


def _forecast(value: str | None, forward_budget: int | None = None, skip_correction: float | None = None) -> dict:
    """The optional ``forecast``, ``forward_budget`` and ``skip_correction`` inputs: each left out when None (as in a
    workflow saved before it existed)."""
    optional = {"forecast": value, "forward_budget": forward_budget, "skip_correction": skip_correction}
    return {name: v for name, v in optional.items() if v is not None}


def apply_teacache(model, calibration: str, threshold: float = 5.0, node_id: str = "21", forecast: str | None = None,
                   forward_budget: int | None = None, skip_correction: float | None = None):
    from omnitest.pack import pack_module, run_node

    return run_node(pack_module("nodes.caches.teacache").ApplyTeaCache, node_id=node_id, model=model,
                    rel_l1_thresh=threshold, start_percent=0.0, end_percent=1.0, cache_device="compute device",
                    model_variant="calibration: " + calibration,
                    **_forecast(forecast, forward_budget, skip_correction))[0]


def apply_magcache(model, calibration: str, threshold: float = 1.0, node_id: str = "22", forecast: str | None = None,
                   max_skip_steps: int = 3, forward_budget: int | None = None, skip_correction: float | None = None):
    from omnitest.pack import pack_module, run_node

    files = pack_module("nodes.caches.calibration_files")
    return run_node(pack_module("nodes.caches.magcache").ApplyMagCache, node_id=node_id, model=model,
                    threshold=threshold, max_skip_steps=max_skip_steps, retention_ratio=0.0, start_percent=0.0,
                    end_percent=1.0, cache_device="compute device", curve=files.option(calibration),
                    **_forecast(forecast, forward_budget, skip_correction))[0]


def last_summary() -> dict:
    """The summary of the newest run in the pack's statistics store."""
    from omnitest.pack import pack_module

    store = pack_module("nodes.stats_store")
    return store.get_run(store.recent_runs()[0]["run_id"])["summary"]


def tiny_lora(dm: torch.nn.Module, rank: int = 2, seed: int = 3) -> dict:
    """A LoRA state dict (kohya-style up/down/alpha) on every linear layer of the blocks."""
    g = torch.Generator().manual_seed(seed)
    lora = {}
    for name, m in dm.named_modules():
        if name.startswith("blocks.") and isinstance(m, torch.nn.Linear):
            key = f"diffusion_model.{name}"
            lora[f"{key}.lora_up.weight"] = torch.randn(m.out_features, rank, generator=g) * 0.1
            lora[f"{key}.lora_down.weight"] = torch.randn(rank, m.in_features, generator=g) * 0.1
            lora[f"{key}.alpha"] = torch.tensor(float(rank))
    return lora
