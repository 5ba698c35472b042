"""The block-stack caches (Apply TeaCache, Apply MagCache and their Calibrate nodes): the shared machinery in
``base``, one module per cache, their published tables and the calibration files."""
