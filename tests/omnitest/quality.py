"""How close two outputs are, for tests that compare a parallel or cached run with the plain one."""
from __future__ import annotations

import math

import torch


def psnr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    """Peak signal-to-noise ratio of ``got`` against ``want`` (peak: ``want``'s largest magnitude); inf if equal."""
    error = torch.mean((got.double() - want.double()) ** 2).item()
    peak = want.double().abs().max().item()
    return math.inf if error == 0 else 10 * math.log10(peak ** 2 / error)
