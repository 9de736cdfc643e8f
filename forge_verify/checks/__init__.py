"""Layer 1, the checks: the rule catalog, seeded problems and storage regimes, hypothesis
strategies and profiles, the claims as functions, observations, the deviation study and
the torch.optim comparisons. Imports numerics and models only."""
