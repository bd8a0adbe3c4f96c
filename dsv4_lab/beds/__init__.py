"""The GPU test beds, each a module run alone from the repository root: `python -m dsv4_lab.beds.NAME` (README.md)."""
