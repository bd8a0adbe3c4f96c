"""Training a tiny DeepSeek-V4 (and its DSPARK draft) on real text; see README.md."""
