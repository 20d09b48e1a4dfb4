"""A/B comparison of runs on the same held-out prompts, seeds and noise (``python -m miles.compare``).

``paired``: paired differences, standard errors and verdicts; ``sources``: what a run argument
names (a run directory, an export, a checkpoint, an evaluation JSON) and its per-sample scores,
sampled by ``miles.eval``; ``report``: the table, the JSON, the curves from the runs' metrics and
the plot.
"""
