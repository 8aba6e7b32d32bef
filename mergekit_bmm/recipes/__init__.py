"""mergekit recipes: the per-block shape BMM's λ and s take, and what a recipe resolves to."""
