"""The datapath stages: one file per stage, each holding the replacements its seams name (`dsv4_sm80/seams.py`)."""
