"""The planner's pure core: load prediction, performance profiles, correction factors, replica maths and the
decision state machine (docs/planner.md). Modules import their numerical libraries (statsmodels, scipy,
matplotlib, prophet) where they are used, so importing one module does not load the others' dependencies."""
