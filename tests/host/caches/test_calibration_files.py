"""Calibration files (nodes/caches/calibration_files.py) and the calibrate nodes' name check (nodes/caches/inputs.py):
linked names, errors that name the file or folder, a variant list of loadable files only, saves that refuse non-finite
data and keep the previous file, an up-front writability check, and a fingerprint that follows the file's contents."""
from __future__ import annotations

import json
import logging
import math
import os

import pytest

pytestmark = pytest.mark.host

GOOD = {"kind": "teacache", "family": "wan", "signal": "default", "coefficients": [0, 0, 0, 1, 0]}


@pytest.fixture(scope="module")
def files(user_dir):
    from omnitest.pack import pack_module
    return pack_module("nodes.caches.calibration_files")


@pytest.fixture(scope="module")
def node_inputs(user_dir):
    from omnitest.pack import pack_module
    return pack_module("nodes.caches.inputs")


def write_raw(files, kind: str, name: str, text: str):
    folder = files.directory(kind)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(text)
    return path


def test_a_linked_name_passes_at_prompt_time_and_is_checked_at_execute(files, node_inputs):
    assert node_inputs.validate_calibration_name("TeaCache Calibrate", None) is True  # a link: no value yet
    assert node_inputs.validate_calibration_name("TeaCache Calibrate", "ok name") is True
    message = node_inputs.validate_calibration_name("TeaCache Calibrate", "../etc")
    assert message.startswith("TeaCache Calibrate: calibration name '../etc' may use letters")
    assert node_inputs.calibration_name("TeaCache Calibrate", "  padded ") == "padded"
    with pytest.raises(ValueError, match=r"^MagCache Calibrate: calibration name must be text, got nothing"):
        node_inputs.calibration_name("MagCache Calibrate", None)
    with pytest.raises(files.CalibrationFileError, match="must be text, got int"):
        files.check_name(5)


@pytest.mark.parametrize("text, expected", [
    (json.dumps({**GOOD, "signal": ["default"]}), "'signal' must be text, found list"),
    (json.dumps({**GOOD, "family": {"wan": 1}}), "'family' must be text, found dict"),
    ("[" * 100_000 + "]" * 100_000, "nests too deeply"),
    (json.dumps({"coefficients": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}),
     "nests more than 32 levels deep"),
    ("[1, 2]", "does not hold a JSON object"),
    ('{"coefficients": [NaN, 0, 0, 1, 0]}', r"coefficients\[0\] is nan"),
    ('{"coefficients": [0, 0, 0, 1, 0], "recommended_threshold": Infinity}', "recommended_threshold is inf"),
    (json.dumps({**GOOD, "kind": "magcache"}), "holds a 'magcache' calibration, not 'teacache'"),
    ("{not json", "cannot be read"),
])
def test_a_bad_file_is_an_error_naming_the_file(files, text, expected):
    path = write_raw(files, "teacache", "bad one", text)
    with pytest.raises(files.CalibrationFileError, match=expected) as info:
        files.load("teacache", "bad one")
    assert str(path) in str(info.value) and "run the calibrate node again" in str(info.value)


def test_a_file_too_large_to_be_a_calibration_is_refused_without_reading_it(files, monkeypatch):
    monkeypatch.setattr(files, "MAX_FILE_BYTES", 100)
    path = write_raw(files, "teacache", "large", json.dumps({**GOOD, "padding": "x" * 200}))
    with pytest.raises(files.CalibrationFileError, match=f"{path}.* more than a calibration file can be"):
        files.load("teacache", "large")


def test_the_variant_list_offers_only_files_that_load(files, caplog):
    kind = "listing"
    files.save(kind, "good", {"coefficients": [1, 2]})
    files.save(kind, "rejected by the node", {"coefficients": "none"})
    write_raw(files, kind, "broken", "{")
    write_raw(files, kind, "-not a valid name", "{}")
    write_raw(files, kind, "unhashable", json.dumps({"signal": ["a"]}))

    def needs_a_list(name, data):
        if not isinstance(data.get("coefficients"), list):
            raise ValueError(f"{name}: no coefficients")

    with caplog.at_level(logging.WARNING, logger="OmniHooks"):
        assert files.list_names(kind, validate=needs_a_list) == ["good"]
        assert files.list_names(kind, validate=needs_a_list) == ["good"]
    assert files.list_names(kind) == ["good", "rejected by the node"]
    skipped = [r.getMessage() for r in caplog.records if "not offering calibration file" in r.getMessage()]
    assert len(skipped) == 4  # each unloadable file once, not on every listing
    assert any("broken.json" in m and "cannot be read" in m for m in skipped)


@pytest.mark.parametrize("bad, where", [
    ({"coefficients": [0.0, math.nan, 0.0, 1.0, 0.0]}, r"coefficients\[1\] is nan"),
    ({"mag_ratios": {"cond": [1.0, math.inf]}}, r"mag_ratios.cond\[1\] is inf"),
    ({"recommended_threshold": -math.inf}, "recommended_threshold is -inf"),
])
def test_save_refuses_non_finite_data_and_keeps_the_previous_file(files, bad, where):
    previous = files.save("teacache", "keep me", GOOD)
    before = previous.read_bytes()
    with pytest.raises(files.CalibrationFileError, match=f"not saving calibration 'keep me' .*{where}"):
        files.save("teacache", "keep me", {**GOOD, **bad})
    assert previous.read_bytes() == before
    assert files.load("teacache", "keep me") == GOOD
    assert not [p for p in previous.parent.iterdir() if p.name.endswith(".tmp")]


def test_save_replaces_a_good_file_atomically(files):
    path = files.save("teacache", "replaced", GOOD)
    files.save("teacache", "replaced", {**GOOD, "coefficients": [0, 0, 0, 2, 0]})
    assert json.loads(path.read_text())["coefficients"] == [0, 0, 0, 2, 0]
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_an_unwritable_calibration_folder_is_named_up_front(files):
    root = files.directory("x").parent
    blocker = root / "blocked"
    blocker.write_text("a file where the kind's folder should be")
    try:
        with pytest.raises(files.CalibrationFileError, match=f"cannot write calibration files to {blocker}") as info:
            files.check_writable("blocked")
        assert "--user-directory" in str(info.value)
        with pytest.raises(files.CalibrationFileError, match=str(blocker)):
            files.save("blocked", "x", GOOD)
    finally:
        blocker.unlink()
    folder = files.check_writable("fresh kind")
    assert folder.is_dir() and list(folder.iterdir()) == []  # the scratch file is gone


def test_the_fingerprint_follows_the_file_contents(files):
    path = files.save("teacache", "printed", GOOD)
    first = files.fingerprint("teacache", "printed")
    assert files.fingerprint("teacache", "printed") == first
    stat = path.stat()
    files.save("teacache", "printed", {**GOOD, "coefficients": [0, 0, 0, 3, 0]})  # same size, other contents
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even with the old modification time
    assert path.stat().st_size == stat.st_size
    second = files.fingerprint("teacache", "printed")
    assert second != first
    assert files.fingerprint_option("teacache", "calibration: printed") == second
    assert files.fingerprint_option("teacache", "auto") == files.fingerprint_option("teacache", "wan2.1_t2v_1.3B") == ""
    path.unlink()
    assert files.fingerprint("teacache", "printed").startswith("unavailable")
    assert files.fingerprint("teacache", "../x").startswith("unavailable")
