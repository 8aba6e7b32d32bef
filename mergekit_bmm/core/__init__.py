"""The BMM mathematics and tensor naming, importable without mergekit."""
