"""Side jobs on Ray: regenerate, prepare on Ray, compare interleave orders."""
