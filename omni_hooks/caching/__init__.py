"""The cache core every block-stack cache (``omni_hooks.teacache``, ``omni_hooks.magcache``) shares: the run and its
hooks (``run.py``, ``hooks.py``), its config (``config.py``), what it keeps (``state.py``), the steps it always
computes (``few_step.py``, ``large_steps.py``) or computes at all (``budget.py``: a forward budget), what a skip's
residual is made of (``forecast.py``), what a computed step corrects (``skip_correction.py``) and its statistics
(``stats.py``)."""
