"""Layer 3, the kernel-change gate: its canonical cases, what it measures of each, and the
comparison with the committed baseline (baselines/gate.json). Imports the layers below."""
