"""Reading and writing files: checkpoints, fingerprints, atomic writes, versioned JSON, recipes."""
