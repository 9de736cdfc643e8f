"""Layer 0, models and data for demos and integration tests: the tiny GPT and the shipped
corpus (nothing is downloaded). Imports nothing else of the harness."""
