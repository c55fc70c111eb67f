"""dapo-plan: compiled memory and step-time estimates for a target slice."""
