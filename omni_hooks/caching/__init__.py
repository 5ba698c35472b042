"""The cache core every block-stack cache (``omni_hooks.teacache``, ``omni_hooks.magcache``) shares: the run and its
hooks (``run.py``, ``hooks.py``), its config (``config.py``), what it keeps (``state.py``), the step rules it asks after
the policy (``rules.py``: nothing cached, another shape, the forward budget of ``budget.py``, ``few_step.py``,
``large_steps.py``, the model's own cache), what it does with the residuals besides keeping them (``residuals.py``:
the forecast of ``forecast.py``, the correction of ``skip_correction.py``, the calibration's step profile) and its
statistics (``stats.py``)."""
