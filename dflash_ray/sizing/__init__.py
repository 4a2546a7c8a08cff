"""Sizing models: the capacity split and the memory model. Pure (no Ray, no torch): they belong with the plan."""
