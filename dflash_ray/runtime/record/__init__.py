"""The run record: the actor that writes the run directory (run_layout.py names its files) and what reads it back."""
