"""Layer 4, the ``forge-verify`` command and what only it and the reports use: check,
report runner, demo, sharding report, clipping study, notebook and benchmark helpers.
Imports any layer below; nothing below imports it."""
