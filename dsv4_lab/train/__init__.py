"""Training a tiny DeepSeek-V4 (and its DSPARK draft) on real text; see README.md."""

import os

# the committed result of the training command recorded in TRAINED_REPORT
TRAINED_ARCHIVE = os.path.join(os.path.dirname(__file__), "dsv4-lab-tiny.tar.xz")
TRAINED_REPORT = os.path.join(os.path.dirname(__file__), "dsv4-lab-tiny.json")
