"""Layer 0, numerics: bit views and ulp distances, the tolerance table, interval
enclosures, the Philox and mpmath references, the float64/interval rule references,
statistical radii, and the measured backend findings. Imports nothing else of the harness."""
