"""Held-out evaluation: its config section, the evaluator, pass@k, the megacispo.eval run and scoring."""
