"""Generation: its config sections, the slot engine (generate), rollouts on processes of their own
(placement, weight_sync, remote)."""
