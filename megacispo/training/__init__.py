"""The training engine (model, optimizer, schedule) with its config sections, and the supervised warm start."""
