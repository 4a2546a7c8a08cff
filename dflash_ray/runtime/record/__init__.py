"""The run record: every file of the run directory (layout.py) and the actor and client that write them."""
