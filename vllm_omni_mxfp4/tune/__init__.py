"""``vllm-omni-mxfp4 tune``: which Linears and steps to keep in higher precision, under a budget.

- :mod:`.engine`: the tuning engine's worker extension (per-pass precision plans, local and step scores);
- :mod:`.scores`: scores from the engine's sums and from whole generations;
- :mod:`.select`: units, budgets, the selection, the static priors, the configs it writes;
- :mod:`.run`: the passes over the tuning and evaluation requests;
- :mod:`.report`: ``config.json``, ``scores.csv``, ``scores.json``, ``report.png`` and the summary.
"""
