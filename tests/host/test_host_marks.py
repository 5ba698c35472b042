"""``requires_comfy_class``: a test that needs a model class its host lacks skips in one line naming the ComfyUI
version and the class; one whose class exists runs."""
from __future__ import annotations

import pytest

from omnitest.comfy_path import comfyui_version, requires_comfy_class

pytestmark = pytest.mark.host


def test_a_missing_class_skips_naming_the_version_and_the_class():
    mark = requires_comfy_class("comfy.model_base", "NoSuchModelClass")
    assert mark.args == (True,)
    assert mark.kwargs["reason"] == f"ComfyUI {comfyui_version()} has no comfy.model_base.NoSuchModelClass"
    assert "\n" not in mark.kwargs["reason"]


def test_a_missing_module_skips_too_and_a_present_class_runs():
    assert requires_comfy_class("comfy.ldm.no_such_family.model", "Model").args == (True,)
    assert requires_comfy_class("comfy.model_base", "WAN21").args == (False,)


def test_the_host_version_is_read_from_the_host():
    import comfyui_version as host_version_module

    assert comfyui_version() == host_version_module.__version__
