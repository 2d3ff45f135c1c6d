"""Rollout: generation engines behind one interface (rollout.engine) and the trainer-to-engine weight sync."""
