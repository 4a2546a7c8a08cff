"""The stream: plan rows -> tokens -> target forwards -> the trainers, one stream per node (no torch in feed/rows math)."""
